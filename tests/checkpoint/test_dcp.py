"""Distributed checkpoints (``ms_llm.checkpoint.native.dcp``): reshardable save/load, completeness,
resume discovery, pruning and export.

Ranks are simulated in one process: ``write_rank_files`` for rank 0..W-1 then ``finalize``
(what ``save_checkpoint`` does around its two barriers), plus one run of ``save_checkpoint``
itself on W threads with a real ``threading.Barrier``.

The reference for every piece is written here, independently of the code under test: FSDP
rows follow torch FSDP2's ``torch.chunk`` rule on dim 0 (C = ceil(D0/W), rank r holds
``[r*C, min((r+1)*C, D0))``, possibly empty), tensor-parallel blocks are ``np.split``. Loaded
regions are compared with ``np.array_equal`` (exact): a checkpoint only moves bytes, so any
difference is a bug, not rounding.
"""
from __future__ import annotations

import dataclasses
import json
import os
import threading

import ml_dtypes
import numpy as np
import pytest

from ms_llm.checkpoint.native import dcp
from ms_llm.checkpoint.native.dcp import DCPError, LocalChunk, WantedChunk

RNG = np.random.default_rng(1234)
BF16 = np.dtype(ml_dtypes.bfloat16)


def _full_tensors():
    """Awkward sizes: vocab 257 (prime), hidden 96, ffn 200; 7 / 5 / 2 rows (empty
    shards at 4 ranks for 5 and 2 rows), a bf16 tensor, an int64 tensor, a 0-d scalar."""
    f = lambda *s: RNG.standard_normal(s).astype(np.float32)  # noqa: E731
    return {
        "embedding.word_embeddings.weight": f(257, 96),
        "decoder.layers.0.mlp.linear_fc1.weight": f(200, 96),
        "decoder.layers.0.mlp.linear_fc2.weight": f(96, 200),
        "decoder.final_layernorm.weight": f(96),
        "seven": f(7, 3),
        "five": f(5, 4),
        "two": f(2, 6),
        "bf16": f(9, 8).astype(BF16),
        "ints": RNG.integers(-10**12, 10**12, size=(11,), dtype=np.int64),
        "optimizer.exp_avg.embedding.word_embeddings.weight": f(257, 96),
        "optimizer.step": np.array(17, dtype=np.int64),
    }


REPLICATED = {"decoder.final_layernorm.weight", "optimizer.step"}


