"""Multi-token prediction for Qwen3-Next (one depth, HF ``mtp.*``: ``fc``, ``pre_fc_norm_embedding``,
``pre_fc_norm_hidden``, ``layers.0.*`` a full-attention MoE decoder layer, ``norm``), through the
DeepSeek-V3 MTP path (Megatron-Core's ``mtp.layers.0.{enorm,hnorm,eh_proj,transformer_layer,
final_layernorm}``, its loss).

Reference: transformers ignores ``mtp.*`` (its MTP is a speculative-decoding model elsewhere),
so the test composes the head in torch from transformers' Qwen3-Next modules as the published
MTP runs it (vLLM's ``Qwen3NextMultiTokenPredictor``): ``fc(cat(norm_e(embed(x shifted)),
norm_h(h)))`` -> the decoder layer -> ``norm`` -> the shared ``lm_head``, with ``h`` the main
model's final (normed) hidden states and zero-centred RMSNorms everywhere; the loss is written
out here as in tests/models/test_deepseek_mtp.py (Megatron-Core's per-token form).

Tolerances against the float64 reference: loss and the MTP depth's loss 1e-5 relative (measured
~2e-7); global grad norm 1e-4 relative: with unit-scale weights the first DeltaNet layer's input
gradients pass an ill-conditioned triangular solve, where float32 itself is ~2e-5 (transformers
in float32) to ~4e-5 (here) from float64, measured; a wrong norm form (w vs 1 + w), concat order
or shift moves these by > 1e-3. Conversion is bit-exact."""
from __future__ import annotations

import glob
import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import transformers  # noqa: F401  (test extra: the reference's modules)

from helpers.deepseek_fixtures import run_convert, same_bits
from ms_llm.checkpoint import torch_pickle as tp
from ms_llm.checkpoint.hf.io import read_hf_weights
from ms_llm.models.registry import get_family

