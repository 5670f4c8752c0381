"""HF checkpoint parity: ms_llm ``from_pretrained`` vs an independent float64 NumPy reference.

The reference (``tests/helpers/hf_reference.py``) is written from the HF modeling semantics with a
hand-written backward; the first group of tests checks the reference itself (finite differences,
causality, GQA grouping) so a wrong reference cannot make the model tests pass or fail.

Tolerances (the model computes in float32, the reference in float64):

* logits / loss: 1e-4 absolute. Logits here reach 3-10; float32 rounding through 2 layers of
  64-wide matmuls gives errors of 3e-6..1e-5 (measured), so 1e-4 leaves >=10x margin yet
  catches any real bug (a wrong RoPE/QKV layout/norm gives errors of O(0.1-1)).
* gradient norm: 1e-5 relative. Each gradient entry is a float32 sum over b*s = 32 tokens of
  products that themselves come from float32 matmuls; the norm sums ~1e5 squared entries
  (the models have 5e4-9e4 parameters). Float32 accumulation error grows like
  eps32 * sqrt(n_terms) ~ 6e-8 * 3e2 ~ 2e-5 in the worst case and ~1e-6 typically (measured
  1e-8..2e-7), while a missing/misplaced gradient contribution changes the norm by >1e-3.
* individual gradient tensors: max abs error <= 3e-5 * max|g_ref| + 1e-8. Same reasoning per
  entry; the embedding gradient (sums over all positions and both uses when tied) is the
  noisiest, measured at ~3e-6 of its max, and a layout/grouping bug gives O(1).
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from helpers import hf_reference as ref
from helpers.hf_fixtures import load_config, make_hf_checkpoint

B, S, VOCAB = 2, 16, 128
LOGIT_ATOL = 1e-4
LOSS_ATOL = 1e-4
GRAD_NORM_RTOL = 1e-5
GRAD_TENSOR_RTOL = 3e-5

# name -> make_hf_checkpoint kwargs
CASES = {
    # GQA (4 q heads / 2 kv heads), QK-norm, untied, head_dim 24 != hidden/heads = 16
    "qwen3": dict(family="qwen3", hidden=64, layers=2, heads=4, kv_heads=2, head_dim=24, ffn=96,
                  vocab=VOCAB, tied=False, rope_theta=1_000_000.0, seed=1),
    # MQA (1 kv head), tied embeddings
    "llama": dict(family="llama", hidden=64, layers=2, heads=4, kv_heads=1, ffn=96, vocab=VOCAB,
                  tied=True, rms_norm_eps=1e-5, seed=2),
    # Qwen2.5: q/k/v bias, no o bias, GQA, untied
    "qwen2": dict(family="qwen2", hidden=64, layers=2, heads=4, kv_heads=2, ffn=96, vocab=VOCAB,
                  tied=False, rope_theta=1_000_000.0, seed=3),
}


def _batch(seed=0, vocab=VOCAB):
    rng = np.random.default_rng(100 + seed)
    ids = rng.integers(0, vocab, size=(B, S)).astype(np.int64)
    labels = rng.integers(0, vocab, size=(B, S)).astype(np.int64)
    labels[0, :3] = -100  # e.g. a masked prompt
    labels[1, 7] = -100
    labels[1, -1] = -100
    return ids, labels


# ============================================================================ reference self-checks

@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """name -> (dirpath, stored float64 weights, config dict)."""
    out = {}
    for name, kw in CASES.items():
        kw = dict(kw)
        fam = kw.pop("family")
        d = tmp_path_factory.mktemp(f"hf_{name}")
        w = make_hf_checkpoint(d, fam, **kw)
        out[name] = (str(d), w, load_config(d))
    return out


def _fd5(f, h):
    """5-point central difference of a scalar function f(delta) at 0 (error O(h^4))."""
    return (8.0 * (f(h) - f(-h)) - (f(2 * h) - f(-2 * h))) / (12.0 * h)


@pytest.mark.parametrize("name", list(CASES))
def test_reference_backward_matches_finite_differences(ckpts, name):
    _, w, cfg = ckpts[name]
    ids, labels = _batch()
    L, grads = ref.loss_and_grads(w, cfg, ids, labels)
    assert abs(L - ref.loss(w, cfg, ids, labels)) < 1e-12
    assert set(grads) == set(w)
    rng = np.random.default_rng(7)

    def perturbed_loss(key, flat_idx, delta):
        ww = dict(w)
        a = w[key].copy()
        a.ravel()[flat_idx] += delta
        ww[key] = a
        return ref.loss(ww, cfg, ids, labels)

    keys = ["model.embed_tokens.weight", "model.norm.weight",
            "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
            "model.layers.0.self_attn.v_proj.weight", "model.layers.1.self_attn.o_proj.weight",
            "model.layers.0.input_layernorm.weight", "model.layers.1.post_attention_layernorm.weight",
            "model.layers.0.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight",
            "model.layers.0.mlp.down_proj.weight"]
    keys += [k for k in w if k.endswith("_norm.weight") and ".self_attn." in k]  # q/k norm
    keys += [k for k in w if k.endswith(".bias")] + [k for k in w if k == "lm_head.weight"]
    worst = 0.0
    for key in keys:
        g = grads[key].ravel()
        # entries whose gradient is not tiny, so the relative error is meaningful
        cand = np.flatnonzero(np.abs(g) > 0.05 * np.abs(g).max())
        for j in rng.choice(cand, size=min(2, cand.size), replace=False):
            fd = _fd5(lambda dlt: perturbed_loss(key, j, dlt), 1e-3)
            rel = abs(fd - g[j]) / max(abs(fd), abs(g[j]))
            worst = max(worst, rel)
            assert rel < 1e-6, (key, int(j), fd, g[j], rel)

    # one random direction through ALL parameters at once (catches any missed contribution)
    dirs = {k: rng.standard_normal(v.shape) for k, v in w.items()}

    def along(t):
        return ref.loss({k: w[k] + t * dirs[k] for k in w}, cfg, ids, labels)

    fd = _fd5(along, 1e-4)
    an = sum(float((grads[k] * dirs[k]).sum()) for k in w)
    assert abs(fd - an) / abs(an) < 1e-6, (fd, an)


def test_reference_is_causal(ckpts):
    _, w, cfg = ckpts["qwen3"]
    ids, _ = _batch()
    ids2 = ids.copy()
    ids2[:, 9:] = (ids2[:, 9:] + 5) % VOCAB
    a, b = ref.forward(w, cfg, ids), ref.forward(w, cfg, ids2)
    np.testing.assert_array_equal(a[:, :9], b[:, :9])
    assert np.abs(a[:, 9:] - b[:, 9:]).max() > 1e-3


def test_reference_gqa_equals_mha_with_repeated_kv(ckpts):
    """Query head j uses kv head j // (nh/nkv): an MHA model with repeated k/v rows agrees."""
    _, w, cfg = ckpts["qwen3"]
    g = cfg["num_attention_heads"] // cfg["num_key_value_heads"]
    d = cfg["head_dim"]
    w2 = dict(w)
    for i in range(cfg["num_hidden_layers"]):
        for n in ("k", "v"):
            key = f"model.layers.{i}.self_attn.{n}_proj.weight"
            w2[key] = np.repeat(w[key].reshape(-1, d, w[key].shape[-1]), g, axis=0).reshape(-1, w[key].shape[-1])
    cfg2 = dict(cfg, num_key_value_heads=cfg["num_attention_heads"])
    ids, _ = _batch()
    np.testing.assert_allclose(ref.forward(w2, cfg2, ids), ref.forward(w, cfg, ids), rtol=0, atol=1e-12)


