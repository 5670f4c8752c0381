"""FSDP memory and speed on a ~50M-parameter Llama-style model (msrun, CPU).

For fsdp = 1 (one process), 2, 3, 4, plain dp = 2 and fsdp = 2 with reshard_after_forward false
("fsdp=2:keep") it reports, from rank 0 of each job: per-rank bytes of parameters + gradients +
AdamW moments (the sharded state each rank keeps; target: within 5% of total / N plus one
gathered unit), peak RSS of the process, the median step time (range over the jobs) and the
seconds per step FSDP spent blocked in its collectives; the last lines give each fsdp=2
variant's step time over dp=2's (target <= 1.15). dp=2 is the baseline, measured in the same
run; ``--repeat`` interleaves the jobs so that load from other processes hits every layout.

``python -m benchmarks.fsdp_memory [--steps 4] [--seq 256] [--mbs 1] [--repeat R]
[--layouts fsdp=2,dp=2]``. Each job trains the model for a few steps on the embedded corpus
(PyNative; FSDP needs it).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from benchmarks.harness import ROOT, model_55m

MODEL = model_55m() + ["--training.jit", "false",
         "--training.progress_bar", "false", "--training.output_dir", "/tmp/ms_llm_bench_fsdp"]


def worker(out: str, steps: int, overrides) -> None:
    from ms_llm.compat import setup_device
    setup_device("CPU")
    import numpy as np
    from ms_llm.config import load_config
    from ms_llm.parallel.placement import placement_of
    from ms_llm.parallel.runtime import init_distributed
    from ms_llm.training.metrics import peak_rss_gb
    from ms_llm.training.trainer import Trainer

    info = init_distributed()
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), MODEL + list(overrides))
    tr = Trainer(cfg, info)
    state_bytes = sum(int(np.prod(p.shape)) * 4 * 4 for p in tr.params)  # param, grad, m, v
    from ms_llm.parallel.fsdp.fully_shard import WAIT_SECONDS
    times, waits = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        for k in WAIT_SECONDS:
            WAIT_SECONDS[k] = 0.0
        tr.train_step()
        times.append(time.perf_counter() - t0)
        waits.append(sum(WAIT_SECONDS.values()))
    # Full (unsharded) sizes from each parameter's placement record; weight + grad + 2 moments.
    full = [int(np.prod(placement_of(p).global_shape or p.shape)) for p in tr.params]
    total_bytes = sum(full) * 4 * 4
    # The largest gathered weight (the embedding / output layer unit), fp32.
    unit = max(full) * 4
    if info.rank == 0:
        with open(out, "w") as f:
            json.dump({"state_bytes": state_bytes, "total_bytes": total_bytes,
                       "largest_param_bytes": unit, "peak_rss_gb": peak_rss_gb(),
                       "step_s": statistics.median(times[1:] or times),
                       "fsdp_wait_s": statistics.median(waits[1:] or waits)}, f)


def launch(nproc: int, overrides, steps: int) -> dict:
    out = f"/tmp/ms_llm_bench_fsdp_{nproc}_{abs(hash(tuple(overrides)))}.json"
    from benchmarks.harness import check, launch as launch_worker
    check(launch_worker(os.path.abspath(__file__), nproc, f"/tmp/ms_llm_bench_fsdp_logs_{nproc}",
                        ["--as-worker", out, "--steps", str(steps), "--", *overrides]),
          f"job nproc={nproc} {overrides}")
    with open(out) as f:
        return json.load(f)


# label -> (processes, overrides). "keep" = reshard_after_forward false.
LAYOUTS = {
    "fsdp=1": (1, []),
    "fsdp=2": (2, ["--parallel.fsdp_size", "2"]),
    "fsdp=3": (3, ["--parallel.fsdp_size", "3"]),
    "fsdp=4": (4, ["--parallel.fsdp_size", "4"]),
    "dp=2": (2, []),
    "fsdp=2:keep": (2, ["--parallel.fsdp_size", "2", "--parallel.reshard_after_forward", "false"]),
    # MixedPrecisionPolicy(param_dtype=bf16): half the all-gather bytes (numerics change: the
    # units compute with bf16-rounded weights, as torch FSDP2's bf16 policy does).
    "fsdp=2:bf16": (2, ["--parallel.fsdp_size", "2", "--parallel.fsdp_param_dtype", "bf16"]),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--mbs", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=1, help="jobs per layout (interleaved)")
    ap.add_argument("--layouts", default="fsdp=1,fsdp=2,fsdp=3,fsdp=4,dp=2,fsdp=2:keep",
                    help="comma-separated subset of: " + ", ".join(LAYOUTS))
    ap.add_argument("--as-worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("rest", nargs="*")
    args = ap.parse_args()
    if args.as_worker:
        worker(args.as_worker, args.steps, args.rest)
        return
    base = ["--data.seq_length", str(args.seq), "--training.micro_batch_size", str(args.mbs)]
    labels = args.layouts.split(",")
    for label in labels:
        if label not in LAYOUTS:
            raise SystemExit(f"--layouts: unknown layout {label!r}; choose from "
                             f"{', '.join(LAYOUTS)}")
    runs = {label: [] for label in labels}
    for _ in range(args.repeat):   # interleaved, so load changes hit every layout alike
        for label in labels:
            n, extra = LAYOUTS[label]
            gbs = ["--training.global_batch_size", str(args.mbs * n)]
            runs[label].append(launch(n, base + gbs + extra, args.steps))
    total = runs[labels[0]][0]["total_bytes"]
    print(f"\n~50M Llama, fp32 AdamW, seq {args.seq}, micro-batch {args.mbs} per rank, "
          f"median step of {args.steps} (first dropped), {args.repeat} job(s) per layout")
    print(f"{'layout':<12} {'state MB/rank':>14} {'total/N MB':>11} {'+1 unit MB':>11} "
          f"{'ratio':>6} {'peak RSS GB':>12} {'step s (min-max)':>18} {'FSDP wait s':>12}")
    step = {}
    for label in labels:
        n, r = LAYOUTS[label][0], runs[label][0]
        ideal = total / n if label.startswith("fsdp") else total
        bound = ideal + r["largest_param_bytes"]
        ts = [x["step_s"] for x in runs[label]]
        step[label] = (min(ts), statistics.median(ts), max(ts))
        rss = max(x["peak_rss_gb"] for x in runs[label])
        print(f"{label:<12} {r['state_bytes'] / 2**20:14.1f} {ideal / 2**20:11.1f} "
              f"{bound / 2**20:11.1f} {r['state_bytes'] / ideal:6.3f} {rss:12.2f} "
              f"{step[label][1]:7.2f} ({step[label][0]:.2f}-{step[label][2]:.2f}) "
              f"{statistics.median(x['fsdp_wait_s'] for x in runs[label]):12.2f}")
    if "dp=2" in step:
        d = step["dp=2"][1]
        for label in labels:
            if label.startswith("fsdp=2"):
                print(f"step time {label} / dp=2: {step[label][1] / d:.2f} (per-job medians; "
                      f"target <= 1.15)")

if __name__ == "__main__":
    main()
