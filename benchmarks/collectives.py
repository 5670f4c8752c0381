"""Bandwidth of ms_llm.parallel.comm's collectives against MindSpore's raw primitives (msrun).

``python -m benchmarks.collectives [--nproc 2] [--sizes 4,64]`` launches itself under msrun. For
each size (MiB of the full, gathered tensor) rank 0 prints, per op, the median time, the algorithm
bandwidth (bytes of the full tensor / time) and the ratio against the raw MindSpore call the CPU
composition is built on (on CPU there is no native all_gather_into_tensor, reduce_scatter_tensor or
all_to_all_single kernel, so the baseline is the primitive that moves the same data):

* all_gather_into_tensor vs raw list ``all_gather`` (+ our ``cat``)
* reduce_scatter_tensor vs raw ``all_reduce`` of the full tensor (the bandwidth it must beat)
* the two CPU reduce-scatter compositions against each other: one ``scatter`` per root + local
  sum ((W-1)/W x N bytes sent per rank) vs ``all_reduce`` + narrow (2(W-1)/W x N); the faster
  one is ``comm.cpu_compose.CPU_REDUCE_SCATTER``
* all_to_all_single (scatter per root) vs raw list ``all_gather`` of the full input (the
  gather-and-select composition it replaces, which moves (W-1)x more bytes)
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

def worker(sizes, repeat: int) -> None:
    from ms_llm.compat import setup_device
    setup_device("CPU")
    import numpy as np
    import mindspore as ms
    import mindspore.mint.distributed as raw
    from mindspore import Tensor, mint
    from ms_llm.parallel import comm
    from ms_llm.parallel.comm import cpu_compose
    from ms_llm.parallel.runtime import init_distributed

    info = init_distributed()
    w, r = info.world_size, info.rank
    world = comm.world_group()

    def timed(fn):
        fn()
        ts = []
        for _ in range(repeat):
            comm.barrier()
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    rows = []
    for mib in sizes:
        n = mib * 2 ** 20 // 4 // w * w            # elements of the full tensor
        full = Tensor(np.random.rand(n).astype(np.float32))
        shard = Tensor(np.random.rand(n // w).astype(np.float32))
        out_full = mint.zeros((n,), dtype=ms.float32)
        out_shard = mint.zeros((n // w,), dtype=ms.float32)
        parts = [mint.zeros((n // w,), dtype=ms.float32) for _ in range(w)]
        cases = [
            ("all_gather_into_tensor", lambda: comm.all_gather_into_tensor(out_full, shard),
             "list all_gather", lambda: raw.all_gather(parts, shard)),
            ("reduce_scatter_tensor", lambda: comm.reduce_scatter_tensor(out_shard, full),
             "all_reduce", lambda: raw.all_reduce(full.copy())),
            ("rs by scatter", lambda: cpu_compose.reduce_scatter_by_scatter(
                out_shard, full, "sum", world, False),
             "rs by all_reduce", lambda: cpu_compose.reduce_scatter_by_all_reduce(
                 out_shard, full, "sum", world, False)),
            ("all_to_all_single", lambda: comm.all_to_all_single(out_full, full),
             "all_gather of input", lambda: raw.all_gather(
                 [mint.zeros((n,), dtype=ms.float32) for _ in range(w)], full)),
        ]
        for name, fn, base_name, base in cases:
            t, tb = timed(fn), timed(base)
            rows.append((mib, name, t, mib / 1024 / t, base_name, tb, tb / t))
    if r == 0:
        print(f"\n{w} ranks, fp32, median of {repeat}; GB/s = full-tensor bytes / time")
        print(f"{'MiB':>4} {'op':<24} {'ms':>8} {'GB/s':>7}   {'baseline':<22} {'ms':>8} "
              f"{'baseline/ours':>13}")
        for mib, name, t, bw, bname, tb, ratio in rows:
            print(f"{mib:>4} {name:<24} {t * 1e3:8.1f} {bw:7.2f}   {bname:<22} {tb * 1e3:8.1f} "
                  f"{ratio:13.2f}")
        sys.stdout.flush()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--sizes", default="4,64")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--as-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.as_worker:
        worker(sizes, args.repeat)
        return
    from benchmarks.harness import launch, machine
    r = launch(os.path.abspath(__file__), args.nproc, "/tmp/ms_llm_bench_collectives",
               ["--as-worker", "--sizes", args.sizes, "--repeat", str(args.repeat)],
               cluster_time_out=60)
    if not r.logs[0]:
        sys.exit(f"msrun failed to start:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    print(f"# {machine()} (figures are noisy on a shared machine)")
    log = r.logs[0]
    table = log[log.find("\n" + str(args.nproc) + " ranks"):] if "ranks, fp32" in log else log[-3000:]
    print("\n".join(line for line in table.splitlines() if not line.startswith("[")))
    sys.exit(0 if r.ok else 1)


if __name__ == "__main__":
    main()
