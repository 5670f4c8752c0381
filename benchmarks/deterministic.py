"""What ``training.deterministic`` costs at dp=2 (msrun, CPU).

On CPU the mode changes one thing on the hot path: the data-parallel gradient all-reduce takes
the rank-ordered form (list ``all_gather`` + a sum in rank order; every rank receives W x N bytes
instead of a ring's 2(W-1)/W x N). ``mindspore.set_deterministic`` itself selects deterministic
Ascend kernels and HCCL's fixed order; it is not part of this CPU measurement.

So that load from other processes hits both sides alike (this machine is shared), one 2-worker
msrun job trains the default ``configs/tiny.yaml`` model (4 layers, hidden 256, fp32, PyNative)
and alternates the collective mode step by step on the same trainer (ABAB...), then times a
25 MB all-reduce (one ``parallel.ddp_bucket_mb`` bucket) both ways, interleaved. It prints the
medians, their ratios, the CPU model and the load average.

``python -m benchmarks.deterministic [--steps 12] [--reps 20]``
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from benchmarks.harness import ROOT, launch

RUN = ["--training.jit", "false", "--training.progress_bar", "false",
       "--training.micro_batch_size", "4", "--training.global_batch_size", "8",
       "--training.output_dir", "/tmp/ms_llm_bench_deterministic"]


def worker(out: str, steps: int, reps: int) -> None:
    from ms_llm.compat import setup_device
    setup_device("CPU")
    import numpy as np
    from mindspore import Tensor
    from ms_llm.config import load_config
    from ms_llm.parallel import comm
    from ms_llm.parallel.runtime import init_distributed
    from ms_llm.training.trainer import Trainer
    info = init_distributed()
    tr = Trainer(load_config(os.path.join(ROOT, "configs", "tiny.yaml"), RUN), info)
    tr.train_step()      # warm-up: kernels chosen, buffers allocated
    step = {False: [], True: []}
    for k in range(steps):
        det = k % 2 == 1
        comm.set_deterministic(det)
        t0 = time.perf_counter()
        tr.train_step()
        step[det].append(time.perf_counter() - t0)
    buf = Tensor(np.random.default_rng(info.rank).standard_normal(25 * 2 ** 18)
                 .astype(np.float32))       # 25 MB
    coll = {False: [], True: []}
    for k in range(2 * reps):
        det = k % 2 == 1
        comm.set_deterministic(det)
        t = buf.copy()
        t0 = time.perf_counter()
        comm.all_reduce(t)
        t.asnumpy()
        coll[det].append(time.perf_counter() - t0)
    comm.set_deterministic(False)
    if info.rank == 0:
        with open(out, "w") as f:
            json.dump({"step": {str(k): v for k, v in step.items()},
                       "allreduce": {str(k): v for k, v in coll.items()},
                       "params": tr.model.num_parameters()}, f)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "worker":   # ("--worker" is msrun's own prefix)
        worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    out = "/tmp/ms_llm_bench_deterministic.json"
    if os.path.exists(out):
        os.remove(out)
    load0 = os.getloadavg()[0]
    r = launch(os.path.abspath(__file__), 2, "/tmp/ms_llm_bench_det_logs",
               ["worker", out, str(a.steps), str(a.reps)], cluster_time_out=120, timeout=3600)
    if not r.ok or not os.path.exists(out):
        raise SystemExit(f"msrun job failed ({r.returncode}); logs in /tmp/ms_llm_bench_det_logs")
    with open(out) as f:
        res = json.load(f)
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                if ln.startswith("model name")), "?")
    print(f"CPU: {cpu}; load average {load0:.1f} at start, {os.getloadavg()[0]:.1f} at end "
          f"(a shared machine: figures are noisy)")
    for key, label, unit in (("step", f"train step ({res['params'] / 1e6:.1f} M params, dp=2)",
                              1000.0), ("allreduce", "25 MB all_reduce (dp=2)", 1000.0)):
        off, on = (statistics.median(res[key][k]) for k in ("False", "True"))
        print(f"{label}: default {off * unit:.1f} ms, deterministic {on * unit:.1f} ms "
              f"= {on / off:.3f}x  (medians of {len(res[key]['False'])} interleaved runs each)")


if __name__ == "__main__":
    main()
