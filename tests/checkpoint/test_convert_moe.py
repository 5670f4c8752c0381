"""Qwen3-MoE weight conversion: router, per-expert (``local_experts.{j}``) and
``--moe-grouped-gemm`` (``weight1``/``weight2``) layouts, expert-parallel splits.

The tiny HF Qwen3-MoE checkpoint is tests/helpers/convert_moe_fixture.py's. Expected Megatron
tensors are stated independently: ep rank q holds global experts ``q*E/ep + j`` as
``local_experts.{j}``; an expert's ``linear_fc1`` on tp rank t is ``[gate chunk t; up chunk t]``,
``linear_fc2`` column chunk t; grouped GEMM stores, per (t, q), ``weight1`` whose memory viewed
``[E_local, H, 2F/tp]`` holds ``fc1_local.T`` and ``weight2`` viewed ``[E_local, F/tp, H]`` holds
``fc2_local.T`` (Megatron's ``GroupedMLP`` views them so). All comparisons are exact (bit patterns).
"""
from __future__ import annotations

import glob
import json
import os

import numpy as np
import pytest

from helpers.convert_moe_fixture import E, F, H, make_qwen3_moe
from ms_llm.checkpoint import torch_pickle as tp
from ms_llm.checkpoint.convert import main as convert_main
from ms_llm.checkpoint.hf.io import read_hf_weights


def run(*args) -> None:
    assert convert_main([str(a) for a in args]) == 0, args


def files_of(mg) -> dict:
    return {os.path.basename(os.path.dirname(f)): tp.load(f)["model"] for f in
            sorted(glob.glob(os.path.join(mg, "iter_0000001", "mp_rank_*", "model_optim_rng.pt")))}


def expected_expert(hf, i, e, tp_size, t):
    q = f"model.layers.{i}.mlp.experts.{e}."
    c = F // tp_size
    fc1 = np.concatenate([hf[q + "gate_proj.weight"][t * c:(t + 1) * c],
                          hf[q + "up_proj.weight"][t * c:(t + 1) * c]])
    return fc1, hf[q + "down_proj.weight"][:, t * c:(t + 1) * c]