def test_fixture_files(tmp_path):
    w = make_hf_checkpoint(tmp_path / "q3", "qwen3", head_dim=24, dtype="bfloat16", shards=3)
    cfg = load_config(tmp_path / "q3")
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["model_type"] == "qwen3"
    assert cfg["head_dim"] == 24 and cfg["torch_dtype"] == "bfloat16"
    idx = json.loads((tmp_path / "q3" / "model.safetensors.index.json").read_text())
    files = sorted(set(idx["weight_map"].values()))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert set(idx["weight_map"]) == set(w)
    assert idx["metadata"]["total_size"] == sum(v.size * 2 for v in w.values())
    assert "model.layers.1.self_attn.q_norm.weight" in w and "lm_head.weight" in w
    assert w["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 24, 64)

    from safetensors.numpy import load_file
    t = load_file(str(tmp_path / "q3" / files[0]))
    k0 = next(iter(t))
    assert str(t[k0].dtype) == "bfloat16"
    np.testing.assert_array_equal(t[k0].astype(np.float64), w[k0])

    w = make_hf_checkpoint(tmp_path / "ll", "llama", tied=True, kv_heads=1)
    cfg = load_config(tmp_path / "ll")
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"] is True
    assert "lm_head.weight" not in w and cfg["attention_bias"] is False
    assert os.path.exists(tmp_path / "ll" / "model.safetensors")

    w = make_hf_checkpoint(tmp_path / "q2", "qwen2")
    cfg = load_config(tmp_path / "q2")
    assert cfg["model_type"] == "qwen2" and "head_dim" not in cfg
    assert "model.layers.0.self_attn.q_proj.bias" in w and "model.layers.0.self_attn.o_proj.bias" not in w
    nw = w["model.norm.weight"]
    assert np.abs(nw - 1).max() > 0.1 and np.abs(nw - 1).min() > 0  # norm weights are not all-ones


# ============================================================================ ms_llm model parity

def _ms():
    import mindspore as ms
    return ms


@pytest.fixture(scope="module")
def from_pretrained():
    from ms_llm.checkpoint import from_pretrained as fp
    return fp


@pytest.fixture(scope="module")
def models(ckpts, from_pretrained):
    return {name: from_pretrained(path) for name, (path, _, _) in ckpts.items()}


def _logits(model, ids, dtype=np.int32):
    ms = _ms()
    out = model(ms.Tensor(ids.astype(dtype)))
    assert out.dtype == ms.float32, out.dtype
    return out.asnumpy().astype(np.float64)


def _megatron_labels(labels):
    """Megatron passes valid token ids everywhere and masks with a separate loss mask."""
    mask = (labels != -100).astype(np.float32)
    return np.where(labels == -100, 0, labels), mask


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("id_dtype", [np.int32, np.int64], ids=["int32", "int64"])
def test_logits_match_reference(ckpts, models, name, id_dtype):
    _, w, cfg = ckpts[name]
    ids, _ = _batch()
    got = _logits(models[name], ids, id_dtype)
    want = ref.forward(w, cfg, ids)
    assert got.shape == (B, S, cfg["vocab_size"])
    err = np.abs(got - want).max()
    assert err < LOGIT_ATOL, f"{name}: max |logits - ref| = {err:.3e} (scale {np.abs(want).max():.2f})"


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("label_form", ["ignore_index", "loss_mask"])
def test_loss_matches_reference(ckpts, models, name, label_form):
    """``model(ids, labels=)`` -> per-token CE [b, s]; the caller takes the masked mean.

    ``ignore_index``: labels carry -100 (int64), the model must return 0 there.
    ``loss_mask``: Megatron style, labels are valid ids everywhere (int32), a separate mask.
    """
    ms = _ms()
    _, w, cfg = ckpts[name]
    ids, labels = _batch(seed=1)
    valid = labels != -100
    if label_form == "ignore_index":
        lab = ms.Tensor(labels.astype(np.int64))
    else:
        lab = ms.Tensor(_megatron_labels(labels)[0].astype(np.int32))
    per_tok = models[name](ms.Tensor(ids.astype(np.int32)), labels=lab)
    assert tuple(per_tok.shape) == (B, S) and per_tok.dtype == ms.float32
    per_tok = per_tok.asnumpy().astype(np.float64)
    if label_form == "ignore_index":
        assert np.all(per_tok[~valid] == 0.0), per_tok[~valid]
    want_tok = ref.per_token_loss(w, cfg, ids, labels)
    err_tok = np.abs(per_tok - want_tok)[valid].max()
    assert err_tok < LOSS_ATOL, f"{name}: per-token loss max err {err_tok:.3e}"
    got = float((per_tok * valid).sum() / valid.sum())
    want = ref.loss(w, cfg, ids, labels)
    assert abs(got - want) < LOSS_ATOL, f"{name}: loss {got} vs ref {want}"


def _ms_loss_and_grads(model, ids, labels):
    ms = _ms()
    mask = (labels != -100).astype(np.float32)
    ids_t = ms.Tensor(ids.astype(np.int32))
    lab_t = ms.Tensor(labels.astype(np.int32))  # -100 kept: the model returns 0 there
    mask_t = ms.Tensor(mask)
    params = model.trainable_params()

    def fn(x, y, m):
        per_tok = model(x, labels=y)
        return (per_tok * m).sum() / m.sum()

    grad_fn = ms.value_and_grad(fn, grad_position=None, weights=params)
    loss, grads = grad_fn(ids_t, lab_t, mask_t)
    return float(loss.asnumpy()), {p.name: g.asnumpy().astype(np.float64) for p, g in zip(params, grads)}


# Megatron parameter name -> HF name for the tensors that are not fused/re-laid-out.
UNFUSED = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "decoder.layers.0.input_layernorm.weight": "model.layers.0.input_layernorm.weight",
    "decoder.layers.1.pre_mlp_layernorm.weight": "model.layers.1.post_attention_layernorm.weight",
    "decoder.layers.1.mlp.linear_fc2.weight": "model.layers.1.mlp.down_proj.weight",
    "decoder.layers.0.self_attention.linear_proj.weight": "model.layers.0.self_attn.o_proj.weight",
    "decoder.layers.0.self_attention.q_layernorm.weight": "model.layers.0.self_attn.q_norm.weight",
    "decoder.layers.1.self_attention.k_layernorm.weight": "model.layers.1.self_attn.k_norm.weight",
    "output_layer.weight": "lm_head.weight",
}


