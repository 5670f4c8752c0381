"""Distributed optimizer vs plain data parallel at dp=2 (msrun, CPU): per-rank optimizer bytes and
step time.

For each layout (``dp=2`` plain AdamW, ``dp=2:distopt`` with ``parallel.use_distributed_optimizer``)
one msrun job trains the ~50M Llama-style model of ``fsdp_memory.py`` for a few steps and reports
from every rank: the optimizer's state bytes (AdamW moments + fp32 main-parameter shards, from
``optimizer.state_bytes()``, the figure the trainer logs at start), the ideal total / dp, the
median step time (first step dropped) and the peak RSS. The last line gives the step-time ratio.
``--repeat`` interleaves the jobs so load from other processes hits both layouts.

``python -m benchmarks.distributed_optimizer [--steps 4] [--seq 256] [--mbs 1] [--repeat R]
[--small]``. Importable: ``run_layout(label, steps, seq, mbs)`` returns the per-rank figures
(``benchmarks/memory.py`` may call it).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from benchmarks.harness import ROOT, TINY_MODEL, model_55m

MODEL = model_55m() + ["--training.jit", "false",
         "--training.progress_bar", "false", "--training.output_dir", "/tmp/ms_llm_bench_distopt"]
# --small: a 2-layer model for a quick check of the script itself
SMALL = TINY_MODEL + ["--training.jit", "false", "--training.progress_bar", "false",
                      "--training.output_dir", "/tmp/ms_llm_bench_distopt"]   # seq: run_layout's

LAYOUTS = {"dp=2": [], "dp=2:distopt": ["--parallel.use_distributed_optimizer", "true"]}


def worker(out: str, steps: int, overrides) -> None:
    from ms_llm.compat import setup_device
    setup_device("CPU")
    import numpy as np
    from ms_llm.config import load_config
    from ms_llm.parallel.distributed_optimizer import bytes_per_rank
    from ms_llm.parallel.placement import placement_of
    from ms_llm.parallel.runtime import init_distributed
    from ms_llm.training.metrics import peak_rss_gb
    from ms_llm.training.trainer import Trainer

    info = init_distributed()
    tr = Trainer(load_config(os.path.join(ROOT, "configs", "tiny.yaml"), list(overrides)), info)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        tr.train_step()
        times.append(time.perf_counter() - t0)
    full = sum(int(np.prod(placement_of(p).global_shape or p.shape)) for p in tr.params)
    rss = bytes_per_rank(int(peak_rss_gb() * 2 ** 30))
    if info.rank == 0:
        with open(out, "w") as f:
            json.dump({"optimizer_bytes": tr.optimizer_bytes,
                       "state": tr.optimizer.state_bytes(),
                       "adamw_total_bytes": full * 4 * 2, "dp": tr.dp_group.size,
                       "peak_rss_gb": [r / 2 ** 30 for r in rss],
                       "step_s": statistics.median(times[1:] or times)}, f)


def run_layout(label: str, steps: int = 4, seq: int = 256, mbs: int = 1,
               small: bool = False) -> dict:
    """One msrun job of ``label`` (a key of ``LAYOUTS``) on 2 workers; rank 0's figures."""
    from benchmarks.harness import check, launch
    overrides = (SMALL if small else MODEL) + [
        "--data.seq_length", str(seq), "--training.micro_batch_size", str(mbs),
        "--training.global_batch_size", str(2 * mbs)] + LAYOUTS[label]
    out = f"/tmp/ms_llm_bench_distopt_{label.replace(':', '_').replace('=', '')}.json"
    if os.path.exists(out):
        os.remove(out)
    check(launch(os.path.abspath(__file__), 2, "/tmp/ms_llm_bench_distopt_logs",
                 ["--as-worker", out, "--steps", str(steps), "--", *overrides],
                 cluster_time_out=60), f"job {label}")
    with open(out) as f:
        return json.load(f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--mbs", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=1, help="jobs per layout (interleaved)")
    ap.add_argument("--small", action="store_true", help="2-layer model (checks the script)")
    ap.add_argument("--as-worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("rest", nargs="*")
    args = ap.parse_args()
    if args.as_worker:
        worker(args.as_worker, args.steps, args.rest)
        return
    runs = {label: [] for label in LAYOUTS}
    for _ in range(args.repeat):
        for label in LAYOUTS:
            runs[label].append(run_layout(label, args.steps, args.seq, args.mbs, args.small))
    print(f"\n{'~50M' if not args.small else 'small'} Llama, fp32, seq {args.seq}, micro-batch "
          f"{args.mbs} per rank, median step of {args.steps} (first dropped), {args.repeat} "
          f"job(s) per layout")
    print(f"{'layout':<14} {'optimizer MiB/rank':>24} {'AdamW total/dp MiB':>19} "
          f"{'peak RSS GB/rank':>17} {'step s (min-max)':>18}")
    med = {}
    for label, rs in runs.items():
        r = rs[0]
        ideal = r["adamw_total_bytes"] * 1.5 / r["dp"]   # moments + fp32 main params, / dp
        ts = [x["step_s"] for x in rs]
        med[label] = statistics.median(ts)
        per_rank = ", ".join(f"{b / 2 ** 20:.1f}" for b in r["optimizer_bytes"])
        rss = ", ".join(f"{g:.2f}" for g in r["peak_rss_gb"])
        print(f"{label:<14} {per_rank:>24} {ideal / 2 ** 20:19.1f} {rss:>17} "
              f"{med[label]:7.2f} ({min(ts):.2f}-{max(ts):.2f})")
    print("(plain AdamW's main params are the model's own; its optimizer bytes are the moments)")
    print(f"step time dp=2:distopt / dp=2: {med['dp=2:distopt'] / med['dp=2']:.2f}")


if __name__ == "__main__":
    main()