L, SCALE = 4, 0.3


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """(HF folder with L layers + mtp.*, transformers' model holding L + 1 layers, MTP norms and
    fc). The MTP decoder layer is the big model's layer L (full attention, MoE)."""
    import torch
    root = tmp_path_factory.mktemp("q3n_mtp")
    tiny = dict(get_family("qwen3-next").tiny_hf)
    tiny.pop("full_attention_interval")
    types = ["linear_attention", "full_attention"] * (L // 2) + ["full_attention"]
    cfg = transformers.Qwen3NextConfig(**dict(tiny, num_hidden_layers=L + 1, layer_types=types))
    big = transformers.Qwen3NextForCausalLM(cfg)
    big.config._attn_implementation = "eager"
    H = cfg.hidden_size
    extra = torch.nn.ModuleDict({
        "fc": torch.nn.Linear(2 * H, H, bias=False),
        **{n: transformers.models.qwen3_next.modeling_qwen3_next.Qwen3NextRMSNorm(H, 1e-6)
           for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}})
    g = torch.Generator().manual_seed(21)
    with torch.no_grad():
        for p in list(big.parameters()) + list(extra.parameters()):
            p.copy_(0.3 * torch.randn(p.shape, generator=g) if p.ndim == 1
                    else torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    big.float()
    big.save_pretrained(str(root / "big"))
    # the reference runs in float64 from the stored float32 values (eager expert loop: torch's
    # grouped GEMM has no float64)
    for mod in big.modules():
        if hasattr(mod, "config"):
            mod.config._experts_implementation = "eager"
    big.double()
    extra.double()
    w = load_file(str(root / "big" / "model.safetensors"))
    out = {}
    for k, v in w.items():
        if k.startswith(f"model.layers.{L}."):
            out["mtp.layers.0." + k[len(f"model.layers.{L}."):]] = v
        else:
            out[k] = v
    for n, m in extra.items():
        out[f"mtp.{n}.weight"] = m.weight.detach().float().numpy().copy()
    hf_cfg = json.load(open(root / "big" / "config.json"))
    hf_cfg.update(num_hidden_layers=L, layer_types=types[:L], mtp_num_hidden_layers=1)
    os.makedirs(root / "hf")
    with open(root / "hf" / "config.json", "w") as f:
        json.dump(hf_cfg, f)
    save_file(out, str(root / "hf" / "model.safetensors"), metadata={"format": "pt"})
    return root, big, extra


def _batch():
    rng = np.random.default_rng(4)
    ids = rng.integers(0, 96, size=(2, 24)).astype(np.int64)
    labels = np.concatenate([ids[:, 1:], np.zeros((2, 1), np.int64)], 1)
    mask = np.ones(labels.shape, np.float32)
    mask[:, -1] = 0.0
    mask[1, 7] = 0.0
    return ids, labels, mask


def _reference(big, extra, ids, labels, mask):
    import torch
    F = torch.nn.functional
    big.train()
    big.zero_grad()
    extra.zero_grad()
    b, s = ids.shape
    x = torch.tensor(ids)
    pos = torch.arange(s)[None].expand(b, s)
    causal = torch.full((s, s), float("-inf")).triu(1)[None, None]
    model = big.model
    h = model.embed_tokens(x)
    pe = model.rotary_emb(h, pos)
    for layer in model.layers[:L]:
        mask4 = causal if layer.block_type == "full_attention" else None
        h = layer(h, position_embeddings=pe, attention_mask=mask4, position_ids=pos)
    h = model.norm(h)
    lab, msk = torch.tensor(labels), torch.tensor(mask)
    n = msk.sum()

    def ce(hidden, target):
        logits = big.lm_head(hidden)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                               reduction="none").reshape(b, s)

    total = (ce(h, lab) * msk).sum() / n
    x = torch.cat([x[:, 1:], torch.zeros_like(x[:, :1])], 1)
    lab = torch.cat([lab[:, 1:], torch.zeros_like(lab[:, :1])], 1)
    msk = torch.cat([msk[:, 1:], torch.zeros_like(msk[:, :1])], 1)
    e = extra["pre_fc_norm_embedding"](model.embed_tokens(x))
    hm = extra["fc"](torch.cat([e, extra["pre_fc_norm_hidden"](h)], -1))
    hm = model.layers[L](hm, position_embeddings=pe, attention_mask=causal, position_ids=pos)
    hm = extra["norm"](hm)
    summed = (ce(hm, lab) * msk).sum()
    mean = float(summed.detach() / msk.sum())
    total = total + SCALE * summed * (n / msk.sum()) / n
    total.backward()
    params = list(big.parameters()) + list(extra.parameters())
    norm = float(torch.sqrt(sum((q.grad.double() ** 2).sum() for q in params
                                if q.grad is not None)))
    return float(total.detach()), norm, mean


def _ms_loss(model, ids, labels, mask):
    import mindspore as ms
    m = ms.Tensor(mask)
    inv = ms.Tensor(np.float32(1.0 / mask.sum()))
    params = model.trainable_params()

    def fn(x, y):
        return (model(x, labels=y) * m).sum() * inv + model.mtp_loss(m)[0] * inv

    loss, grads = ms.value_and_grad(fn, None, params)(ms.Tensor(ids.astype(np.int32)),
                                                      ms.Tensor(labels.astype(np.int32)))
    norm = float(np.sqrt(sum((g.asnumpy().astype(np.float64) ** 2).sum() for g in grads)))
    return float(loss.asnumpy()), norm, float(model.mtp_loss(m)[1][0].asnumpy())


def test_mtp_loss_and_grads_match_reference(folder):
    from ms_llm.checkpoint import from_pretrained
    from ms_llm.checkpoint.hf.io import read_hf_config
    from ms_llm.models.families import config_from_hf
    root, big, extra = folder
    cfg = config_from_hf(read_hf_config(str(root / "hf"))).replace(
        mtp_num_layers=1, mtp_loss_scaling_factor=SCALE)
    model = from_pretrained(str(root / "hf"), config=cfg)
    ids, labels, mask = _batch()
    want = _reference(big, extra, ids, labels, mask)
    got = _ms_loss(model, ids, labels, mask)
    np.testing.assert_allclose(got[2], want[2], rtol=1e-5)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-4)
    # without model.mtp_num_layers the folder's mtp.* are skipped (the main model loads)
    plain = from_pretrained(str(root / "hf"))
    assert plain.mtp is None