def chunk_rows(d0, world, r):
    """torch.chunk: C = ceil(d0 / W); rank r holds [r*C, min((r+1)*C, d0))."""
    c = -(-d0 // world)
    lo = min(r * c, d0)
    return lo, min(lo + c, d0)


def fsdp_region(shape, world, r):
    lo, hi = chunk_rows(shape[0], world, r)
    return (lo,) + (0,) * (len(shape) - 1), (hi - lo,) + tuple(shape[1:])


# tp split: vocab on dim 1 (257 rows do not split in 2), fc1 dim 0, fc2 dim 1
TP_DIM = {"embedding.word_embeddings.weight": 1, "decoder.layers.0.mlp.linear_fc1.weight": 0,
          "decoder.layers.0.mlp.linear_fc2.weight": 1,
          "optimizer.exp_avg.embedding.word_embeddings.weight": 1}


def tp_region(name, shape, world, r):
    """Tensor parallel: an even block of TP_DIM[name]; tensors not listed fall back to FSDP
    rows (a tp=2 job also shards its small tensors some way)."""
    if name not in TP_DIM:
        return fsdp_region(shape, world, r)
    d = TP_DIM[name]
    n = shape[d] // world
    off, sz = [0] * len(shape), list(shape)
    off[d], sz[d] = r * n, n
    return tuple(off), tuple(sz)


def region(kind, name, shape, world, r):
    if name in REPLICATED or len(shape) == 0:
        return (0,) * len(shape), tuple(shape)
    return fsdp_region(shape, world, r) if kind == "fsdp" else tp_region(name, shape, world, r)


def _slices(off, sz):
    return tuple(slice(o, o + s) for o, s in zip(off, sz))


def local_for(full, kind, world, r):
    out = {}
    for name, x in full.items():
        off, sz = region(kind, name, x.shape, world, r)
        out[name] = LocalChunk(x[_slices(off, sz)].copy(), x.shape, off,
                               write=name not in REPLICATED or r == 0)
    return out


def save_sim(save_dir, step, full, kind, world, state=None, keep_last=None):
    for r in range(world):
        dcp.write_rank_files(save_dir, step, local_for(full, kind, world, r), rank=r,
                             world_size=world)
    return dcp.finalize(save_dir, step, state or {"step": step}, world_size=world,
                        keep_last=keep_last)


def wanted_for(full, kind, world, r):
    return {n: WantedChunk(x.shape, *region(kind, n, x.shape, world, r), dtype=None)
            for n, x in full.items()}


def test_reshard_matrix(tmp_path):
    """fsdp=3 -> fsdp 2/1/4 and tp=2; tp=2 -> fsdp 3; fsdp=4 (empty shards) -> fsdp 3, 1."""
    full = _full_tensors()
    for src_kind, src_w, targets in [
            ("fsdp", 3, [("fsdp", 2), ("fsdp", 1), ("fsdp", 4), ("tp", 2), ("fsdp", 3)]),
            ("tp", 2, [("fsdp", 3), ("fsdp", 1)]),
            ("fsdp", 4, [("fsdp", 3), ("fsdp", 1), ("tp", 2)])]:
        d = tmp_path / f"{src_kind}{src_w}"
        path = save_sim(str(d), 3, full, src_kind, src_w)
        for kind, world in targets:
            for r in range(world):
                got, state = dcp.load_checkpoint(path, wanted_for(full, kind, world, r))
                assert state == {"step": 3}
                for n, x in full.items():
                    off, sz = region(kind, n, x.shape, world, r)
                    want = x[_slices(off, sz)]
                    assert got[n].dtype == x.dtype and got[n].shape == want.shape, (n, kind)
                    assert np.array_equal(got[n], want), (src_kind, src_w, kind, world, r, n)


def test_metadata_records_pieces_and_skips_empty_chunks(tmp_path):
    full = _full_tensors()
    path = save_sim(str(tmp_path), 5, full, "fsdp", 4,
                    state={"step": 5, "lr": {"last_lr": 1.5e-4, "num_steps": 5},
                           "data": {"consumed_samples": 40}, "rng": {"seed": 7, "calls": [1, 2]}})
    meta = json.load(open(os.path.join(path, "metadata.json")))
    assert meta["world_size"] == 4 and meta["step"] == 5
    assert meta["state"]["rng"] == {"seed": 7, "calls": [1, 2]}
    for n, x in full.items():
        t = meta["tensors"][n]
        assert t["global_shape"] == list(x.shape)
        if n in REPLICATED:
            expect = [((0,) * x.ndim, x.shape)]
        else:
            expect = [fsdp_region(x.shape, 4, r) for r in range(4)]
            expect = [(o, s) for o, s in expect if s[0] > 0]  # empty shards store nothing
        assert [(tuple(c["offsets"]), tuple(c["sizes"])) for c in t["chunks"]] == \
            [(tuple(o), tuple(s)) for o, s in expect], n
    # 5 rows on 4 ranks: 2,2,1,0; 2 rows on 4 ranks: 1,1,0,0; 7 rows: 2,2,2,1
    assert [c["sizes"][0] for c in meta["tensors"]["five"]["chunks"]] == [2, 2, 1]
    assert [c["sizes"][0] for c in meta["tensors"]["two"]["chunks"]] == [1, 1]
    assert [c["sizes"][0] for c in meta["tensors"]["seven"]["chunks"]] == [2, 2, 2, 1]
    # a rank file holds only real rows: its byte size is the sum of its pieces plus a header
    from safetensors import safe_open
    with safe_open(os.path.join(path, "rank_00003.safetensors"), framework="numpy") as f:
        keys = set(f.keys())
    assert "five" not in keys and "two" not in keys and "seven" in keys
    assert dcp.read_state(path)["lr"]["num_steps"] == 5
    assert open(os.path.join(str(tmp_path), dcp.TRACKER)).read() == "5"
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp")]


def test_arbitrary_region_reads(tmp_path):
    full = _full_tensors()
    path = save_sim(str(tmp_path), 1, full, "fsdp", 3)
    with dcp.DCPReader(path) as r:
        x = full["embedding.word_embeddings.weight"]
        for _ in range(20):
            lo = RNG.integers(0, x.shape, size=2)
            sz = RNG.integers(0, x.shape - lo + 1)
            got = r.read("embedding.word_embeddings.weight", lo, sz)
            assert np.array_equal(got, x[_slices(lo, sz)])
        got = r.read("bf16", dtype=np.float32)  # cast on request
        assert got.dtype == np.float32 and np.array_equal(got, full["bf16"].astype(np.float32))
        assert r.read("optimizer.step") == 17


def test_save_checkpoint_with_threads_and_failure_on_all_ranks(tmp_path):
    full = _full_tensors()
    world = 3
    bar = threading.Barrier(world, timeout=60)
    results, errors = {}, {}

    def run(r, local, step):
        try:
            results[r] = dcp.save_checkpoint(str(tmp_path), step, local, {"step": step}, rank=r,
                                             world_size=world, barrier=bar.wait)
        except Exception as e:  # collected: every rank must raise, none may hang
            errors[r] = e

    def launch(step, locals_):
        results.clear(), errors.clear()
        ts = [threading.Thread(target=run, args=(r, locals_[r], step)) for r in range(world)]
        [t.start() for t in ts]
        [t.join(120) for t in ts]
        assert not any(t.is_alive() for t in ts)

    launch(2, [local_for(full, "fsdp", world, r) for r in range(world)])
    assert not errors and len(set(results.values())) == 1
    got, _ = dcp.load_checkpoint(results[0], wanted_for(full, "fsdp", 1, 0))
    assert all(np.array_equal(got[n], full[n]) for n in full)

    # rank 1 also writes the replicated norm -> overlap detected by rank 0, raised everywhere
    bad = [local_for(full, "fsdp", world, r) for r in range(world)]
    bad[1]["decoder.final_layernorm.weight"].write = True
    launch(4, bad)
    assert sorted(errors) == [0, 1, 2], errors
    assert all("overlaps" in str(e) for e in errors.values())
    assert not os.path.exists(os.path.join(tmp_path, "iter_0000004"))
    assert open(os.path.join(tmp_path, dcp.TRACKER)).read() == "2"
    assert dcp.find_latest_complete(str(tmp_path)).endswith("iter_0000002")

    # a rank that fails before writing: its error on that rank, "missing" on the others
    bad = [local_for(full, "fsdp", world, r) for r in range(world)]
    bad[2]["seven"] = LocalChunk(np.zeros((3, 3), np.float32), (7, 3), (6, 0))
    launch(5, bad)
    assert sorted(errors) == [0, 1, 2]
    assert "outside global shape" in str(errors[2]) and "rank_00002.json" in str(errors[1])


def test_incomplete_checkpoints_are_never_loaded(tmp_path):
    full = _full_tensors()
    d = str(tmp_path)
    for step in (1, 2, 3):
        save_sim(d, step, full, "fsdp", 2)
    wanted = wanted_for(full, "fsdp", 2, 0)
    msgs = []
    # newest lost its metadata (save died before the last write)
    os.remove(os.path.join(d, "iter_0000003", "metadata.json"))
    with pytest.raises(DCPError, match="metadata.json is missing"):
        dcp.load_checkpoint(os.path.join(d, "iter_0000003"), wanted)
    assert dcp.find_latest_complete(d, report=msgs.append) == os.path.join(d, "iter_0000002")
    assert "iter_0000003" in msgs[-1] and "falling back to" in msgs[-1]
    # step 2's shard is truncated
    shard = os.path.join(d, "iter_0000002", "rank_00001.safetensors")
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) - 100)
    with pytest.raises(DCPError, match="truncated"):
        dcp.load_checkpoint(os.path.join(d, "iter_0000002"), wanted)
    msgs.clear()
    assert dcp.resolve_resume("auto", d, report=msgs.append) == os.path.join(d, "iter_0000001")
    assert "iter_0000002" in msgs[-1] and "iter_0000003" in msgs[-1]
    with pytest.raises(DCPError, match="not a complete checkpoint"):
        dcp.resolve_resume(os.path.join(d, "iter_0000002"), d)
    # a same-size corruption passes the size check but not the crc check
    shard1 = os.path.join(d, "iter_0000001", "rank_00000.safetensors")
    with open(shard1, "r+b") as f:
        f.seek(os.path.getsize(shard1) - 1)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    assert dcp.check_complete(os.path.join(d, "iter_0000001")) is None
    assert "crc32" in dcp.check_complete(os.path.join(d, "iter_0000001"), verify="crc")
    assert dcp.find_latest_complete(d, verify="crc", report=msgs.append) is None
    assert dcp.resolve_resume(None, d) is None
    assert dcp.find_latest_complete(str(tmp_path / "nothing")) is None


