"""Composed MindSpore ops vs the AOT C++ CPU kernels (ms_llm.ops.cpu_kernels), forward and fwd+bwd,
in PyNative and under mindspore.jit, at the 50M-model shapes.

    python benchmarks/ops.py                  # all ops, MindSpore threads_num(1), kernels' default threads
    python benchmarks/ops.py --ops rms_norm cross_entropy --repeat 20 --ms-threads 2

Timing: median (or --stat min) wall time over --repeat calls after --warmup calls. fwd+bwd runs
GradOperation(get_all=True, sens_param=True) with a fixed random output gradient, so it times the op's
forward and backward only (no extra loss reduction). Every timed call ends by reading one element of
the result back (.asnumpy()), which waits for the queued work. The last column is max|AOT - composed|
over the fwd+bwd gradients, as a sanity check.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import mindspore as ms  # noqa: E402
from mindspore import Tensor, ops  # noqa: E402


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
    from ms_llm.ops.cpu_kernels import composed

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
    for name, shape, make, make_args in _cases(rng):
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
