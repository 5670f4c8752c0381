"""The DeepSeek/GLM router pieces against NumPy written here from DeepSeek-V3's published
rules, and the configuration errors of MLA / group routing / MTP.

* group-limited top-k: group score = sum of the group's 2 best (score + bias); experts outside
  the ``topk_group`` best groups never win; weights are the unbiased sigmoid scores of the
  chosen experts, renormalised when ``norm_topk_prob``, times ``routed_scaling_factor``;
* sequence-wise aux loss: per sequence ``sum_e f_e P_e``, ``f_e = E / (k s) * count_e``,
  ``P_e`` = mean over the sequence of ``score / sum(score)``, averaged over sequences.

Tolerance 1e-6 (float32 sigmoid / sums of 8 terms against float64)."""
import numpy as np
import pytest
from mindspore import Tensor

from ms_llm.models.config import TransformerConfig
from ms_llm.models.moe import TopKRouter

E, K, G, GK, H = 8, 3, 4, 2, 16


def numpy_route(x, w, bias, norm, scale):
    scores = 1 / (1 + np.exp(-(x @ w.T)))
    choice = scores + bias
    grouped = choice.reshape(len(x), G, E // G)
    gscore = np.sort(grouped, -1)[..., -2:].sum(-1)
    top_groups = np.argsort(-gscore, -1)[:, :GK]
    masked = np.full_like(choice, -np.inf)
    for t in range(len(x)):
        for g in top_groups[t]:
            masked[t, g * (E // G):(g + 1) * (E // G)] = choice[t, g * (E // G):(g + 1) * (E // G)]
    idx = np.argsort(-masked, -1)[:, :K]
    wts = np.take_along_axis(scores, idx, -1)
    if norm:
        wts = wts / wts.sum(-1, keepdims=True)
    return np.sort(idx, -1), wts * scale, scores


def numpy_seq_aux(scores, idx, b, s):
    p = scores / scores.sum(-1, keepdims=True)
    out = 0.0
    for i in range(b):
        counts = np.bincount(idx[i * s:(i + 1) * s].reshape(-1), minlength=E)
        out += (counts * E / (K * s) * p[i * s:(i + 1) * s].mean(0)).sum()
    return out / b


def _router(norm=True):
    c = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=2, mlp_type="moe",
                          num_moe_experts=E, moe_router_topk=K, moe_ffn_hidden_size=8,
                          moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                          moe_router_num_groups=G, moe_router_group_topk=GK,
                          moe_router_norm_topk_prob=norm, moe_router_topk_scaling_factor=2.5,
                          moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.1)
    return TopKRouter(c)


@pytest.mark.parametrize("norm", [True, False])
def test_group_limited_routing_and_seq_aux_loss_match_numpy(norm):
    rng = np.random.default_rng(3)
    router = _router(norm)
    w = rng.standard_normal((E, H)).astype(np.float32)
    bias = (0.3 * rng.standard_normal(E)).astype(np.float32)
    router.weight.set_data(Tensor(w))
    router.expert_bias.set_data(Tensor(bias))
    b, s = 3, 5
    x = rng.standard_normal((b * s, H)).astype(np.float32)
    router.seq_length = s
    probs, idx = router(Tensor(x))
    idx, probs = idx.asnumpy(), probs.asnumpy()
    order = np.argsort(idx, -1)
    want_idx, _, scores = numpy_route(x.astype(np.float64), w.astype(np.float64),
                                           bias.astype(np.float64), norm, 2.5)
    np.testing.assert_array_equal(np.take_along_axis(idx, order, -1), want_idx)
    got_sorted = np.take_along_axis(probs, order, -1)       # weights by ascending expert id
    want_by_expert = np.take_along_axis(scores, want_idx, -1)
    if norm:
        want_by_expert = want_by_expert / want_by_expert.sum(-1, keepdims=True)
    np.testing.assert_allclose(got_sorted, want_by_expert * 2.5, rtol=1e-6, atol=1e-6)
    want_aux = 0.1 * numpy_seq_aux(scores, want_idx, b, s)
    np.testing.assert_allclose(float(router.aux_loss.asnumpy()), want_aux, rtol=1e-6)


@pytest.mark.parametrize("kwargs,match", [
    (dict(moe_router_num_groups=3, moe_router_group_topk=1), "moe_router_num_groups"),
    (dict(moe_router_num_groups=4, moe_router_group_topk=5), "moe_router_num_groups"),
    (dict(mtp_num_layers=-1), "mtp_num_layers"),
    (dict(mtp_loss_scaling_factor=-0.1), "mtp_loss_scaling_factor"),
    (dict(multi_latent_attention=True, qk_pos_emb_head_dim=7), "qk_pos_emb_head_dim"),
    (dict(multi_latent_attention=True, q_lora_rank=0), "q_lora_rank"),
    (dict(rotary_percent=1.5), "rotary_percent"),
    (dict(kv_channels=10, rotary_percent=0.5), "rotary_percent"),
])
def test_config_errors_are_one_line(kwargs, match):
    base = dict(num_layers=1, hidden_size=16, num_attention_heads=2, mlp_type="moe",
                num_moe_experts=8, moe_router_topk=2, moe_router_score_function="sigmoid")
    with pytest.raises(ValueError, match=match) as e:
        TransformerConfig(**{**base, **kwargs})
    assert "\n" not in str(e.value)


def test_mla_tensor_parallel_placements():
    """Rank 1 of tp=2 (no collective runs at build time): the up-projections hold heads 2-3 as
    a ("tp", 0) shard, ``linear_proj`` the matching columns as ("tp", 1); the down-projections
    and their norms stay whole, with full (not partial) gradients."""
    from types import SimpleNamespace

    from ms_llm.models.gpt import GPTModel
    from ms_llm.parallel.parallelize import describe_layouts
    from ms_llm.parallel.placement import placement_of
    from ms_llm.parallel.tensor_parallel import apply_tensor_parallel
    c = TransformerConfig(num_layers=1, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                          padded_vocab_size=64, multi_latent_attention=True, q_lora_rank=24,
                          kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8)
    model = GPTModel(c)
    attn = model.decoder.layers[0].self_attention
    full = {n: attn.__getattr__(n).weight.asnumpy().copy() for n in (
        "linear_q_up_proj", "linear_kv_up_proj", "linear_proj", "linear_q_down_proj",
        "linear_kv_down_proj")}
    describe_layouts(model)          # parallelize_model's first step ([gate; up] halves)
    apply_tensor_parallel(model, SimpleNamespace(size=2, rank=1))
    for name, dim in (("linear_q_up_proj", 0), ("linear_kv_up_proj", 0), ("linear_proj", 1)):
        w = attn.__getattr__(name).weight
        assert placement_of(w).shards == (("tp", dim),), name
        np.testing.assert_array_equal(w.asnumpy(), np.split(full[name], 2, axis=dim)[1])
    for name in ("linear_q_down_proj", "linear_kv_down_proj"):
        w = attn.__getattr__(name).weight
        assert placement_of(w).shards == () and placement_of(w).partial == (), name
        np.testing.assert_array_equal(w.asnumpy(), full[name])
    for norm in (attn.q_layernorm, attn.kv_layernorm):
        assert placement_of(norm.weight).partial == ()
    assert attn.rope_key_grad.func.__name__ == "copy_to_group"


def test_hf_config_errors_name_the_file_and_key():
    from ms_llm.models.families import config_from_hf
    base = {"model_type": "deepseek_v3", "num_hidden_layers": 2, "hidden_size": 32,
            "intermediate_size": 64, "moe_intermediate_size": 16, "num_attention_heads": 4,
            "vocab_size": 64, "n_routed_experts": 4, "num_experts_per_tok": 2,
            "first_k_dense_replace": 1, "kv_lora_rank": 16, "q_lora_rank": None,
            "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8}
    assert config_from_hf(base).multi_latent_attention
    with pytest.raises(ValueError, match=r"^x/config.json: attention_bias=true"):
        config_from_hf(dict(base, attention_bias=True), source="x/config.json")
    with pytest.raises(ValueError, match=r"^x/config.json: missing key 'kv_lora_rank'"):
        config_from_hf({k: v for k, v in base.items() if k != "kv_lora_rank"},
                       source="x/config.json")
    with pytest.raises(ValueError, match="leaves no MoE layer"):
        config_from_hf(dict(base, first_k_dense_replace=2))