def test_mtp_converts_hf_mg_hf_bit_exact_with_megatron_keys(folder, tmp_path):
    root, _, _ = folder
    run_convert("--load-model-type", "hf", "--save-model-type", "mg", "--model-type-hf",
                "qwen3-next", "--load-dir", root / "hf", "--save-dir", tmp_path / "mg",
                "--target-tensor-parallel-size", "2", "--target-expert-parallel-size", "2")
    f = sorted(glob.glob(str(tmp_path / "mg" / "iter_0000001" / "mp_rank_00*" /
                             "model_optim_rng.pt")))[0]
    keys = set(tp.load(f)["model"])
    for k in ("mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight",
              "mtp.layers.0.eh_proj.weight", "mtp.layers.0.final_layernorm.weight",
              "mtp.layers.0.transformer_layer.self_attention.q_proj.weight",
              "mtp.layers.0.transformer_layer.mlp.shared_experts.gate_weight"):
        assert k in keys, k
    run_convert("--load-model-type", "mg", "--save-model-type", "hf", "--load-dir",
                tmp_path / "mg", "--save-dir", tmp_path / "back")
    want, got = read_hf_weights(str(root / "hf")), read_hf_weights(str(tmp_path / "back"))
    assert set(got) == set(want)
    assert not [k for k in want if not same_bits(got[k], want[k])]
    assert json.load(open(tmp_path / "back" / "config.json"))["mtp_num_hidden_layers"] == 1


def test_qwen35_mtp_converts_hf_mg_hf_bit_exact(tmp_path):
    """Qwen3.5 keeps the same ``mtp.*`` (its decoder layer with Qwen3.5's names): hf -> mg (tp 2)
    -> hf is bit-exact and the depth lands under ``mtp.layers.0``."""
    import torch
    tiny = dict(get_family("qwen35").tiny_hf)
    tiny.pop("full_attention_interval")
    types = ["linear_attention", "full_attention"] * (L // 2) + ["full_attention"]
    big = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(
        **dict(tiny, num_hidden_layers=L + 1, layer_types=types)))
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in big.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    big.save_pretrained(str(tmp_path / "big"))
    w = load_file(str(tmp_path / "big" / "model.safetensors"))
    out = {("mtp.layers.0." + k[len(f"model.layers.{L}."):] if k.startswith(f"model.layers.{L}.")
            else k): v for k, v in w.items()}
    H = tiny["hidden_size"]
    rng = np.random.default_rng(0)
    out.update({"mtp.fc.weight": rng.standard_normal((H, 2 * H)).astype(np.float32),
                **{f"mtp.{n}.weight": rng.standard_normal(H).astype(np.float32)
                   for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}})
    cfg = json.load(open(tmp_path / "big" / "config.json"))
    cfg.update(num_hidden_layers=L, layer_types=types[:L], mtp_num_hidden_layers=1)
    os.makedirs(tmp_path / "hf")
    json.dump(cfg, open(tmp_path / "hf" / "config.json", "w"))
    save_file(out, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    run_convert("--load-model-type", "hf", "--save-model-type", "mg", "--model-type-hf", "qwen35",
                "--load-dir", tmp_path / "hf", "--save-dir", tmp_path / "mg",
                "--target-tensor-parallel-size", "2")
    f = sorted(glob.glob(str(tmp_path / "mg" / "iter_0000001" / "mp_rank_00*" /
                             "model_optim_rng.pt")))[0]
    assert "mtp.layers.0.transformer_layer.self_attention.q_proj.weight" in tp.load(f)["model"]
    run_convert("--load-model-type", "mg", "--save-model-type", "hf", "--load-dir",
                tmp_path / "mg", "--save-dir", tmp_path / "back")
    want, got = read_hf_weights(str(tmp_path / "hf")), read_hf_weights(str(tmp_path / "back"))
    assert set(got) == set(want)
    assert not [k for k in want if not same_bits(got[k], want[k])]