def test_keep_last_pruning_and_resave(tmp_path):
    full = {"w": RNG.standard_normal((10, 4)).astype(np.float32)}
    d = str(tmp_path)
    for step in (1, 2, 3, 4):
        save_sim(d, step, full, "fsdp", 3, keep_last=2)
    assert sorted(n for n in os.listdir(d) if not n.startswith(".")) == \
        ["iter_0000003", "iter_0000004", dcp.TRACKER]
    # re-saving an existing step (resumed from an earlier one) replaces it cleanly
    full2 = {"w": full["w"] + 1}
    save_sim(d, 4, full2, "fsdp", 2, keep_last=2)
    got, _ = dcp.load_checkpoint(os.path.join(d, "iter_0000004"),
                                 {"w": WantedChunk((10, 4), (0, 0), (10, 4))})
    assert np.array_equal(got["w"], full2["w"])
    assert sorted(os.listdir(d)) == ["iter_0000003", "iter_0000004", dcp.TRACKER]


def test_load_errors_name_tensor_and_path(tmp_path):
    full = _full_tensors()
    path = save_sim(str(tmp_path), 1, full, "fsdp", 3)
    wanted = wanted_for(full, "fsdp", 1, 0)
    with pytest.raises(DCPError, match=r"'nope' is not in the checkpoint"):
        dcp.load_checkpoint(path, {**wanted, "nope": WantedChunk((1,), (0,), (1,))})
    bad = dict(wanted)
    bad["seven"] = WantedChunk((8, 3), (0, 0), (8, 3))
    with pytest.raises(DCPError, match=r"'seven' has global shape \[7, 3\]"):
        dcp.load_checkpoint(path, bad)
    # optimizer state not created by the caller: never dropped silently
    no_opt = {n: w for n, w in wanted.items() if not n.startswith("optimizer.")}
    with pytest.raises(DCPError, match="optimizer.exp_avg"):
        dcp.load_checkpoint(path, no_opt)
    got, _ = dcp.load_checkpoint(path, no_opt, strict=False)
    assert set(got) == set(no_opt)
    # metadata that lost a chunk: the region is not covered -> error, not zeros
    meta_path = os.path.join(path, "metadata.json")
    meta = json.load(open(meta_path))
    meta["tensors"]["seven"]["chunks"].pop(1)
    json.dump(meta, open(meta_path, "w"))
    with pytest.raises(DCPError, match=r"'seven'.*not fully covered"):
        dcp.load_checkpoint(path, wanted)
    # pieces disagreeing on dtype / not tiling the tensor are caught when saving
    d2 = str(tmp_path / "bad")
    dcp.write_rank_files(d2, 1, {"w": LocalChunk(np.zeros((2, 2), np.float32), (4, 2), (0, 0))},
                         rank=0, world_size=2)
    dcp.write_rank_files(d2, 1, {"w": LocalChunk(np.zeros((2, 2), np.float16), (4, 2), (2, 0))},
                         rank=1, world_size=2)
    with pytest.raises(DCPError, match=r"tensor 'w': rank 1 has float16"):
        dcp.finalize(d2, 1, {}, world_size=2)
    dcp.write_rank_files(d2, 1, {"w": LocalChunk(np.zeros((1, 2), np.float32), (4, 2), (2, 0))},
                         rank=1, world_size=2)
    with pytest.raises(DCPError, match=r"cover 6 of 8"):
        dcp.finalize(d2, 1, {}, world_size=2)
    with pytest.raises(DCPError, match="rank_00000.json: written for step 1 / world size 2"):
        dcp.finalize(d2, 1, {}, world_size=3)
    # column pieces (tp on dim 1) that overlap on column 2
    d3 = str(tmp_path / "cols")
    dcp.write_rank_files(d3, 1, {"w": LocalChunk(np.zeros((4, 3), np.float32), (4, 4), (0, 0))},
                         rank=0, world_size=2)
    dcp.write_rank_files(d3, 1, {"w": LocalChunk(np.zeros((4, 2), np.float32), (4, 4), (0, 2))},
                         rank=1, world_size=2)
    with pytest.raises(DCPError, match=r"tensor 'w': the piece at \[0, 2\].*overlaps"):
        dcp.finalize(d3, 1, {}, world_size=2)
    os.remove(os.path.join(d2, ".tmp_iter_0000001", "rank_00001.json"))
    with pytest.raises(DCPError, match="rank_00001.json: missing"):
        dcp.finalize(d2, 1, {}, world_size=2)
    with pytest.raises(DCPError, match="not JSON-serialisable"):
        dcp.write_rank_files(d2, 1, {"w": LocalChunk(np.zeros((2, 2), np.float32), (4, 2),
                                                     (2, 0))}, rank=1, world_size=2)
        dcp.finalize(d2, 1, {"rng": np.zeros(2)}, world_size=2)
    assert not os.path.exists(os.path.join(d2, "iter_0000001"))


