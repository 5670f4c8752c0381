"""YaRN RoPE scaling against an independent NumPy implementation written here from the published
formulas (the YaRN paper as HF's ``_compute_yarn_parameters`` implements it):

* correction dim of ``r`` rotations: ``d * ln(L_orig / (2 pi r)) / (2 ln base)``; the range is
  [floor(dim(beta_fast)), ceil(dim(beta_slow))] clipped to [0, d-1] (unrounded without truncate);
* ``ramp(i) = clip((i - low) / (high - low), 0, 1)``, ``e(i) = 1 - ramp(i)``;
  ``inv_freq(i) = base^(-2i/d) / factor * (1 - e(i)) + base^(-2i/d) * e(i)``;
* attention factor: ``attention_factor`` if given, else ``m(factor, mscale) / m(factor,
  mscale_all_dim)`` when both are set, else ``m(factor) = 0.1 ln(factor) + 1``; it multiplies
  cos and sin.

The model's logits at positions beyond the original context equal a float64 NumPy forward (the
HF reference with these tables) at 1e-4; cached greedy decoding equals the reference's greedy
decoding there; the scaling is written back on HF export and read again unchanged.
"""
from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
from mindspore import Tensor

from helpers import hf_fixtures
from helpers import hf_reference
from ms_llm.checkpoint.native.export import hf_config_from_transformer_config
from ms_llm.inference import generate
from ms_llm.models import config_from_hf
from ms_llm.checkpoint import from_pretrained
from ms_llm.models.yarn import rope_frequencies


def numpy_yarn(d: int, base: float, rope: dict, max_pos: int):
    """(inv_freq [d/2], attention factor) from the formulas in the module docstring."""
    orig = rope.get("original_max_position_embeddings", max_pos)
    factor = rope.get("factor") or max_pos / orig
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def m(s, k=1.0):
        return 1.0 if s <= 1 else 0.1 * k * math.log(s) + 1.0

    att = rope.get("attention_factor")
    if att is None:
        ms_, msa = rope.get("mscale"), rope.get("mscale_all_dim")
        att = m(factor, ms_) / m(factor, msa) if ms_ and msa else m(factor)
    lo = d * math.log(orig / (2 * math.pi * beta_fast)) / (2 * math.log(base))
    hi = d * math.log(orig / (2 * math.pi * beta_slow)) / (2 * math.log(base))
    if rope.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, d - 1)
    inv = []
    for i in range(d // 2):
        ramp = min(max((i - lo) / ((hi - lo) or 0.001), 0.0), 1.0)
        keep = 1.0 - ramp
        base_freq = base ** (-2.0 * i / d)
        inv.append(base_freq / factor * (1.0 - keep) + base_freq * keep)
    return np.array(inv), att


CASES = [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "beta_fast": 16,
     "beta_slow": 2},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
     "mscale": 0.9, "mscale_all_dim": 0.7, "truncate": False},
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 48,
     "attention_factor": 1.3},
    {"rope_type": "yarn", "original_max_position_embeddings": 32},   # factor = max_pos / orig
]


def yarn_hf_config(base_cfg: dict, rope: dict, max_pos: int = 128) -> dict:
    cfg = dict(base_cfg, rope_scaling=rope, max_position_embeddings=max_pos)
    return cfg


@pytest.mark.parametrize("rope", CASES)
def test_frequencies_and_attention_factor_match_numpy(rope):
    base = {"model_type": "qwen3", "num_hidden_layers": 1, "hidden_size": 64,
            "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 32, "vocab_size": 64, "rope_theta": 10000.0}
    cfg = config_from_hf(yarn_hf_config(base, rope))
    inv, att = rope_frequencies(cfg)
    ref_inv, ref_att = numpy_yarn(32, 10000.0, rope, 128)
    np.testing.assert_allclose(inv, ref_inv, rtol=1e-12)
    assert att == pytest.approx(ref_att, rel=1e-12)
    # the blend really interpolates some frequencies and keeps others
    assert (inv < 1.0 / 10000.0 ** (np.arange(0, 32, 2) / 32) * 0.999).any()
    assert inv[0] == pytest.approx(1.0)


def test_transformers5_rope_parameters_carry_the_theta():
    hf = {"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 64,
          "intermediate_size": 96, "num_attention_heads": 4, "vocab_size": 64,
          "max_position_embeddings": 256,
          "rope_parameters": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0,
                              "original_max_position_embeddings": 64}}
    cfg = config_from_hf(hf)
    assert cfg.rotary_base == 500000.0 and cfg.position_embedding_type == "yarn"
    inv, att = rope_frequencies(cfg)
    ref_inv, ref_att = numpy_yarn(16, 500000.0, hf["rope_parameters"], 256)
    np.testing.assert_allclose(inv, ref_inv, rtol=1e-12)
    assert att == pytest.approx(ref_att)