def _find_param(grads, mg_name):
    """MindSpore names are Cell attribute paths; allow an extra wrapper prefix."""
    hits = [k for k in grads if k == mg_name or k.endswith("." + mg_name)]
    return hits[0] if len(hits) == 1 else None


def _unfuse_grads(got, cfg):
    """Split Megatron fused grads back into HF pieces: linear_qkv rows are per KV group
    ``[q (nh/ng*d) | k (d) | v (d)]``; linear_fc1 is ``[gate; up]``. Used only to say WHICH
    piece is wrong when a check fails (the global norm needs no mapping)."""
    nh, ng, H = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["hidden_size"]
    d = cfg.get("head_dim") or H // nh
    r = nh // ng
    out = {}
    for i in range(cfg["num_hidden_layers"]):
        p, hp = f"decoder.layers.{i}.", f"model.layers.{i}."
        for suffix in ("weight", "bias"):
            key = _find_param(got, p + "self_attention.linear_qkv." + suffix)
            if key is None:
                continue
            rest = got[key].shape[1:]  # (H,) for the weight, () for the bias
            g = got[key].reshape(ng, (r + 2) * d, *rest)
            out[hp + "self_attn.q_proj." + suffix] = g[:, : r * d].reshape(nh * d, *rest)
            out[hp + "self_attn.k_proj." + suffix] = g[:, r * d:(r + 1) * d].reshape(ng * d, *rest)
            out[hp + "self_attn.v_proj." + suffix] = g[:, (r + 1) * d:].reshape(ng * d, *rest)
        key = _find_param(got, p + "mlp.linear_fc1.weight")
        if key is not None:
            gate, up = np.split(got[key], 2, axis=0)
            out[hp + "mlp.gate_proj.weight"], out[hp + "mlp.up_proj.weight"] = gate, up
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_grads_match_reference(ckpts, models, name):
    _, w, cfg = ckpts[name]
    ids, labels = _batch(seed=2)
    want_loss, want = ref.loss_and_grads(w, cfg, ids, labels)
    got_loss, got = _ms_loss_and_grads(models[name], ids, labels)
    assert abs(got_loss - want_loss) < LOSS_ATOL, (got_loss, want_loss)

    # parameter count must match (norm invariance only holds if every parameter is there once)
    n_got = sum(g.size for g in got.values())
    n_want = sum(v.size for v in w.values())
    assert n_got == n_want, f"{name}: {n_got} trainable elements vs {n_want} in the HF checkpoint"

    failures = []
    gn, wn = ref.global_grad_norm(got), ref.global_grad_norm(want)
    rel = abs(gn - wn) / wn
    if not rel < GRAD_NORM_RTOL:
        failures.append(f"global grad norm {gn:.8g} vs ref {wn:.8g} (rel {rel:.2e})")

    pairs = []
    for mg_name, hf_name in UNFUSED.items():
        if hf_name not in w:
            continue
        key = _find_param(got, mg_name)
        assert key is not None, f"{name}: no parameter named {mg_name!r} in {sorted(got)}"
        pairs.append((mg_name, got[key], want[hf_name]))
    assert len(pairs) >= 5
    # fused tensors, compared piecewise in the documented Megatron layout (diagnostic detail)
    pairs += [(f"{k} (from fused)", g, want[k]) for k, g in _unfuse_grads(got, cfg).items() if k in want]
    for label, g, r in pairs:
        assert g.shape == r.shape, (label, g.shape, r.shape)
        err = np.abs(g - r).max()
        tol = GRAD_TENSOR_RTOL * np.abs(r).max() + 1e-8
        if not err <= tol:
            failures.append(f"grad {label}: max err {err:.3e} > tol {tol:.3e} (|ref| max {np.abs(r).max():.3e})")
    assert not failures, f"{name}:\n  " + "\n  ".join(failures)