# --------------------------------------------------------------------------------------------
# Export: a tiny model's checkpoint -> HF / Megatron folders -> same logits
# --------------------------------------------------------------------------------------------

def _model_and_weights(cfg_kwargs, seed):
    from ms_llm.compat import load_state_dict, state_dict
    from ms_llm.models import GPTModel
    from ms_llm.models.config import TransformerConfig
    cfg = TransformerConfig(**cfg_kwargs)
    model = GPTModel(cfg)
    rng = np.random.default_rng(seed)
    sd = {k: (rng.standard_normal(tuple(p.shape)) * (0.3 if p.ndim == 1 else 0.08)
              + (1.0 if p.ndim == 1 else 0.0)).astype(np.float32)
          for k, p in state_dict(model).items()}
    load_state_dict(model, sd, strict=True, source="test")
    return cfg, model, sd


def _logits(model, ids):
    import mindspore as ms
    return model(ms.Tensor(ids.astype(np.int32))).asnumpy().astype(np.float64)


EXPORT_CASES = {
    # awkward sizes (vocab 257 is prime); GQA 4 heads / 2 groups, head dim 24, untied (Llama)
    "llama": dict(num_layers=3, hidden_size=96, ffn_hidden_size=200, num_attention_heads=4,
                  num_query_groups=2, padded_vocab_size=257,
                  untie_embeddings_and_output_weights=True, max_position_embeddings=64),
    # Qwen3: QK-norm, head dim 16 != hidden / heads, tied embeddings
    "qwen3": dict(num_layers=2, hidden_size=48, ffn_hidden_size=40, num_attention_heads=4,
                  num_query_groups=2, kv_channels=16, padded_vocab_size=101, qk_layernorm=True,
                  untie_embeddings_and_output_weights=False, rotary_base=1e6,
                  max_position_embeddings=64),
}


