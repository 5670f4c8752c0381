"""DeepSeek-V3 (MLA, YaRN mscale, group-limited sigmoid routing with expert bias, shared experts,
dense first layers) and GLM-4.5 (partial rotary, QKV bias, QK-norm, same router) loaded with
``from_pretrained`` from folders transformers wrote, against transformers itself.

Tolerances (both sides compute in float32):

* logits 1e-4 absolute (rtol 1e-4): logits reach ~5; float32 rounding through 3 layers of
  64-wide matmuls gives ~1e-6..1e-5, while a wrong rope layout / scale / routing gives O(0.1).
* loss and global grad norm 1e-5 relative: sums over ~1e5 float32 terms accumulate ~1e-6
  relative error; a missing gradient path changes the norm by > 1e-3.
* chosen experts per token: identical sets (a routing bug is a discrete change).
"""
from __future__ import annotations

import numpy as np
import pytest

from helpers import deepseek_fixtures as fx

import transformers  # noqa: E402,F401  (test extra: cross-checks against HF modeling code)
from helpers.paths import ROOT


@pytest.fixture(scope="module", params=list(fx.CASES))
def case(request, tmp_path_factory):
    kind, kwargs = fx.CASES[request.param]
    hf = fx.build_hf(kind, kwargs, seed=len(request.param))
    path = str(tmp_path_factory.mktemp(request.param))
    hf.save_pretrained(path)
    from ms_llm.checkpoint import from_pretrained
    return request.param, hf, from_pretrained(path), path


def _ms_loss_grad_norm(model, ids, labels):
    import mindspore as ms
    mask = ms.Tensor((labels != -100).astype(np.float32))
    params = model.trainable_params()

    def fn(x, y):
        per_tok = model(x, labels=y)
        return (per_tok * mask).sum() / mask.sum()

    loss, grads = ms.value_and_grad(fn, None, params)(ms.Tensor(ids.astype(np.int32)),
                                                      ms.Tensor(labels.astype(np.int32)))
    norm = float(np.sqrt(sum((g.asnumpy().astype(np.float64) ** 2).sum() for g in grads)))
    return float(loss.asnumpy()), norm


def test_matches_transformers(case):
    import mindspore as ms
    from ms_llm.models.moe import moe_layers
    name, hf, model, _ = case
    ids, labels = fx.batch()
    want_logits, want_loss, want_norm, want_routes = fx.hf_reference(hf, ids, labels)
    got = model(ms.Tensor(ids.astype(np.int32))).asnumpy().astype(np.float64)
    np.testing.assert_allclose(got, want_logits, rtol=1e-4, atol=1e-4, err_msg=name)
    layers = {i: l.mlp for i, l in enumerate(model.decoder.layers)}
    assert sorted(want_routes) == [i for i, m in layers.items() if m in moe_layers(model)]
    for i, want in want_routes.items():
        got_idx = np.sort(layers[i].last_top_indices.asnumpy(), -1)
        assert np.array_equal(got_idx, want), f"{name}: layer {i} routing differs"
    loss, norm = _ms_loss_grad_norm(model, ids, labels)
    assert abs(loss - want_loss) <= 1e-5 * abs(want_loss), (name, loss, want_loss)
    assert abs(norm - want_norm) <= 1e-5 * want_norm, (name, norm, want_norm)


def test_expert_bias_loaded_and_updates(case):
    """``e_score_correction_bias`` lands in ``router.expert_bias`` (fp32, not trained) and the
    aux-loss-free update moves it by rate * sign(mean - count)."""
    from ms_llm.models.moe import moe_layers, update_expert_bias
    _, hf, model, _ = case
    hf_bias = hf.model.layers[1].mlp.gate.e_score_correction_bias.numpy()
    router = moe_layers(model)[0].router
    before = router.expert_bias.asnumpy().copy()
    np.testing.assert_array_equal(before, hf_bias)
    assert not router.expert_bias.requires_grad
    counts = np.arange(router.num_experts, dtype=np.float64)
    router.local_tokens_per_expert = counts.copy()
    update_expert_bias(router)
    step = np.sign(counts.mean() - counts) * model.config.moe_router_bias_update_rate
    np.testing.assert_allclose(router.expert_bias.asnumpy(), before + step, rtol=0, atol=1e-7)
    router.expert_bias.set_data(ms_tensor(before))


def ms_tensor(x):
    import mindspore as ms
    return ms.Tensor(x)


def test_greedy_generation_with_kv_cache_matches_transformers(case):
    """``generate`` (KV cache of full per-head K/V) against transformers' greedy decoding
    (which caches MLA's compressed latent): the same tokens."""
    import torch
    from ms_llm.inference import generate
    name, hf, model, _ = case
    prompt = np.random.default_rng(5).integers(0, fx.VOCAB, (2, 7))
    got = generate(model, prompt, 6)
    with torch.no_grad():
        want = hf.generate(torch.tensor(prompt), max_new_tokens=6, do_sample=False,
                           min_new_tokens=6, eos_token_id=None, pad_token_id=0).numpy()
    np.testing.assert_array_equal(got, want, err_msg=name)


