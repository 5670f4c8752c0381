"""Composed MindSpore ops vs the AOT C++ CPU kernels (ms_llm.ops.cpu_kernels), forward and fwd+bwd,
in PyNative and under mindspore.jit, at the 50M-model shapes.

    python -m benchmarks.ops                  # all ops, MindSpore threads_num(1), kernels' default threads
    python -m benchmarks.ops --ops rms_norm cross_entropy --repeat 20 --ms-threads 2

Timing: median (or --stat min) wall time over --repeat calls after --warmup calls. fwd+bwd runs
GradOperation(get_all=True, sens_param=True) with a fixed random output gradient, so it times the op's
forward and backward only (no extra loss reduction). Every timed call ends by reading one element of
the result back (.asnumpy()), which waits for the queued work. The last column is max|AOT - composed|
over the fwd+bwd gradients, as a sanity check.

A second table (ops ``linear`` and ``bmm``) compares MindSpore's matmuls (``mint.nn.functional.linear``,
``mint.matmul``) with the OpenBLAS-backed AOT kernels (``cpu_kernels.linear`` / ``bmm``, needs the
scipy-openblas32 package), with GFLOP/s columns (fwd: 2MNK flops, fwd+bwd: 6MNK). The BLAS kernels use
OpenBLAS's own threads (``cpu_kernels.blas_threads()``), not --ms-threads.

    python -m benchmarks.ops --ops linear bmm --ms-threads 2 --stat min
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np


import mindspore as ms
from mindspore import Tensor, ops


def _cases(rng):
    def t(*shape):
        return Tensor(rng.standard_normal(shape).astype(np.float32))

    n, v = 2048, 32000
    labels = rng.integers(0, v, size=n).astype(np.int32)
    labels[rng.choice(n, 28, replace=False)] = -100
    labels_t = Tensor(labels)
    s, d = 512, 64
    pos = np.arange(s)[:, None] / (10000.0 ** (np.arange(0, d, 2) / d))[None, :]
    ang = np.concatenate([pos, pos], -1).astype(np.float32)
    cos_t, sin_t = Tensor(np.cos(ang)), Tensor(np.sin(ang))

    def rms(m):
        def f(x, w):
            return m.rms_norm(x, w, 1e-6)

        return f

    def swiglu(m):
        def f(x):
            return m.swiglu(x)

        return f

    def ce(m):
        def f(x):
            return m.cross_entropy(x, labels_t, -100)

        return f

    def rope(m):
        def f(x):
            return m.rope(x, cos_t, sin_t, -2)

        return f

    def csm(m):
        def f(x):
            return m.causal_softmax(x, 0.125)

        return f

    return [
        ("rms_norm", "(2048, 512)", rms, lambda: [t(2048, 512), t(512)]),
        ("swiglu", "(2048, 2*1408)", swiglu, lambda: [t(2048, 2 * 1408)]),
        ("cross_entropy", "(2048, 32000)", ce, lambda: [t(n, v)]),
        ("rope", "(4, 8, 512, 64)", rope, lambda: [t(4, 8, s, d)]),
        ("causal_softmax", "(4, 8, 512, 512)", csm, lambda: [t(4, 8, s, s)]),
    ]


def _matmul_cases(rng):
    """(name, shape label, MindSpore fn, BLAS fn, inputs, flops of the forward)."""
    from mindspore import mint

    from ms_llm.ops import cpu_kernels as ck

    def t(*shape):
        return Tensor(rng.standard_normal(shape).astype(np.float32))

    def ms_linear(x, w):
        return mint.nn.functional.linear(x, w)

    def blas_linear(x, w):
        return ck.linear(x, w)

    def ms_mm(a, b):
        return mint.matmul(a, b)

    def blas_mm(a, b):
        return ck.bmm(a, b)

    def ms_mm_nt(a, b):
        return mint.matmul(a, b.swapaxes(-1, -2))

    def blas_mm_nt(a, b):
        return ck.bmm(a, b, transpose_b=True)

    cases = []
    for m, k, n in ((2048, 512, 32000), (2048, 512, 2816), (2048, 1408, 512), (2048, 512, 768)):
        cases.append(
            ("linear", f"({m},{k})x({n},{k})", ms_linear, blas_linear, lambda m=m, k=k, n=n: [t(m, k), t(n, k)],
             2.0 * m * n * k)
        )
    b, g, r, s, d = 4, 2, 2048, 512, 64
    cases.append(("bmm", f"({b},{g},{r},{d})x({b},{g},{d},{s})", ms_mm, blas_mm,
                  lambda: [t(b, g, r, d), t(b, g, d, s)], 2.0 * b * g * r * d * s))
    cases.append(("bmm", f"({b},{g},{r},{s})x({b},{g},{s},{d})", ms_mm, blas_mm,
                  lambda: [t(b, g, r, s), t(b, g, s, d)], 2.0 * b * g * r * s * d))
    cases.append(("bmm_nt", f"({b},{g},{r},{d})x({b},{g},{s},{d})^T", ms_mm_nt, blas_mm_nt,
                  lambda: [t(b, g, r, d), t(b, g, s, d)], 2.0 * b * g * r * d * s))
    return cases


def _matmul_table(args, rng, modes):
    from ms_llm.ops import cpu_kernels as ck

    if not ck.blas_available():
        print(f"\nBLAS kernels unavailable: {ck.blas_reason()}")
        return
    from ms_llm.ops.cpu_kernels.gemm.blas import blas_config

    print(f"\nBLAS library: {ck.blas_library_path()}\nOpenBLAS threads={ck.blas_threads()} ({blas_config()})\n")
    grad_all = ops.GradOperation(get_all=True, sens_param=True)
    rows = []
    for name, shape, ms_fn, blas_fn, make_args, flops in _matmul_cases(rng):
        if args.ops and name not in args.ops and not (name == "bmm_nt" and "bmm" in args.ops):
            continue
        inputs = make_args()
        out = ms_fn(*inputs)
        sens = Tensor(rng.standard_normal(out.shape).astype(np.float32))
        del out
        for mode in modes:
            res, grads = {}, {}
            for impl, f in (("ms", ms_fn), ("blas", blas_fn)):
                fb = _fwd_bwd(grad_all(f), sens)
                ff = f
                if mode == "jit":
                    ff, fb = ms.jit(f), ms.jit(fb)
                res[impl] = (
                    _time(ff, inputs, args.warmup, args.repeat, args.stat),
                    _time(fb, inputs, args.warmup, args.repeat, args.stat),
                )
                grads[impl] = [x.asnumpy() for x in fb(*inputs)]
            rel = max(
                float(np.abs(a - b).max() / (np.abs(b).max() + 1e-30)) for a, b in zip(grads["blas"], grads["ms"])
            )
            rows.append((name, shape, mode, *res["ms"], *res["blas"], flops, rel))
            print(f"  done {name} {shape} {mode}", file=sys.stderr, flush=True)

    print(
        "| op | shape | mode | MS fwd ms | BLAS fwd ms | MS fwd GFLOP/s | BLAS fwd GFLOP/s | MS fwd+bwd ms "
        "| BLAS fwd+bwd ms | MS fwd+bwd GFLOP/s | BLAS fwd+bwd GFLOP/s | fwd+bwd speed-up | max rel grad diff |"
    )
    print("|" + "---|" * 13)
    for name, shape, mode, mf, mb, bf, bb, flops, rel in rows:
        gf = flops / 1e6  # GFLOP/s from ms
        print(
            f"| {name} | {shape} | {mode} | {mf:.1f} | {bf:.1f} | {gf / mf:.0f} | {gf / bf:.0f} | {mb:.1f} | {bb:.1f} "
            f"| {3 * gf / mb:.0f} | {3 * gf / bb:.0f} | {mb / bb:.2f}x | {rel:.1e} |"
        )


def _fwd_bwd(grad_fn, sens):
    def fb(*a):
        return grad_fn(*a, sens)

    return fb


def _sync(out):
    o = out[0] if isinstance(out, (tuple, list)) else out
    o.reshape(-1)[:1].asnumpy()


def _time(fn, args, warmup, repeat, stat="median"):
    for _ in range(warmup):
        _sync(fn(*args))
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        _sync(fn(*args))
        ts.append(time.perf_counter() - t0)
    return (min(ts) if stat == "min" else statistics.median(ts)) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", nargs="*", default=None, help="subset of op names")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument(
        "--stat", choices=["median", "min"], default="median", help="min is robust to other load on the machine"
    )
    ap.add_argument("--ms-threads", type=int, default=1, help="ms.device_context.cpu.op_tuning.threads_num")
    ap.add_argument("--no-jit", action="store_true")
    ap.add_argument(
        "--sync",
        action="store_true",
        help="ms.set_context(pynative_synchronize=True): on the 2-vCPU dev VM this makes small PyNative ops "
        "~10x faster (no hand-off to the async launch thread)",
    )
    args = ap.parse_args()

    ms.set_device("CPU")
    if args.sync:
        ms.set_context(pynative_synchronize=True)
    ms.device_context.cpu.op_tuning.threads_num(args.ms_threads)

    from ms_llm.ops import cpu_kernels as ck
    from ms_llm.ops.cpu_kernels.model import composed

    if not ck.available():
        print(f"AOT kernels unavailable: {ck.reason()}")
        return 1
    lib = ck.library_path()
    import ctypes

    kthreads = ctypes.CDLL(str(lib)).MsLlmKernelsOpenMP()
    print(f"AOT library: {lib}")
    print(
        f"MindSpore {ms.__version__}, threads_num={args.ms_threads}, pynative_synchronize={args.sync}, "
        f"kernel OpenMP threads={kthreads}, "
        f"{args.stat} of {args.repeat} after {args.warmup} warm-up\n"
    )

    rng = np.random.default_rng(0)
    modes = ["pynative"] + ([] if args.no_jit else ["jit"])
    rows = []
    grad_all = ops.GradOperation(get_all=True, sens_param=True)
    cases = [c for c in _cases(rng) if not args.ops or c[0] in args.ops]
    for name, shape, make, make_args in cases:
        if args.ops and name not in args.ops:
            continue
        inputs = make_args()
        sens = None
        for mode in modes:
            res = {}
            grads = {}
            for impl, mod in (("composed", composed), ("aot", ck)):
                f = make(mod)
                if sens is None:
                    out = f(*inputs)
                    sens = Tensor(rng.standard_normal(out.shape).astype(np.float32))
                fb = _fwd_bwd(grad_all(f), sens)
                ff = f
                if mode == "jit":
                    ff, fb = ms.jit(f), ms.jit(fb)
                res[impl] = (
                    _time(ff, inputs, args.warmup, args.repeat, args.stat),
                    _time(fb, inputs, args.warmup, args.repeat, args.stat),
                )
                grads[impl] = [x.asnumpy() for x in fb(*inputs)]
            diff = max(float(np.abs(a - b).max()) for a, b in zip(grads["aot"], grads["composed"]))
            rows.append((name, shape, mode, *res["composed"], *res["aot"], diff))
            print(f"  done {name} {mode}", file=sys.stderr, flush=True)

    if rows:
        _print_aot_table(rows)
    if not args.ops or {"linear", "bmm"} & set(args.ops):
        _matmul_table(args, rng, modes)
    return 0


def _print_aot_table(rows):
    hdr = (
        "| op | shape | mode | composed fwd ms | AOT fwd ms | fwd speed-up | composed fwd+bwd ms "
        "| AOT fwd+bwd ms | fwd+bwd speed-up | max abs grad diff |"
    )
    print(hdr)
    print("|" + "---|" * 10)
    for name, shape, mode, cf, cb, af, ab, diff in rows:
        print(
            f"| {name} | {shape} | {mode} | {cf:.2f} | {af:.2f} | {cf / af:.1f}x | {cb:.2f} | {ab:.2f} "
            f"| {cb / ab:.1f}x | {diff:.1e} |"
        )


if __name__ == "__main__":
    sys.exit(main())