# ============================================================================ storage variants / errors

@pytest.mark.parametrize("variant", ["sharded", "bfloat16", "float16"])
def test_storage_variants_load(tmp_path, from_pretrained, variant):
    kw = dict(CASES["qwen3"])
    fam = kw.pop("family")
    kw["seed"] = 11
    if variant == "sharded":
        kw["shards"] = 3
    else:
        kw["dtype"] = variant
    w = make_hf_checkpoint(tmp_path, fam, **kw)
    if variant == "sharded":
        assert os.path.exists(tmp_path / "model.safetensors.index.json")
        assert not os.path.exists(tmp_path / "model.safetensors")
    cfg = load_config(tmp_path)
    model = from_pretrained(str(tmp_path))  # dtype=None: float32 compute
    ids, _ = _batch(seed=3)
    got = _logits(model, ids)
    want = ref.forward(w, cfg, ids)  # from the weights as rounded to the storage dtype
    err = np.abs(got - want).max()
    assert err < LOGIT_ATOL, f"{variant}: max |logits - ref| = {err:.3e}"


def test_missing_folder_names_path(tmp_path, from_pretrained):
    missing = tmp_path / "no_such_checkpoint"
    with pytest.raises(Exception) as ei:
        from_pretrained(str(missing))
    assert str(missing) in str(ei.value), str(ei.value)


def test_missing_config_names_path(tmp_path, from_pretrained):
    make_hf_checkpoint(tmp_path, "llama")
    os.remove(tmp_path / "config.json")
    with pytest.raises(Exception) as ei:
        from_pretrained(str(tmp_path))
    msg = str(ei.value)
    assert str(tmp_path) in msg, msg
    assert "config.json" in msg, msg
