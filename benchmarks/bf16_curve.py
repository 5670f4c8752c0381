"""bf16 vs fp32 loss curve of the default config (issue #19's acceptance: within 2% of fp32 at
every logged step after step 50, over 200 steps).

Runs the real command twice, at the same time (``ms-llm train configs/tiny.yaml``, then the same
with ``--training.bf16 true``), reads each run's ``metrics.jsonl`` and prints a table of the
logged losses, their relative deviation and the verdict.

    python -m benchmarks.bf16_curve [--steps 200] [--out /tmp/ms_llm_bf16_curve] [--every 10]
    python -m benchmarks.bf16_curve --table-only --out DIR     # re-read finished runs
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from benchmarks.harness import ROOT

CONFIG = os.path.join(ROOT, "configs", "tiny.yaml")


def losses(run_dir: str) -> dict:
    out = {}
    path = os.path.join(run_dir, "metrics.jsonl")
    if os.path.isfile(path):
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                if "loss" in rec:
                    out[int(rec["step"])] = float(rec["loss"])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--after", type=int, default=50, help="check steps after this one")
    ap.add_argument("--limit", type=float, default=0.02, help="allowed relative deviation")
    ap.add_argument("--every", type=int, default=10, help="print every N-th logged step")
    ap.add_argument("--out", default="/tmp/ms_llm_bf16_curve")
    ap.add_argument("--table-only", action="store_true")
    args = ap.parse_args()
    runs = {"fp32": [], "bf16": ["--training.bf16", "true"]}
    if not args.table_only:
        procs = {}
        for name, extra in runs.items():
            d = os.path.join(args.out, name)
            os.makedirs(d, exist_ok=True)
            cmd = [sys.executable, "-m", "ms_llm.cli", "train", CONFIG, "--training.max_steps",
                   str(args.steps), "--training.output_dir", d, "--training.progress_bar",
                   "false", *extra]
            procs[name] = (subprocess.Popen(cmd, stdout=open(os.path.join(d, "stdout.log"), "w"),
                                            stderr=subprocess.STDOUT), time.time())
        for name, (p, t0) in procs.items():
            if p.wait() != 0:
                print(f"{name} run failed, see {args.out}/{name}/stdout.log", file=sys.stderr)
                return 1
            print(f"{name}: {time.time() - t0:.0f} s wall", flush=True)
    a, b = losses(os.path.join(args.out, "fp32")), losses(os.path.join(args.out, "bf16"))
    steps = sorted(set(a) & set(b))
    if not steps:
        print("no common logged steps yet")
        return 1
    print(f"| step | fp32 loss | bf16 loss | rel. deviation |\n|---:|---:|---:|---:|")
    worst, worst_step = 0.0, None
    for s in steps:
        dev = abs(b[s] - a[s]) / abs(a[s])
        if s > args.after and dev > worst:
            worst, worst_step = dev, s
        if s % args.every == 0 or s == steps[-1]:
            print(f"| {s} | {a[s]:.4f} | {b[s]:.4f} | {100 * dev:.2f}% |")
    ok = worst <= args.limit
    last_dev = abs(b[steps[-1]] - a[steps[-1]]) / abs(a[steps[-1]])
    if worst_step is None:   # the runs stopped (or were stopped) before step --after
        print(f"\nsteps compared: {len(steps)} (last {steps[-1]}, deviation there "
              f"{100 * last_dev:.2f}%); no logged step after {args.after} yet -> INCOMPLETE")
        return 1
    print(f"\nsteps compared: {len(steps)} (last {steps[-1]}); max deviation after step "
          f"{args.after}: {100 * worst:.2f}% at step {worst_step} -> "
          f"{'PASS' if ok else 'FAIL'} (limit {100 * args.limit:.0f}%)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
