"""Distributed checkpoint (``ms_llm.checkpoint.native.dcp``) save / load throughput against a
baseline.

    python -m benchmarks.dcp                 # ~200 MB fp32 (vocab 32001 x 1024 + 6 ffn matrices)
    python -m benchmarks.dcp --layers 2

Baseline (measured here, same tensors, same disk): one ``safetensors.numpy.save_file`` of the
whole state dict plus an fsync -- what the single-process checkpoint did -- and one
``load_file``. The dcp rows simulate W ranks in this one process (every rank's files written in
turn, then ``finalize``), so MB/s is the aggregate of all ranks on one core, and loads assemble
every rank's region (``reshard`` rows read pieces saved at another world size). Page cache is
warm for loads (files were just written). MB/s = checkpoint bytes / wall seconds.
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import numpy as np

from ms_llm.checkpoint.native import dcp
from ms_llm.checkpoint.native.dcp import LocalChunk, WantedChunk


def tensors(layers: int, hidden: int, ffn: int, vocab: int) -> dict:
    rng = np.random.default_rng(0)
    out = {"embedding.word_embeddings.weight": rng.standard_normal((vocab, hidden), np.float32)}
    for i in range(layers):
        out[f"decoder.layers.{i}.mlp.linear_fc1.weight"] = rng.standard_normal((2 * ffn, hidden),
                                                                               np.float32)
        out[f"decoder.layers.{i}.mlp.linear_fc2.weight"] = rng.standard_normal((hidden, ffn),
                                                                               np.float32)
        out[f"decoder.layers.{i}.input_layernorm.weight"] = np.ones(hidden, np.float32)
    return out


def save_dcp(d: str, full: dict, world: int) -> str:
    for r in range(world):
        local = {}
        for n, x in full.items():
            off, sz = dcp.dim0_chunk(x.shape, r, world)
            local[n] = LocalChunk(x[off[0]:off[0] + sz[0]], x.shape, off)
        dcp.write_rank_files(d, 1, local, rank=r, world_size=world)
    return dcp.finalize(d, 1, {"step": 1}, world_size=world)


def load_dcp(path: str, full: dict, world: int, dim: int = 0) -> None:
    for r in range(world):
        wanted = {}
        for n, x in full.items():
            if dim == 1 and x.ndim == 2:
                off, sz = dcp.block_chunk(x.shape, 1, r, world)
            else:
                off, sz = dcp.dim0_chunk(x.shape, r, world)
            wanted[n] = WantedChunk(x.shape, off, sz)
        dcp.load_checkpoint(path, wanted)


def timed(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=2816)
    ap.add_argument("--vocab", type=int, default=32001)
    ap.add_argument("--repeat", type=int, default=2)
    a = ap.parse_args()
    from safetensors.numpy import load_file, save_file

    full = tensors(a.layers, a.hidden, a.ffn, a.vocab)
    mb = sum(x.nbytes for x in full.values()) / 1e6
    root = tempfile.mkdtemp(prefix="bench_dcp_")
    rows = []
    try:
        base = os.path.join(root, "base.safetensors")

        def base_save():
            save_file(full, base)
            fd = os.open(base, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        rows.append(("baseline save_file (1 file)", timed(base_save, a.repeat)))
        for w in (1, 4):
            d = os.path.join(root, f"w{w}")
            rows.append((f"dcp save fsdp={w}",
                         timed(lambda: (shutil.rmtree(d, ignore_errors=True), save_dcp(d, full, w)),
                               a.repeat)))
        rows.append(("baseline load_file (1 file)", timed(lambda: load_file(base), a.repeat)))
        p1, p4 = (os.path.join(root, f"w{w}", "iter_0000001") for w in (1, 4))
        rows.append(("dcp load fsdp=1 -> 1", timed(lambda: load_dcp(p1, full, 1), a.repeat)))
        rows.append(("dcp load fsdp=4 -> fsdp=3", timed(lambda: load_dcp(p4, full, 3), a.repeat)))
        rows.append(("dcp load fsdp=4 -> tp=2 (dim 1)",
                     timed(lambda: load_dcp(p4, full, 2, dim=1), a.repeat)))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    b_save, b_load = rows[0][1], rows[3][1]
    print(f"checkpoint: {mb:.0f} MB fp32, {len(full)} tensors; best of {a.repeat}")
    print(f"{'case':34s} {'seconds':>8s} {'MB/s':>8s} {'vs baseline':>12s}")
    for name, t in rows:
        ref = b_save if "save" in name else b_load
        print(f"{name:34s} {t:8.3f} {mb / t:8.0f} {ref / t:11.2f}x")


if __name__ == "__main__":
    main()
