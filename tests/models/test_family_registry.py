"""Every registered model family, automatically: a tiny random checkpoint written by
transformers (from the family's ``tiny_hf`` config) loads with the same logits, converts HF ->
Megatron (tp 2, ep 2 for MoE) -> HF bit-exactly, and its ``from_hf`` / ``to_hf`` / export guess
agree with each other. A new family gets this coverage by registering itself.

Tolerance (both sides float32): logits 1e-4 absolute and relative. Logits here reach ~5;
float32 rounding through 2-3 layers of 64-wide matmuls gives 1e-6..1e-5 (measured below 2e-5),
while a wrong QKV / rope / norm / routing layout gives O(0.1). Conversion only moves bytes, so it
is compared bit for bit.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from ms_llm.models import layouts as L
from ms_llm.models import TransformerConfig
from ms_llm.models.registry import (FamilySpec, families, family_for_config, family_for_hf,
                                    get_family, register_family, unregister_family)

import transformers  # noqa: E402,F401  (test extra: the reference is HF's modeling code)

FAMILIES = [s.name for s in families()]
VOCAB_SEED = 5


def _tiny(spec: FamilySpec) -> dict:
    return dict(spec.tiny_hf, model_type=spec.hf_model_type)


def _build_hf(spec: FamilySpec, seed: int):
    """A transformers model of ``spec.tiny_hf`` with unit-scale random weights (HF's 0.02 init
    makes routers near-uniform, so routing would hinge on rounding) and random norm weights."""
    from helpers.tiny_hf import build_tiny_hf
    return build_tiny_hf(spec.name, seed)


@pytest.fixture(scope="module", params=FAMILIES)
def family_dir(request, tmp_path_factory):
    spec = get_family(request.param)
    model = _build_hf(spec, seed=len(spec.name))
    root = tmp_path_factory.mktemp(spec.name.replace(".", "_"))
    model.save_pretrained(str(root / "hf"))
    return spec, model, root


def _ids(vocab: int) -> np.ndarray:
    return np.random.default_rng(VOCAB_SEED).integers(0, vocab, size=(2, 10)).astype(np.int64)


def test_logits_match_transformers(family_dir):
    import mindspore as ms
    import torch
    from ms_llm.checkpoint import from_pretrained
    spec, hf, root = family_dir
    ids = _ids(spec.tiny_hf["vocab_size"])
    with torch.no_grad():
        want = hf(torch.tensor(ids)).logits.double().numpy()
    got = from_pretrained(str(root / "hf"))(ms.Tensor(ids.astype(np.int32))).asnumpy()
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=1e-4, atol=1e-4,
                               err_msg=spec.name)


def test_hf_megatron_hf_round_trip_is_bit_exact(family_dir):
    from helpers.deepseek_fixtures import run_convert, same_bits
    from ms_llm.checkpoint.hf.io import read_hf_weights
    spec, _, root = family_dir
    mg, back = root / "mg", root / "back"
    layout = ["--target-tensor-parallel-size", "2"]
    if spec.is_moe:
        layout += ["--target-expert-parallel-size", "2"]
    run_convert("--load-model-type", "hf", "--save-model-type", "mg", "--model-type-hf",
                spec.convert_name, "--load-dir", root / "hf", "--save-dir", mg, *layout)
    run_convert("--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", mg,
                "--save-dir", back)
    want, got = read_hf_weights(str(root / "hf")), read_hf_weights(str(back))
    assert set(got) == set(want), spec.name
    bad = [k for k in want if not same_bits(got[k], want[k])]
    assert not bad, (spec.name, bad[:3])


@pytest.mark.parametrize("name", FAMILIES)
def test_names_translations_and_export_guess_agree(name):
    spec = get_family(name)
    cfg = spec.from_hf(_tiny(spec), "tiny")
    assert family_for_hf(spec.to_hf(cfg)) is spec
    assert spec.from_hf(spec.to_hf(cfg), "again") == cfg          # to_hf inverts from_hf
    assert family_for_config(cfg) is spec                          # export finds it again
    assert L.export_family(cfg)[0] is spec
    for alias in (spec.name, *spec.aliases, *spec.megatron_names):
        assert get_family(alias) is spec
    for mt in spec.megatron_names:
        assert L.family_of(mt) is spec
    assert L.default_megatron_name(spec.hf_model_type) == spec.convert_name
    spec_l = L.spec_from_hf_config(_tiny(spec), spec.convert_name, "tiny")
    assert spec_l.layer_kinds == spec.kinds(cfg) and all(k in L.LAYER_KINDS
                                                          for k in spec_l.layer_kinds)
    if spec.qualify is not None:                                  # ms-llm qualify's row
        from ms_llm.qualify.matrix import CONFIGS, FAMILIES as ROWS
        assert ROWS[spec.qualify.name].hf_type == spec.convert_name
        assert os.path.isfile(os.path.join(CONFIGS, spec.qualify.config))
    # the family's defaults are a valid architecture switch set
    sizes = dict(num_moe_experts=4) if spec.is_moe else {}
    TransformerConfig(**dict(spec.defaults, **sizes))


def test_register_family_refuses_taken_names_and_new_families_appear_everywhere():
    from ms_llm.checkpoint.convert.args import build_parser
    from ms_llm.config.help import schema_help
    import ms_llm.models.families as F
    from ms_llm.models.families.llama import hf as llama
    with pytest.raises(ValueError, match=r"name\(s\) \['llama2'\] belong to \['llama'\]"):
        register_family(FamilySpec(name="toy", hf_model_type="toy", hf_architecture="X",
                                   from_hf=llama.from_hf, to_hf=llama.to_hf, aliases=("llama2",)))
    with pytest.raises(ValueError, match="model_type 'qwen3' belongs to 'qwen3'"):
        register_family(FamilySpec(name="toy", hf_model_type="qwen3", hf_architecture="X",
                                   from_hf=llama.from_hf, to_hf=llama.to_hf))
    toy = FamilySpec(name="toy", hf_model_type="toy_llama", hf_architecture="LlamaForCausalLM",
                     from_hf=llama.from_hf,
                     to_hf=lambda c: dict(llama.to_hf(c), model_type="toy_llama"),
                     aliases=("toy1",), defaults=dict(qk_layernorm=False))
    register_family(toy)
    try:
        assert F.FAMILIES["toy"] == {"qk_layernorm": False} and F.ALIASES["toy1"] == "toy"
        assert "toy" in build_parser().format_help() and "toy" in schema_help()
        hf = dict(_tiny(get_family("llama")), model_type="toy_llama")
        assert L.spec_from_hf_config(hf, "toy", "x").family == "toy"
        assert L.default_megatron_name("toy_llama") == "toy"
    finally:
        unregister_family("toy")
    with pytest.raises(ValueError, match="model.family: unknown family 'toy'"):
        get_family("toy")


def test_a_family_with_two_layer_kinds_converts_layer_by_layer():
    """A family whose layers alternate between two checkpoint layouts (as Qwen3-Next's linear-
    and full-attention layers) names one kind per layer and registers the new kind; the
    converter's per-layer HF <-> Megatron <-> tp-shard path then handles both."""
    from collections import OrderedDict
    from ms_llm.models.layouts import LAYER_KINDS, LayerKind

    A = "self_attention."

    def names(spec, p):
        return [(p + "linear_attn.in_proj.weight", (2 * spec.hidden, spec.hidden))]

    def to_full(spec, get, p):
        return OrderedDict([(A + "in_proj.weight", get(p + "linear_attn.in_proj.weight"))])

    def to_hf(spec, full, p):
        return {p + "linear_attn.in_proj.weight": full[A + "in_proj.weight"]}

    def shard(spec, full, tp, t):
        return OrderedDict([(A + "in_proj.weight", np.split(full[A + "in_proj.weight"], tp)[t])])

    def merge(spec, part, tp):
        return OrderedDict([(A + "in_proj.weight", np.concatenate(
            [part(t, 0, A + "in_proj.weight") for t in range(tp)]))])

    L.register_layer_kind("toy_linear", LayerKind(names, to_full, to_hf, shard, merge))
    try:
        c = get_family("qwen3").from_hf(dict(_tiny(get_family("qwen3")), num_hidden_layers=4),
                                        "x")
        spec = L.ModelSpec.from_config("toy", c, ("toy_linear", "attention") * 2)
        rng = np.random.default_rng(0)
        hf = {n: rng.standard_normal(s).astype(np.float32) for n, s in L.hf_names(spec)}
        assert "model.layers.0.linear_attn.in_proj.weight" in hf
        assert "model.layers.1.self_attn.q_proj.weight" in hf
        lay = L.ParallelLayout(tp=2, padded_vocab=spec.vocab)
        lay.validate(spec)
        for i in range(spec.num_layers):
            full = L.hf_layer_to_full(spec, hf.__getitem__, i)
            shards = L.shard_layer(spec, lay, full, i)
            back = L.merge_layer(spec, lay, lambda t, e, k: shards[(t, e)][k], i)
            again = L.full_layer_to_hf(spec, back, i)
            assert set(again) == {n for n in hf if n.startswith(f"model.layers.{i}.")}
            assert all(np.array_equal(again[k], hf[k]) for k in again)
    finally:
        del LAYER_KINDS["toy_linear"]
