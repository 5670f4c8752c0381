"""Qwen3-Next / Qwen3.5 Megatron checkpoints use MindSpeed-LLM's Qwen3-Next names.

The expected names are written here from MindSpeed-LLM's converter (``convert_ckpt_v2``'s
``model_builder`` for ``qkv_type: mix`` and ``configs/checkpoint/model_cfg.json`` ``qwen3-next``):
full-attention layers keep separate ``self_attention.q_proj`` (HF's per-head ``[q | gate]`` rows,
copied as is), ``k_proj``, ``v_proj``, ``linear_proj``, ``q_layernorm``, ``k_layernorm``; Gated
DeltaNet layers keep HF's tensors under ``self_attention.`` (``in_proj_qkvz``, ``in_proj_ba``,
``conv1d``, ``dt_bias``, ``A_log``, ``norm``, ``out_proj``); the shared expert's gate is
``mlp.shared_experts.gate_weight``. At tp 1 (the only tp MindSpeed converts for this family)
every such tensor equals the HF one bit for bit; a Qwen3.5 folder (split DeltaNet projections)
gives the same fused Megatron tensors as the equivalent Qwen3-Next one, and a Megatron folder
loads into the same model as its HF source (logits equal)."""
from __future__ import annotations

import glob
import os

import numpy as np
import pytest

import transformers  # noqa: F401  (test extra)

from helpers.deepseek_fixtures import run_convert
from ms_llm.checkpoint import torch_pickle as tp
from ms_llm.checkpoint.hf.io import read_hf_weights
from ms_llm.models.registry import get_family


def _save(name: str, root, seed: int = 3):
    import torch
    spec = get_family(name)
    cfg = transformers.AutoConfig.for_model(spec.hf_model_type, **spec.tiny_hf)
    model = getattr(transformers, spec.hf_architecture)(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) / max(p.shape[-1], 1) ** 0.5)
    model.save_pretrained(str(root))
    return model


def _mg(root, *layout) -> dict:
    run_convert("--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", root / "hf",
                "--save-dir", root / "mg", *layout)
    files = sorted(glob.glob(os.path.join(root / "mg", "iter_0000001", "mp_rank_*",
                                          "model_optim_rng.pt")))
    return {os.path.basename(os.path.dirname(f)): tp.load(f)["model"] for f in files}


@pytest.fixture(scope="module")
def next_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("q3n_names")
    _save("qwen3-next", root / "hf")
    return root, _mg(root, "--model-type-hf", "qwen3-next")


def test_mindspeed_names_and_bits_at_tp1(next_dirs):
    root, shards = next_dirs
    hf = read_hf_weights(str(root / "hf"))
    (sd,) = shards.values()
    keys = {k for k in sd if not k.endswith("_extra_state")}
    gdn = "decoder.layers.0.self_attention."
    attn = "decoder.layers.1.self_attention."
    for n in ("A_log", "dt_bias", "conv1d.weight", "in_proj_qkvz.weight", "in_proj_ba.weight",
              "norm.weight", "out_proj.weight"):
        assert np.array_equal(np.asarray(sd[gdn + n]), hf["model.layers.0.linear_attn." + n]), n
    for mg, h in (("q_proj.weight", "q_proj.weight"), ("k_proj.weight", "k_proj.weight"),
                  ("v_proj.weight", "v_proj.weight"), ("linear_proj.weight", "o_proj.weight"),
                  ("q_layernorm.weight", "q_norm.weight"),
                  ("k_layernorm.weight", "k_norm.weight")):
        assert np.array_equal(np.asarray(sd[attn + mg]), hf["model.layers.1.self_attn." + h]), mg
    assert not any("linear_qkv" in k for k in keys)
    assert np.array_equal(np.asarray(sd["decoder.layers.0.mlp.shared_experts.gate_weight"]),
                          hf["model.layers.0.mlp.shared_expert_gate.weight"])
    assert "decoder.layers.0.mlp.router.weight" in keys


def test_megatron_folder_loads_as_its_hf_source_at_tp2(next_dirs, tmp_path):
    import mindspore as ms
    from ms_llm.checkpoint import from_pretrained
    root, _ = next_dirs
    run_convert("--load-model-type", "hf", "--save-model-type", "mg", "--load-dir",
                root / "hf", "--save-dir", tmp_path / "mg2", "--model-type-hf", "qwen3-next",
                "--target-tensor-parallel-size", "2", "--target-expert-parallel-size", "2")
    ids = ms.Tensor(np.random.default_rng(0).integers(0, 96, (1, 12)).astype(np.int32))
    want = from_pretrained(str(root / "hf"))(ids).asnumpy()
    got = from_pretrained(str(tmp_path / "mg2"))(ids).asnumpy()
    np.testing.assert_array_equal(got, want)


def test_qwen35_split_projections_fuse_to_the_qwen3_next_tensors(tmp_path):
    """The same weights written as Qwen3.5 (in_proj_qkv / z / b / a) and re-grouped by hand as
    Qwen3-Next (in_proj_qkvz / ba, per key-head groups [q k v z], [b a]) give the same Megatron
    tensors."""
    _save("qwen35", tmp_path / "hf")
    shards = _mg(tmp_path, "--model-type-hf", "qwen35")
    (sd,) = shards.values()
    hf = read_hf_weights(str(tmp_path / "hf"))
    t = get_family("qwen35").tiny_hf
    hk, hv = t["linear_num_key_heads"], t["linear_num_value_heads"]
    dk, dv, H, r = t["linear_key_head_dim"], t["linear_value_head_dim"], t["hidden_size"], \
        t["linear_num_value_heads"] // t["linear_num_key_heads"]
    p = "model.layers.0.linear_attn."
    qkv, z = hf[p + "in_proj_qkv.weight"], hf[p + "in_proj_z.weight"]
    q, k, v = qkv[:hk * dk], qkv[hk * dk:2 * hk * dk], qkv[2 * hk * dk:]
    rows, ba = [], []
    for g in range(hk):
        rows += [q[g * dk:(g + 1) * dk], k[g * dk:(g + 1) * dk],
                 v[g * r * dv:(g + 1) * r * dv], z[g * r * dv:(g + 1) * r * dv]]
        ba += [hf[p + "in_proj_b.weight"][g * r:(g + 1) * r],
               hf[p + "in_proj_a.weight"][g * r:(g + 1) * r]]
    a = "decoder.layers.0.self_attention."
    assert np.array_equal(np.asarray(sd[a + "in_proj_qkvz.weight"]), np.concatenate(rows))
    assert np.array_equal(np.asarray(sd[a + "in_proj_ba.weight"]), np.concatenate(ba))
    assert np.asarray(sd[a + "in_proj_qkvz.weight"]).shape == (2 * hk * dk + 2 * hv * dv, H)


def test_a_loaded_folder_takes_another_chunk_size(next_dirs):
    """``model.linear_chunk_size`` splits the same computation differently (HF does not record
    it), so a run may set it on top of a loaded folder's architecture."""
    from ms_llm.config import load_config
    root, _ = next_dirs
    cfg = load_config(None, ["--checkpoint.load", str(root / "hf"),
                             "--model.linear_chunk_size", "16"])
    assert cfg.model.linear_chunk_size == 16 and cfg.model.layer_types[0] == "gated_delta_net"
