"""bf16 vs fp32 on CPU: GEMM GFLOP/s at the ~55M model's shapes, and ``ms-llm train`` tokens/s.

GEMMs go through ms_llm's own BLAS kernels (``ms_llm.ops.cpu_kernels.linear``, forward), as
training calls them: fp32 (OpenBLAS sgemm), bf16 with the operands widened to fp32 for OpenBLAS,
and bf16 through oneMKL's ``cblas_gemm_bf16bf16f32`` (when the ``mkl`` package is installed; on
CPUs without AVX512-BF16/AMX it emulates). The training rows run the real command on
``configs/tiny.yaml`` with the issue's model (hidden 512, 8 layers, 8/2 heads, FFN 1408, vocab
32000, seq 512, batch 4) and report the median tokens/s of steps 3..N.

    python benchmarks/bf16.py [--threads 2] [--reps 5] [--train-steps 8] [--skip-train]
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "tiny.yaml")
TOKENS = 4 * 512
# (name, K, N) of y[T, N] = x[T, K] w[N, K]^T in the ~55M model
SHAPES = [("linear_qkv", 512, 768), ("linear_proj", 512, 512), ("linear_fc1", 512, 2816),
          ("linear_fc2", 1408, 512), ("output_layer", 512, 32000)]
MODEL = ["--model.num_layers", "8", "--model.hidden_size", "512", "--model.ffn_hidden_size",
         "1408", "--model.num_attention_heads", "8", "--model.num_query_groups", "2",
         "--model.kv_channels", "64", "--model.padded_vocab_size", "32000",
         "--data.seq_length", "512", "--training.micro_batch_size", "4",
         "--training.global_batch_size", "4", "--training.log_interval", "1",
         "--training.progress_bar", "false"]


def gemm_table(reps: int) -> None:
    import mindspore as ms
    from ms_llm.compat import setup_device
    setup_device("CPU")
    from ms_llm.ops import cpu_kernels as ck
    from ms_llm.ops.cpu_kernels import bf16_gemm
    assert ck.blas_available(), ck.blas_reason()
    lib = ck.blas._cdll()
    try:
        mkl_addr = bf16_gemm.load_mkl_gemm(ck.blas_threads())[0]
    except RuntimeError as e:
        mkl_addr = None
        print(f"(no MKL row: {e})")
    print(f"CPU bf16 units: {', '.join(bf16_gemm.cpu_bf16_units()) or 'none'}; "
          f"BLAS threads {ck.blas_threads()}\n")
    print("| GEMM (T=2048) | fp32 OpenBLAS | bf16 via OpenBLAS (widened) | bf16 oneMKL |")
    print("|---|---:|---:|---:|")
    rng = np.random.default_rng(0)
    for name, k, n in SHAPES:
        x32 = ms.Tensor(rng.standard_normal((TOKENS, k)).astype(np.float32))
        w32 = ms.Tensor(rng.standard_normal((n, k)).astype(np.float32) * 0.02)
        x16, w16 = x32.astype(ms.bfloat16), w32.astype(ms.bfloat16)
        flops = 2.0 * TOKENS * k * n

        def rate(x, w):
            ck.linear(x, w).asnumpy()
            best = float("inf")
            for _ in range(reps):
                t0 = time.perf_counter()
                ck.linear(x, w).asnumpy()   # asnumpy: CPU sync (includes the copy out)
                best = min(best, time.perf_counter() - t0)
            return flops / best / 1e9
        row = [rate(x32, w32)]
        lib.MsLlmBlasSetBf16Gemm(ctypes.c_void_p(None))
        row.append(rate(x16, w16))
        if mkl_addr is not None:
            lib.MsLlmBlasSetBf16Gemm(ctypes.c_void_p(mkl_addr))
            row.append(rate(x16, w16))
            lib.MsLlmBlasSetBf16Gemm(ctypes.c_void_p(None))
        cells = " | ".join(f"{r:.0f}" for r in row) + (" | n/a" if mkl_addr is None else "")
        print(f"| {name} {k}->{n} | {cells} |", flush=True)
    bf16_gemm.register_bf16_gemm(lib, ck.blas_threads())
    print("\nGFLOP/s, best of", reps, "(forward, including ms_llm's op dispatch and the "
          "bf16 widening/rounding passes)\n")


def train_rate(extra, steps: int) -> tuple:
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "-m", "ms_llm.cli", "train", CONFIG, *MODEL, "--training.max_steps",
               str(steps), "--training.output_dir", d, *extra]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
        with open(os.path.join(d, "metrics.jsonl")) as f:
            recs = [json.loads(x) for x in f if '"tokens_per_s"' in x]
    rates = [r["tokens_per_s"] for r in recs if r["step"] >= 3]
    return statistics.median(rates), recs[-1]["loss"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--train-steps", type=int, default=8)
    ap.add_argument("--skip-train", action="store_true")
    ap.add_argument("--skip-gemm", action="store_true")
    args = ap.parse_args()
    if not args.skip_gemm:
        gemm_table(args.reps)
    if args.skip_train:
        return 0
    print("| `ms-llm train`, ~55M model | tokens/s (median of steps 3..N) | last loss |")
    print("|---|---:|---:|")
    for name, extra in (("fp32 PyNative", ["--training.jit", "false"]),
                        ("fp32 jit", ["--training.jit", "true"]),
                        ("bf16 (PyNative on CPU)", ["--training.bf16", "true"])):
        tps, loss = train_rate(extra, args.train_steps)
        print(f"| {name} | {tps:.0f} | {loss:.4f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