def test_published_configs():
    """configs/deepseek_v3.yaml and glm45.yaml hold the published architectures: total
    parameters from an independent count (671.0B for DeepSeek-V3 without its MTP module, 685B
    with it as the model card counts; 352.8B for GLM-4.5 without its MTP layer), and the count
    formula equals the built proxy's parameter count, with and without MTP depths."""
    import os
    from ms_llm.config import load_config
    from ms_llm.models.gpt import GPTModel
    root = os.path.join(ROOT, "configs")

    def count(c):
        H, tot = c.hidden_size, 2 * c.padded_vocab_size * c.hidden_size + c.hidden_size
        # MTP depths: a layer like the last one plus enorm, hnorm, eh_proj, final_layernorm
        tot += (c.mtp_num_layers or 0) * (3 * H + 2 * H * H)
        for i in list(range(c.num_layers)) + [c.num_layers - 1] * (c.mtp_num_layers or 0):
            if c.multi_latent_attention:
                nh, qd = c.num_attention_heads, c.qk_head_dim + c.qk_pos_emb_head_dim
                a = (c.q_lora_rank * (H + 1 + nh * qd) + (c.kv_lora_rank + c.qk_pos_emb_head_dim) * H
                     + c.kv_lora_rank + nh * (c.qk_head_dim + c.v_head_dim) * c.kv_lora_rank
                     + H * nh * c.v_head_dim)
            else:
                d, q = c.kv_channels, c.num_attention_heads + 2 * c.num_query_groups
                a = q * d * (H + 1) + c.num_attention_heads * d * H + 2 * d
            if c.is_moe_layer(i):
                m = (3 * H * c.moe_ffn_hidden_size * c.num_moe_experts + c.num_moe_experts * H
                     + 3 * H * c.moe_shared_expert_intermediate_size
                     + c.num_moe_experts)     # expert bias
            else:
                m = 3 * H * c.ffn_hidden_size
            tot += a + m + 2 * H
        return tot

    ds = load_config(os.path.join(root, "deepseek_v3.yaml")).model
    assert ds.mtp_num_layers == 1
    assert abs(count(ds.replace(mtp_num_layers=None)) - 671.0e9) < 0.1e9
    # DeepSeek's model card: 685B on the Hub = 671B main model + 14B MTP module, the module
    # counting its own copies of the embedding and head (shared here: 2 V H fewer)
    V, H = ds.padded_vocab_size, ds.hidden_size
    assert abs(count(ds) + 2 * V * H - 685e9) < 0.6e9
    assert abs(count(ds) + 2 * V * H - count(ds.replace(mtp_num_layers=None)) - 14e9) < 0.6e9
    assert ds.moe_router_num_groups == 8 and ds.moe_router_group_topk == 4
    glm = load_config(os.path.join(root, "glm45.yaml")).model
    assert abs(count(glm.replace(mtp_num_layers=None)) - 352.8e9) < 0.1e9
    assert glm.rotary_dim == 64 and glm.mtp_num_layers == 1
    proxy = load_config(os.path.join(root, "deepseek_v3_proxy.yaml")).model
    assert GPTModel(proxy).num_parameters() == count(proxy)
    with_mtp = proxy.replace(mtp_num_layers=2)
    assert GPTModel(with_mtp).num_parameters() == count(with_mtp)


def test_bf16_sharded_folder_loads(tmp_path):
    """A BF16 DeepSeek-V3 folder in several safetensors shards (the router's
    ``e_score_correction_bias`` stays float32, as HF keeps it) loads; its logits equal
    transformers' on the same folder read as float32 (1e-4, as above)."""
    import json
    import os

    import mindspore as ms
    import torch
    import transformers as tf
    from ms_llm.checkpoint import from_pretrained
    kind, kwargs = fx.CASES["deepseek_q_lora"]
    hf = fx.build_hf(kind, kwargs, seed=11).to(torch.bfloat16)
    hf.save_pretrained(str(tmp_path), max_shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert os.path.isfile(tmp_path / "config.json")
    ref = tf.DeepseekV3ForCausalLM.from_pretrained(str(tmp_path), torch_dtype=torch.float32)
    ref.config._attn_implementation = "eager"
    ids, _ = fx.batch()
    with torch.no_grad():
        want = ref.eval()(torch.tensor(ids)).logits.numpy()
    got = from_pretrained(str(tmp_path))(ms.Tensor(ids.astype(np.int32))).asnumpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
