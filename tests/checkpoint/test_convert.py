"""HF <-> Megatron conversion of the dense families (``ms-llm convert``), torch-free.

The expected Megatron tensors are stated here independently of the converter, by slicing the
HF tensors the way Megatron-Core's local spec lays them out:
``linear_qkv`` rank t = for each of its KV groups g: ``q rows of g | k rows of g | v rows of g``;
``linear_fc1`` rank t = ``[gate chunk t; up chunk t]``; ``linear_proj``/``linear_fc2`` column
chunk t; embedding/output row chunk t of the zero-padded vocab; norms replicated;
``_extra_state`` = None on every linear and the output layer. Comparisons are of bit patterns
(exact), because conversion only moves bytes; the one float tolerance (logits) is justified at
its assertion.
"""
from __future__ import annotations

import argparse
import glob
import os

import ml_dtypes
import numpy as np
import pytest

from helpers.hf_fixtures import make_hf_checkpoint
from ms_llm.checkpoint import torch_pickle as tp
from ms_llm.checkpoint.convert import main as convert_main
from ms_llm.checkpoint.hf.io import read_hf_weights

DENSE = {
    # GQA 8 heads / 4 groups, QK-norm, untied, head_dim 12 != hidden/heads
    "qwen3": dict(family="qwen3", hidden=48, layers=4, heads=8, kv_heads=4, head_dim=12, ffn=64,
                  vocab=96, tied=False, shards=3, seed=11),
    # MQA (1 kv head), tied embeddings; Megatron needs tp | query groups, so MQA runs at tp = 1
    "llama2": dict(family="llama", hidden=48, layers=4, heads=4, kv_heads=1, ffn=64, vocab=96,
                   tied=True, seed=12),
    # GQA, tied embeddings at tp = 2
    "llama3": dict(family="llama", hidden=48, layers=4, heads=4, kv_heads=2, ffn=64, vocab=96,
                   tied=True, seed=14),
    # Qwen2.5: q/k/v biases, GQA, bf16 storage
    "qwen25": dict(family="qwen2", hidden=48, layers=4, heads=4, kv_heads=2, ffn=64, vocab=96,
                   tied=False, dtype="bfloat16", seed=13),
}


def run(*args: str) -> None:
    rc = convert_main(list(args))
    assert rc == 0, f"convert failed: {args}"


def bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(f"u{a.dtype.itemsize}")


def same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(bits(a), bits(b))


def hf_native(path) -> dict:
    return read_hf_weights(str(path))


def rank_files(mg_dir) -> dict:
    """``{folder name: loaded model_optim_rng.pt}`` of the (only) iteration."""
    it = open(os.path.join(mg_dir, "latest_checkpointed_iteration.txt")).read().strip()
    out = {}
    for f in sorted(glob.glob(os.path.join(mg_dir, f"iter_{int(it):07d}", "mp_rank_*",
                                           "model_optim_rng.pt"))):
        out[os.path.basename(os.path.dirname(f))] = tp.load(f)
    return out


def expected_layer(hf: dict, i: int, tp_size: int, t: int, *, heads, groups, head_dim, bias,
                   qk_norm) -> dict:
    """Megatron-Core local-spec tensors of HF layer ``i`` on tensor-parallel rank ``t``."""
    p = f"model.layers.{i}."
    r, d = heads // groups, head_dim
    per = groups // tp_size
    qkv_rows, qkv_bias = [], []
    for g in range(t * per, (t + 1) * per):
        for name, lo, hi in (("q", g * r * d, (g + 1) * r * d), ("k", g * d, (g + 1) * d),
                             ("v", g * d, (g + 1) * d)):
            qkv_rows.append(hf[f"{p}self_attn.{name}_proj.weight"][lo:hi])
            if bias:
                qkv_bias.append(hf[f"{p}self_attn.{name}_proj.bias"][lo:hi])
    F = hf[p + "mlp.gate_proj.weight"].shape[0] // tp_size
    H = hf[p + "self_attn.o_proj.weight"].shape[0]
    o_cols = hf[p + "self_attn.o_proj.weight"].shape[1] // tp_size
    e = {"input_layernorm.weight": hf[p + "input_layernorm.weight"],
         "self_attention.linear_proj.weight":
             hf[p + "self_attn.o_proj.weight"][:, t * o_cols:(t + 1) * o_cols],
         "self_attention.linear_proj._extra_state": None,
         "self_attention.linear_qkv.weight": np.concatenate(qkv_rows),
         "self_attention.linear_qkv._extra_state": None,
         "pre_mlp_layernorm.weight": hf[p + "post_attention_layernorm.weight"],
         "mlp.linear_fc1.weight": np.concatenate([hf[p + "mlp.gate_proj.weight"][t * F:(t + 1) * F],
                                                  hf[p + "mlp.up_proj.weight"][t * F:(t + 1) * F]]),
         "mlp.linear_fc1._extra_state": None,
         "mlp.linear_fc2.weight": hf[p + "mlp.down_proj.weight"][:, t * F:(t + 1) * F],
         "mlp.linear_fc2._extra_state": None}
    assert e["mlp.linear_fc2.weight"].shape == (H, F)
    if bias:
        e["self_attention.linear_qkv.bias"] = np.concatenate(qkv_bias)
    if qk_norm:
        e["self_attention.q_layernorm.weight"] = hf[p + "self_attn.q_norm.weight"]
        e["self_attention.k_layernorm.weight"] = hf[p + "self_attn.k_norm.weight"]
    return e


