"""Output layer + cross entropy, forward and backward, at the ~55M model's shapes: the plain head
(``linear`` then ``cross_entropy``, whole [tokens, vocab] logits) against the chunked op of
``model.cross_entropy_loss_fusion`` (``ms_llm.ops.fused_cross_entropy``) at several chunk sizes.

Each variant runs in a fresh subprocess (MindSpore's CPU memory pool never shrinks, so peak RSS
is only meaningful per process); the table gives the median time of one forward+backward after
warm-up and the process's peak RSS above its post-import baseline. The rounds alternate the
variants (plain, chunked..., plain, chunked...) so a load change on a shared machine hits all.

``--clock cpu`` times with the process's CPU time instead of the wall clock (other processes'
load barely changes it; the children then run with ``MS_LLM_BLAS_THREADS=1`` so no idle BLAS
thread spins, and the seconds are one core's).

Usage: ``python -m benchmarks.fused_cross_entropy [--tokens 2048] [--reps 5] [--rounds 2]
[--chunks 256,512,1024] [--clock wall|cpu]``
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time

import numpy as np

from benchmarks.harness import run_module

H, VOCAB = 512, 32000


def rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 ** 2


def child(variant: str, tokens: int, reps: int, clock: str) -> None:
    now = time.process_time if clock == "cpu" else time.perf_counter
    from ms_llm.compat import setup_device
    setup_device("CPU")
    import mindspore as ms
    from mindspore import Parameter, Tensor
    from ms_llm.ops import cross_entropy, fused_linear_cross_entropy, linear
    from ms_llm.ops import resolve_paths
    resolve_paths()
    rng = np.random.default_rng(0)
    h = Tensor(rng.standard_normal((tokens, H)).astype(np.float32))
    w = Parameter(Tensor((rng.standard_normal((VOCAB, H)) * 0.02).astype(np.float32)), name="w")
    labels = Tensor(rng.integers(0, VOCAB, size=(tokens,)).astype(np.int32))
    base = rss_gb()
    chunk = None if variant == "plain" else int(variant)

    def loss_fn(x, y):
        if chunk is None:
            return cross_entropy(linear(x, w), y).sum()
        return fused_linear_cross_entropy(x, w, y, chunk_tokens=chunk).sum()
    grad_fn = ms.value_and_grad(loss_fn, grad_position=0, weights=[w])
    times = []
    for _ in range(reps + 1):
        t0 = now()
        loss, (dh, (dw,)) = grad_fn(h, labels)
        dw.asnumpy()
        dh.asnumpy()
        times.append(now() - t0)
    print(json.dumps({"variant": variant, "median_s": statistics.median(times[1:]),
                      "loss": float(loss.asnumpy()), "peak_rss_gb": rss_gb() - base}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--chunks", default="256,512,1024")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.tokens, args.reps, args.clock)
        return
    rows: dict = {}
    for _ in range(args.rounds):
        for v in ["plain"] + args.chunks.split(","):
            env = dict(os.environ, GLOG_v="3")
            if args.clock == "cpu":
                env["MS_LLM_BLAS_THREADS"] = "1"
            r = run_module("benchmarks.fused_cross_entropy", "--child", v, "--tokens",
                           args.tokens, "--reps", args.reps, "--clock", args.clock, env=env)
            lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
            if r.returncode != 0 or not lines:
                print(f"{v}: failed\n{r.stderr[-2000:]}")
                continue
            rows.setdefault(v, []).append(json.loads(lines[-1]))
    plain = statistics.median(x["median_s"] for x in rows.get("plain", [{"median_s": 0}]))
    print(f"\nforward+backward of the output layer + cross entropy, {args.tokens} tokens, hidden "
          f"{H}, vocab {VOCAB}, fp32, {args.clock} clock; median of {args.reps} reps per "
          f"process, {args.rounds} "
          f"process(es) per variant (range over processes)")
    print(f"| {'variant':<20} | {'time (s)':>16} | {'vs plain':>8} | {'peak RSS above import (GB)':>26} |")
    print(f"|{'-' * 22}|{'-' * 18}|{'-' * 10}|{'-' * 28}|")
    for v, rs in rows.items():
        ts = [x["median_s"] for x in rs]
        name = "plain head" if v == "plain" else f"chunked, {v} tokens"
        print(f"| {name:<20} | {statistics.median(ts):6.3f} [{min(ts):.2f}-{max(ts):.2f}] |"
              f" {statistics.median(ts) / plain if plain else float('nan'):7.2f}x |"
              f" {max(x['peak_rss_gb'] for x in rs):26.2f} |")


if __name__ == "__main__":
    main()
