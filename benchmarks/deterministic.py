"""What ``training.deterministic`` costs at dp=2 (msrun, CPU): median step time with and without.

One msrun job per run trains the default ``configs/tiny.yaml`` model (4 layers, hidden 256,
fp32, PyNative) for a few steps on 2 workers; jobs alternate off / on ``--repeat`` times so
load from other processes hits both, and the last line gives the ratio of the medians. On CPU
the difference is the data-parallel all-reduce taking the rank-ordered form (list all_gather +
sum in rank order: every rank receives W x N bytes instead of a ring's 2(W-1)/W x N) and
MindSpore's deterministic switch. Prints the CPU model and the load average with the figures:
on a shared machine they are noisy.

``python benchmarks/deterministic.py [--steps 6] [--repeat 2]``
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = ["--training.jit", "false", "--training.progress_bar", "false",
       "--training.micro_batch_size", "4", "--training.global_batch_size", "8",
       "--training.output_dir", "/tmp/ms_llm_bench_deterministic"]


def worker(out: str, steps: int, deterministic: str) -> None:
    sys.path.insert(0, ROOT)
    from ms_llm.compat import setup_device
    setup_device("CPU")
    from ms_llm.config import load_config
    from ms_llm.parallel.runtime import init_distributed
    from ms_llm.training.trainer import Trainer
    info = init_distributed()
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"),
                      RUN + ["--training.deterministic", deterministic])
    tr = Trainer(cfg, info)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        tr.train_step()
        times.append(time.perf_counter() - t0)
    if info.rank == 0:
        with open(out, "w") as f:
            json.dump({"step_s": statistics.median(times[1:] or times), "times": times}, f)


def run_job(deterministic: bool, steps: int) -> float:
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from msrun_util import msrun_command
    flag = "true" if deterministic else "false"
    out = f"/tmp/ms_llm_bench_deterministic_{flag}.json"
    if os.path.exists(out):
        os.remove(out)
    cmd, env = msrun_command(os.path.abspath(__file__), 2, f"/tmp/ms_llm_bench_det_logs_{flag}",
                             ["worker", out, str(steps), flag], cluster_time_out=120)
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if r.returncode != 0 or not os.path.exists(out):
        raise SystemExit(f"msrun job (deterministic={flag}) failed: {r.stdout[-2000:]}")
    with open(out) as f:
        return json.load(f)["step_s"]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "worker":   # (msrun would take "--worker" as its own flag)
        worker(sys.argv[2], int(sys.argv[3]), sys.argv[4])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeat", type=int, default=2)
    a = ap.parse_args()
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                if ln.startswith("model name")), "?")
    times = {False: [], True: []}
    for _ in range(a.repeat):
        for det in (False, True):
            load = os.getloadavg()[0]
            s = run_job(det, a.steps)
            times[det].append(s)
            print(f"deterministic={det!s:5}  median step {s * 1000:8.1f} ms  "
                  f"(load avg {load:.1f})", flush=True)
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(f"CPU: {cpu}; load avg now {os.getloadavg()[0]:.1f}")
    print(f"training.deterministic at dp=2: {on * 1000:.1f} ms vs {off * 1000:.1f} ms per step "
          f"= {on / off:.3f}x (medians of {a.repeat} jobs each, {a.steps} steps, first dropped)")


if __name__ == "__main__":
    main()
