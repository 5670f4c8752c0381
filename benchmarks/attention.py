"""Causal attention on CPU: the masked full product (BLAS bmm -> AOT causal softmax -> bmm, the
kernel path before the block-skipping kernel) against ``cpu_kernels.causal_attention`` (query
blocks multiply only the keys they see), forward + backward, at the ~55M model's attention shape
(batch 4, 8 query heads in 2 KV groups, head dim 64) for several sequence lengths.

    python -m benchmarks.attention [--seq 512 1024 2048] [--repeat 5] [--threads N]

Timing: min and median wall time of fwd+bwd (GradOperation with a fixed output gradient) over
--repeat calls after one warm-up, both forms alternating in the same process. The last column is
the largest difference between the two forms' gradients relative to the largest gradient.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np


import mindspore as ms
from mindspore import Tensor, ops

ms.set_device("CPU")

from ms_llm.ops import cpu_kernels as ck  # noqa: E402


def full_product(q, k, v, scale):
    """The former kernel path: every score computed, half masked away by the softmax."""
    lead, rs, s = tuple(q.shape[:-2]), q.shape[-2], k.shape[-2]
    scores = ck.bmm(q, k, transpose_b=True).reshape(lead + (rs // s, s, s))
    probs = ck.causal_softmax(scores, scale).reshape(lead + (rs, s))
    return ck.bmm(probs, v)


def blocked(q, k, v, scale):
    return ck.causal_attention(q, k, v, scale)


def fwd_bwd(attention, dout):
    grad = ops.GradOperation(get_all=True, sens_param=True)(lambda q, k, v: attention(q, k, v, 0.125))
    return lambda q, k, v: grad(q, k, v, dout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="OpenBLAS threads (default: kernels')")
    args = ap.parse_args()
    if not (ck.available() and ck.blas_available()):
        sys.exit(f"benchmarks/attention.py: the AOT/BLAS kernels are unavailable: "
                 f"{ck.reason() or ck.blas_reason()}")
    if args.threads:
        ck.set_blas_threads(args.threads)
    b, g, r, d = 4, 2, 4, 64
    rng = np.random.default_rng(0)
    print(f"OpenBLAS threads {ck.blas_threads()}, batch {b}, {g * r} query heads / {g} KV groups, "
          f"head dim {d}\n")
    print("| seq | full product fwd+bwd ms (min / median) | blocked fwd+bwd ms (min / median) "
          "| speed-up (min) | max rel grad diff |")
    print("|---|---|---|---|---|")
    for s in args.seq:
        q, dout = (Tensor(rng.standard_normal((b, g, r * s, d)).astype(np.float32)) for _ in "ab")
        k, v = (Tensor(rng.standard_normal((b, g, s, d)).astype(np.float32)) for _ in "ab")
        fns = {"full": fwd_bwd(full_product, dout), "blocked": fwd_bwd(blocked, dout)}
        times = {name: [] for name in fns}
        grads = {name: [t.asnumpy() for t in fn(q, k, v)] for name, fn in fns.items()}  # warm-up
        for _ in range(args.repeat):
            for name, fn in fns.items():
                t0 = time.perf_counter()
                fn(q, k, v)[0].asnumpy()
                times[name].append((time.perf_counter() - t0) * 1e3)
        rel = max(float(np.abs(a - c).max() / np.abs(c).max())
                  for a, c in zip(grads["blocked"], grads["full"]))
        f, bl = times["full"], times["blocked"]
        print(f"| {s} | {min(f):.0f} / {statistics.median(f):.0f} | {min(bl):.0f} / "
              f"{statistics.median(bl):.0f} | {min(f) / min(bl):.2f}x | {rel:.1e} |", flush=True)


if __name__ == "__main__":
    main()