def assert_state(got: dict, want: dict, where: str) -> None:
    assert set(got) == set(want), (where, sorted(set(got) ^ set(want))[:6])
    for k, v in want.items():
        if v is None:
            assert got[k] is None, (where, k)
        else:
            assert same(got[k], np.asarray(v)), (where, k)


@pytest.fixture(scope="module")
def dense_ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("dense")
    out = {}
    for name, kw in DENSE.items():
        make_hf_checkpoint(root / f"{name}_hf", **kw)
        out[name] = root / f"{name}_hf"
    return root, out


@pytest.mark.parametrize("name", list(DENSE))
def test_hf_to_mg_tp2_pp2_layout_and_round_trip(dense_ckpts, name):
    root, paths = dense_ckpts
    kw, hf_dir = DENSE[name], paths[name]
    hf = hf_native(hf_dir)
    mg, back = root / f"{name}_mg22", root / f"{name}_back"
    tps = min(2, kw["kv_heads"])
    run("--load-model-type", "hf", "--save-model-type", "mg", "--model-type-hf", name,
        "--load-dir", str(hf_dir), "--save-dir", str(mg), "--target-tensor-parallel-size",
        str(tps), "--target-pipeline-parallel-size", "2")
    files = rank_files(mg)
    assert sorted(files) == [f"mp_rank_{t:02d}_{p:03d}" for t in range(tps) for p in range(2)]
    heads, groups = kw["heads"], kw["kv_heads"]
    head_dim = kw.get("head_dim") or kw["hidden"] // heads
    V = kw["vocab"]
    for t in range(tps):
        for p in range(2):
            ck = files[f"mp_rank_{t:02d}_{p:03d}"]
            assert set(ck) == {"args", "checkpoint_version", "iteration", "model"}
            assert ck["checkpoint_version"] == 3.0 and ck["iteration"] == 1
            a = ck["args"]
            assert isinstance(a, argparse.Namespace)
            assert (a.tensor_model_parallel_size, a.pipeline_model_parallel_size,
                    a.num_layers, a.num_query_groups, a.padded_vocab_size) == (tps, 2, 4, groups,
                                                                               V)
            want = {}
            for j in range(2):  # 4 layers / pp 2: stage p holds HF layers 2p, 2p+1 as 0, 1
                for k, v in expected_layer(hf, 2 * p + j, tps, t, heads=heads, groups=groups,
                                           head_dim=head_dim, bias=name == "qwen25",
                                           qk_norm=name == "qwen3").items():
                    want[f"decoder.layers.{j}.{k}"] = v
            rows = slice(t * V // tps, (t + 1) * V // tps)
            if p == 0:
                want["embedding.word_embeddings.weight"] = hf["model.embed_tokens.weight"][rows]
            if p == 1:
                want["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
                want["output_layer._extra_state"] = None
                # tied + pp > 1: Megatron's last stage holds its own copy of the embedding
                want["output_layer.weight"] = (hf["model.embed_tokens.weight"] if kw["tied"]
                                               else hf["lm_head.weight"])[rows]
            assert_state(ck["model"], want, f"{name} t{t} p{p}")
    run("--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", str(mg),
        "--save-dir", str(back), "--max-shard-size", "40KB")
    got = hf_native(back)
    assert set(got) == set(hf)
    for k in hf:
        assert same(got[k], hf[k]), k
    if len(os.listdir(back)) > 2:
        assert os.path.isfile(back / "model.safetensors.index.json")


@pytest.mark.parametrize("name", ["qwen3", "llama3"])
def test_mg_resharding_round_trip_and_logits(dense_ckpts, name):
    """mg(tp=2) -> mg(tp=1, pp=2) -> mg(tp=2) reproduces every file; logits from the Megatron
    folders equal logits from the HF folder."""
    root, paths = dense_ckpts
    a, b, c = (root / f"{name}_{s}" for s in ("tp2", "tp1pp2", "tp2again"))
    run("--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", str(paths[name]),
        "--save-dir", str(a), "--target-tensor-parallel-size", "2")
    run("--load-model-type", "mg", "--save-model-type", "mg", "--load-dir", str(a),
        "--save-dir", str(b), "--target-tensor-parallel-size", "1",
        "--target-pipeline-parallel-size", "2")
    run("--load-model-type", "mg", "--save-model-type", "mg", "--load-dir", str(b),
        "--save-dir", str(c), "--target-tensor-parallel-size", "2")
    fa, fc = rank_files(a), rank_files(c)
    assert sorted(fa) == sorted(fc) == ["mp_rank_00", "mp_rank_01"]
    for r in fa:
        assert_state(fc[r]["model"], fa[r]["model"], r)
        assert vars(fc[r]["args"]) == vars(fa[r]["args"])
    if not DENSE[name]["tied"]:
        assert "output_layer.weight" in fa["mp_rank_00"]["model"]
    else:  # tied, pp = 1: no output_layer weight, only its _extra_state
        assert "output_layer.weight" not in fa["mp_rank_00"]["model"]
        assert fa["mp_rank_00"]["model"]["output_layer._extra_state"] is None

    from mindspore import Tensor
    from ms_llm.checkpoint import from_pretrained
    ids = Tensor(np.random.default_rng(5).integers(0, DENSE[name]["vocab"], (2, 12)).astype(
        np.int32))
    ref = from_pretrained(str(paths[name]))(ids).asnumpy()
    for folder in (a, b):
        got = from_pretrained(str(folder))(ids).asnumpy()
        # Same fp32 weights and the same kernels: identical up to float32 summation order
        # (logits are O(1..10), fp32 epsilon 1.2e-7); a layout error gives O(0.1..1).
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5)


def test_vpp_noop_layers_num_layer_list_padding_and_dtype(dense_ckpts):
    root, paths = dense_ckpts
    hf_dir = paths["qwen3"]
    hf = hf_native(hf_dir)
    # virtual pipeline: 4 layers, pp 2, 1 layer per virtual stage -> chunks [[0],[2]] / [[1],[3]]
    v = root / "vpp"
    run("--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", str(hf_dir),
        "--save-dir", str(v), "--target-pipeline-parallel-size", "2",
        "--num-layers-per-virtual-pipeline-stage", "1")
    files = rank_files(v)
    for p in range(2):
        ck = files[f"mp_rank_00_{p:03d}"]
        assert "model" not in ck and {"model0", "model1"} <= set(ck)
        for c in range(2):
            layer = c * 2 + p
            assert same(ck[f"model{c}"]["decoder.layers.0.input_layernorm.weight"],
                        hf[f"model.layers.{layer}.input_layernorm.weight"])
            assert not any(k.startswith("decoder.layers.1.") for k in ck[f"model{c}"])
    assert "embedding.word_embeddings.weight" in files["mp_rank_00_000"]["model0"]
    assert "decoder.final_layernorm.weight" in files["mp_rank_00_001"]["model1"]

    # noop layer 2 + uneven stages: Megatron has 5 layers, stage 0 = [0,1,2(noop)], stage 1 = [3,4]
    n = root / "noop"
    run("--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", str(hf_dir),
        "--save-dir", str(n), "--target-pipeline-parallel-size", "2", "--noop-layers", "2",
        "--num-layer-list", "3,2", "--make-vocab-size-divisible-by", "64",
        "--params-dtype", "bf16")
    files = rank_files(n)
    s0, s1 = files["mp_rank_00_000"]["model"], files["mp_rank_00_001"]["model"]
    assert {int(k.split(".")[2]) for k in s0 if k.startswith("decoder.layers.")} == {0, 1}
    assert {int(k.split(".")[2]) for k in s1 if k.startswith("decoder.layers.")} == {0, 1}
    bf = lambda x: x.astype(np.float32).astype(ml_dtypes.bfloat16)  # noqa: E731
    assert same(s1["decoder.layers.0.pre_mlp_layernorm.weight"],
                bf(hf["model.layers.2.post_attention_layernorm.weight"]))
    emb = s0["embedding.word_embeddings.weight"]
    assert emb.shape == (128, 48)  # 96 padded to a multiple of 64 * tp(1)
    assert same(emb[:96], bf(hf["model.embed_tokens.weight"])) and not emb[96:].astype(
        np.float32).any()
    assert files["mp_rank_00_000"]["args"].params_dtype is tp.GlobalRef("torch", "bfloat16")
    back = root / "noop_back"
    run("--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", str(n),
        "--save-dir", str(back))
    got = hf_native(back)
    for k in hf:
        assert same(got[k], bf(hf[k])), k


def test_torch_reads_converted_files(dense_ckpts):
    torch = pytest.importorskip("torch")
    root, paths = dense_ckpts
    mg = root / "for_torch"
    run("--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", str(paths["qwen25"]),
        "--save-dir", str(mg), "--target-tensor-parallel-size", "2")
    f = mg / "iter_0000001" / "mp_rank_01" / "model_optim_rng.pt"
    with torch.serialization.safe_globals([argparse.Namespace]):
        ref = torch.load(f, weights_only=True)
    ours = tp.load(str(f))
    assert list(ref["model"]) == list(ours["model"])
    assert ref["args"].params_dtype is torch.bfloat16
    for k, v in ref["model"].items():
        if v is None:
            assert ours["model"][k] is None
        else:
            assert v.dtype == torch.bfloat16
            np.testing.assert_array_equal(v.view(torch.int16).numpy(),
                                          ours["model"][k].view(np.int16))