@pytest.mark.parametrize("name", list(EXPORT_CASES))
def test_export_hf_and_megatron_give_same_logits(tmp_path, name):
    from helpers import hf_reference as ref
    from ms_llm.checkpoint.hf.io import read_hf_config, read_hf_weights
    from ms_llm.checkpoint import from_pretrained

    cfg, model, sd = _model_and_weights(EXPORT_CASES[name], seed=len(name))
    ids = np.random.default_rng(0).integers(0, cfg.padded_vocab_size, size=(2, 11))
    want = _logits(model, ids)
    # saved at fsdp=3, with optimizer moments beside the weights (export must skip them)
    full = dict(sd)
    full.update({f"optimizer.exp_avg.{k}": v * 0.5 for k, v in sd.items()})
    ck = save_sim(str(tmp_path / "ck"), 3, full, "fsdp", 3,
                  state={"step": 3, "model_config": dataclasses.asdict(cfg)})

    hf_dir = dcp.export_hf(ck, str(tmp_path / "hf"), config=cfg)
    # independent check of the HF layout: the float64 NumPy HF forward on the exported files.
    # 1e-4 absolute: fp32 model vs float64 reference over 2-3 layers (as in test_hf_parity).
    hf_cfg = read_hf_config(hf_dir)
    ref_logits = ref.forward({k: v.astype(np.float64) for k, v in read_hf_weights(hf_dir).items()},
                             hf_cfg, ids)
    assert np.abs(ref_logits - want).max() < 1e-4
    # round trip through from_pretrained: same weights bit for bit, same kernels -> equal
    # logits up to the last ulp (1e-6 absolute on logits of magnitude ~1).
    back = from_pretrained(hf_dir)
    assert np.abs(_logits(back, ids) - want).max() < 1e-6

    # Megatron legacy layout at tp=2 (vocab padded to a multiple of 2), config taken from the
    # checkpoint's own state (model_config)
    mg_dir = dcp.export_megatron(ck, str(tmp_path / "mg"), tp=2, make_vocab_size_divisible_by=1)
    mg = from_pretrained(mg_dir)
    got = _logits(mg, ids)
    V = cfg.padded_vocab_size
    assert np.abs(got[..., :V] - want).max() < 1e-6
    assert np.all(got[..., V:] == 0)  # zero padding rows score exactly 0

    with pytest.raises(DCPError, match="exists and is not empty"):
        dcp.export_hf(ck, hf_dir, config=cfg)
    wrong = cfg.replace(num_layers=cfg.num_layers - 1)
    with pytest.raises(DCPError, match="holds layers"):
        dcp.export_hf(ck, str(tmp_path / "hf2"), config=wrong)
    assert not os.path.exists(tmp_path / "hf2")


def test_chunk_helpers_follow_torch_chunk_rule():
    """``dcp.dim0_chunk`` (for callers building LocalChunk/WantedChunk) against ``chunk_rows``
    above; the pieces of every rank tile dim 0 exactly, empty shards included."""
    for d0, world in [(151936, 3), (151936, 5), (151936, 16), (32001, 3), (32001, 16), (257, 3),
                      (257, 4), (7, 4), (5, 4), (2, 4), (10, 4), (0, 3), (1, 16)]:
        rows = []
        for r in range(world):
            off, sz = dcp.dim0_chunk((d0, 5), r, world)
            lo, hi = chunk_rows(d0, world, r)
            assert (off, sz) == ((lo, 0), (hi - lo, 5)), (d0, world, r)
            rows.extend(range(off[0], off[0] + sz[0]))
        assert rows == list(range(d0))
    assert dcp.dim0_chunk((10, 3), 3, 4) == ((9, 0), (1, 3))  # 10 rows on 4: 3,3,3,1
    assert dcp.block_chunk((96, 200), 1, 1, 2) == ((0, 100), (96, 100))
    with pytest.raises(DCPError, match="not divisible"):
        dcp.block_chunk((257, 96), 0, 0, 2)
