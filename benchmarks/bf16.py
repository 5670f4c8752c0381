"""bf16 vs fp32 on CPU: GEMM GFLOP/s at the ~55M model's shapes, and ``ms-llm train`` tokens/s.

First table (``--skip-raw`` to leave out): the raw bf16 GEMM side by side with torch's bf16 matmul
(``torch.nn.functional.linear`` / ``torch.matmul``, oneDNN inside), alternating torch, oneDNN's
matmul primitive as ms-llm calls it (:mod:`ms_llm.ops.cpu_kernels.gemm.dnnl`), torch again, on
square n = 512 / 1024 / 2048 and the model's linear shapes; CPU model and load printed with it.

GEMMs go through ms_llm's own BLAS kernels (``ms_llm.ops.cpu_kernels.linear``, forward), as
training calls them: fp32 (OpenBLAS sgemm), bf16 with the operands widened to fp32 for OpenBLAS,
and bf16 through oneMKL's ``cblas_gemm_bf16bf16f32`` (when the ``mkl`` package is installed; on
CPUs without AVX512-BF16/AMX it emulates). The training rows run the real command on
``configs/tiny.yaml`` with the issue's model (hidden 512, 8 layers, 8/2 heads, FFN 1408, vocab
32000, seq 512, batch 4) and report the median tokens/s of steps 3..N.

    python -m benchmarks.bf16 [--threads 2] [--reps 5] [--train-steps 8] [--skip-train]
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

from benchmarks.harness import ROOT, machine

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
    from ms_llm.ops.cpu_kernels.gemm import bf16 as bf16_gemm
    assert ck.blas_available(), ck.blas_reason()
    lib = ck.gemm.blas._cdll()
    try:
        mkl_addr = bf16_gemm.load_mkl_gemm(ck.blas_threads())[0]
    except RuntimeError as e:
        mkl_addr = None
        print(f"(no MKL row: {e})")
    print(f"CPU bf16 units: {', '.join(bf16_gemm.cpu_bf16_units()) or 'none'}; "
          f"BLAS threads {ck.blas_threads()}\n")
    try:
        from ms_llm.ops.cpu_kernels.gemm import dnnl as dnnl_gemm
        dnnl_addr = dnnl_gemm.load_dnnl_gemm(ck.blas_threads()) if bf16_gemm.cpu_bf16_units() else None
        if dnnl_addr is None:
            print("(no oneDNN row: this CPU has no bf16 units)")
    except RuntimeError as e:
        dnnl_addr = None
        print(f"(no oneDNN row: {e})")
    lib.MsLlmBlasSetBf16Matmul(ctypes.c_void_p(None))
    print("| GEMM (T=2048) | fp32 OpenBLAS | bf16 via OpenBLAS (widened) | bf16 oneMKL | bf16 oneDNN |")
    print("|---|---:|---:|---:|---:|")
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
        for addr in (mkl_addr, dnnl_addr):
            if addr is None:
                row.append(None)
                continue
            lib.MsLlmBlasSetBf16Gemm(ctypes.c_void_p(addr))
            if addr == dnnl_addr:
                lib.MsLlmBlasSetBf16Matmul(ctypes.c_void_p(dnnl_gemm.matmul_address(ck.blas_threads())))
            row.append(rate(x16, w16))
            lib.MsLlmBlasSetBf16Gemm(ctypes.c_void_p(None))
            lib.MsLlmBlasSetBf16Matmul(ctypes.c_void_p(None))
        cells = " | ".join("n/a" if r is None else f"{r:.0f}" for r in row)
        print(f"| {name} {k}->{n} | {cells} |", flush=True)
    bf16_gemm.register_bf16_gemm(lib, ck.blas_threads())
    print("\nGFLOP/s, best of", reps, "(forward, including ms_llm's op dispatch and the "
          "bf16 widening/rounding passes)\n")


def raw_table(reps: int, threads: int) -> None:
    """bf16 GEMM GFLOP/s: torch's bf16 matmul and oneDNN's matmul primitive as ms-llm calls it
    (fp32 accumulation, fp32 output), same bf16 operands, alternating torch / ours / torch."""
    import torch
    from ms_llm.ops.cpu_kernels.gemm import dnnl as dnnl_gemm
    from ms_llm.ops.cpu_kernels.gemm.bf16 import cpu_bf16_units
    torch.set_num_threads(threads)
    dnnl_gemm.load_dnnl_gemm(threads)
    print(f"{machine()}; bf16 units: {', '.join(cpu_bf16_units()) or 'none'}; "
          f"oneDNN {dnnl_gemm.onednn_version()} (MindSpore's); torch {torch.__version__}; "
          f"{threads} threads\n")
    print("| bf16 GEMM, fp32 accumulation | torch GFLOP/s | ms-llm oneDNN GFLOP/s | torch again "
          "| ratio | max rel. err vs fp32 |")
    print("|---|---:|---:|---:|---:|---:|")
    gen = torch.Generator().manual_seed(0)
    cases = [(f"square n={n}", n, n, n, False) for n in (512, 1024, 2048)]
    cases += [(f"{name} {TOKENS}x{k} @ ({n}x{k})^T", TOKENS, n, k, True) for name, k, n in SHAPES]
    for label, m, n, k, tb in cases:
        a = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        b = torch.randn(*((n, k) if tb else (k, n)), generator=gen).to(torch.bfloat16)
        c = torch.empty(m, n, dtype=torch.float32)

        def theirs():
            return torch.nn.functional.linear(a, b) if tb else torch.matmul(a, b)

        def ours():
            dnnl_gemm.matmul_bf16(a, b, c, trans_b=tb)

        def rate(fn):
            fn()
            best = float("inf")
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - t0)
            return 2.0 * m * n * k / best / 1e9

        t1, o, t2 = rate(theirs), rate(ours), rate(theirs)
        want = a.double() @ (b.double().T if tb else b.double())
        err = float((c.double() - want).abs().max() / want.abs().max())
        print(f"| {label} | {t1:.0f} | {o:.0f} | {t2:.0f} | {o / max(t1, t2):.2f}x | {err:.1e} |",
              flush=True)
    print(f"\nbest of {reps}; ratio = ours / the better torch run; {machine()}\n")


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
    ap.add_argument("--skip-raw", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if not args.skip_raw:
        raw_table(max(args.reps, 10), args.threads)
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