def test_other_scaling_types_and_incomplete_yarn_are_one_line_errors():
    hf = {"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 64,
          "intermediate_size": 96, "num_attention_heads": 4, "vocab_size": 64,
          "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    with pytest.raises(ValueError, match="not supported yet"):
        config_from_hf(hf, source="x/config.json")
    cfg = config_from_hf(dict(hf, rope_scaling=None))
    with pytest.raises(ValueError, match="yarn_rotary_scaling_factor"):
        cfg.replace(position_embedding_type="yarn")


def _yarn_folder(tmp_path, family, rope, **kw):
    path = tmp_path / family
    w = hf_fixtures.make_hf_checkpoint(path, family, **kw)
    cfg = hf_fixtures.load_config(path)
    cfg.update(rope_scaling=rope, max_position_embeddings=256)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return str(path), w, cfg


def _reference_logits(monkeypatch, w, cfg, ids):
    """hf_reference's float64 forward with its RoPE tables replaced by the NumPy YaRN ones."""
    spec_cfg = dict(cfg, rope_scaling=None)
    d = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    inv, att = numpy_yarn(d, cfg["rope_theta"], cfg["rope_scaling"],
                          cfg["max_position_embeddings"])

    def tables(s, d_, theta):
        emb = np.concatenate([np.outer(np.arange(s), inv)] * 2, -1)
        return np.cos(emb) * att, np.sin(emb) * att

    monkeypatch.setattr(hf_reference, "_rope_tables", tables)
    return hf_reference.forward(w, spec_cfg, ids)


@pytest.mark.parametrize("family,kw", [
    ("qwen3", dict(hidden=64, heads=4, kv_heads=2, head_dim=32)),
    ("llama", dict(hidden=64, heads=4, kv_heads=1, tied=True)),
])
def test_logits_beyond_original_context_match_numpy(tmp_path, monkeypatch, family, kw):
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    path, w, cfg = _yarn_folder(tmp_path, family, rope, **kw)
    model = from_pretrained(path)
    ids = np.random.default_rng(0).integers(0, cfg["vocab_size"], (2, 90))
    got = model(Tensor(ids.astype(np.int32))).asnumpy()
    ref = _reference_logits(monkeypatch, w, cfg, ids)
    np.testing.assert_allclose(got[:, 32:], ref[:, 32:], atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=1e-4)
    monkeypatch.undo()   # plain RoPE gives clearly different logits: the scaling is applied
    plain = hf_reference.forward(w, dict(cfg, rope_scaling=None), ids)
    assert np.abs(plain[:, 32:] - ref[:, 32:]).max() > 1e-2


def test_cached_greedy_beyond_original_context_matches_numpy(tmp_path, monkeypatch):
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    path, w, cfg = _yarn_folder(tmp_path, "qwen3", rope, hidden=64, heads=4, kv_heads=2)
    model = from_pretrained(path)
    prompt = np.random.default_rng(1).integers(0, cfg["vocab_size"], (1, 40))
    out = generate(model, prompt, 6)
    seq = prompt
    for _ in range(6):
        logits = _reference_logits(monkeypatch, w, cfg, seq)[:, -1]
        top2 = np.sort(logits[0])[-2:]
        assert top2[1] - top2[0] > 1e-3     # the comparison is well posed
        seq = np.concatenate([seq, logits.argmax(-1)[:, None]], 1)
    np.testing.assert_array_equal(out, seq)


@pytest.mark.parametrize("rope", CASES)
def test_hf_export_writes_the_scaling_back(rope):
    base = {"model_type": "qwen3", "num_hidden_layers": 1, "hidden_size": 64,
            "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 32, "vocab_size": 64, "rope_theta": 10000.0}
    cfg = config_from_hf(yarn_hf_config(base, rope))
    hf, _ = hf_config_from_transformer_config(cfg)
    written = hf["rope_scaling"]
    assert written["rope_type"] == "yarn"
    assert written["original_max_position_embeddings"] == rope["original_max_position_embeddings"]
    again = config_from_hf(hf)
    inv, att = rope_frequencies(again)
    ref_inv, ref_att = rope_frequencies(cfg)
    np.testing.assert_array_equal(inv, ref_inv)
    assert att == ref_att
    plain, _ = hf_config_from_transformer_config(cfg.replace(position_embedding_type="rope"))
    assert plain["rope_scaling"] is None