def same(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(
        np.ascontiguousarray(a).view(np.uint32), np.ascontiguousarray(b).view(np.uint32))


@pytest.fixture(scope="module")
def moe_hf(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    hf = make_qwen3_moe(root / "hf")
    return root, hf


@pytest.mark.parametrize("grouped", [False, True])
def test_moe_ep2_tp2_layout_and_round_trip(moe_hf, grouped):
    root, hf = moe_hf
    tag = "gg" if grouped else "seq"
    mg, back = root / f"mg_{tag}", root / f"back_{tag}"
    run("--load-model-type", "hf", "--save-model-type", "mg", "--model-type-hf", "qwen3-moe",
        "--load-dir", root / "hf", "--save-dir", mg, "--target-tensor-parallel-size", 2,
        "--target-expert-parallel-size", 2, *(["--moe-grouped-gemm"] if grouped else []))
    files = files_of(mg)
    assert sorted(files) == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000",
                             "mp_rank_01_001"]
    n_local = E // 2
    for t in range(2):
        for q in range(2):
            sd = files[f"mp_rank_{t:02d}_{q:03d}"]
            # dense weights and the router are copied into every ep rank's file
            assert same(sd["decoder.layers.0.mlp.router.weight"],
                        hf["model.layers.0.mlp.gate.weight"])
            assert same(sd["decoder.layers.1.mlp.linear_fc2.weight"],
                        hf["model.layers.1.mlp.down_proj.weight"][:, t * 12:(t + 1) * 12])
            assert same(sd["embedding.word_embeddings.weight"],
                        hf["model.embed_tokens.weight"][t * 32:(t + 1) * 32])
            for i in (0, 2):
                pre = f"decoder.layers.{i}.mlp.experts."
                if grouped:
                    assert not any(k.startswith(pre + "local_experts") for k in sd)
                    w1, w2 = sd[pre + "weight1"], sd[pre + "weight2"]
                    assert w1.shape == (H, n_local * F) and w2.shape == (n_local * F // 2, H)
                    v1 = w1.reshape(-1).reshape(n_local, H, F)   # raw memory view, as Megatron
                    v2 = w2.reshape(-1).reshape(n_local, F // 2, H)
                    for j in range(n_local):
                        fc1, fc2 = expected_expert(hf, i, q * n_local + j, 2, t)
                        assert same(np.ascontiguousarray(v1[j]), np.ascontiguousarray(fc1.T))
                        assert same(np.ascontiguousarray(v2[j]), np.ascontiguousarray(fc2.T))
                else:
                    assert pre + "weight1" not in sd
                    for j in range(n_local):
                        fc1, fc2 = expected_expert(hf, i, q * n_local + j, 2, t)
                        m = f"{pre}local_experts.{j}."
                        assert same(sd[m + "linear_fc1.weight"], fc1)
                        assert same(sd[m + "linear_fc2.weight"], fc2)
                        assert sd[m + "linear_fc1._extra_state"] is None
                        assert sd[m + "linear_fc2._extra_state"] is None
                    assert f"{pre}local_experts.{n_local}.linear_fc1.weight" not in sd
    run("--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", mg, "--save-dir", back)
    got = read_hf_weights(str(back))
    assert set(got) == set(hf)
    for k in hf:
        assert same(got[k], hf[k]), k
    assert json.load(open(back / "config.json"))["mlp_only_layers"] == [1]


def test_moe_resharding_between_expert_layouts(moe_hf):
    """mg(ep=2, per-expert) -> mg(ep=1, tp=1, pp=3, grouped) -> mg(ep=2, per-expert) is exact."""
    root, _ = moe_hf
    a, b, c = root / "rs_a", root / "rs_b", root / "rs_c"
    run("--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", root / "hf",
        "--save-dir", a, "--target-expert-parallel-size", 2, "--target-tensor-parallel-size", 2)
    run("--load-model-type", "mg", "--save-model-type", "mg", "--load-dir", a, "--save-dir", b,
        "--target-pipeline-parallel-size", 3, "--moe-grouped-gemm")
    fb = files_of(b)
    assert sorted(fb) == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_00_002"]
    assert "decoder.layers.0.mlp.experts.weight1" in fb["mp_rank_00_002"]  # HF layer 2
    run("--load-model-type", "mg", "--save-model-type", "mg", "--load-dir", b, "--save-dir", c,
        "--target-expert-parallel-size", 2, "--target-tensor-parallel-size", 2)
    fa, fc = files_of(a), files_of(c)
    assert sorted(fa) == sorted(fc)
    for r in fa:
        assert list(fa[r]) == list(fc[r]), r
        for k, v in fa[r].items():
            assert (v is None and fc[r][k] is None) or same(v, fc[r][k]), (r, k)


def test_integer_moe_layer_freq_maps_to_the_same_layers():
    """Megatron's --moe-layer-freq N makes layers 0, N, 2N... MoE; HF's decoder_sparse_step N
    would make layers N-1, 2N-1... sparse, so the config must list the dense layers instead."""
    from argparse import Namespace
    from ms_llm.checkpoint.megatron.io import hf_config_from_args
    from ms_llm.models import config_from_hf
    args = Namespace(num_layers=5, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                     group_query_attention=True, num_query_groups=2, kv_channels=8,
                     vocab_size=64, padded_vocab_size=64, max_position_embeddings=128,
                     norm_epsilon=1e-6, rotary_base=10000.0,
                     untie_embeddings_and_output_weights=True, params_dtype=None, bf16=False,
                     fp16=False, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16,
                     moe_layer_freq=2)
    hf = hf_config_from_args(args, "qwen3-moe")
    assert hf["decoder_sparse_step"] == 1 and hf["mlp_only_layers"] == [1, 3]
    cfg = config_from_hf(hf)
    assert [cfg.is_moe_layer(i) for i in range(5)] == [i % 2 == 0 for i in range(5)]
