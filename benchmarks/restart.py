"""What a worker failure costs: ``python -m benchmarks.restart [--nproc 2] [--steps 6]``.

Runs ``scripts/pretrain.sh`` (small model, PyNative, checkpoint every 2 steps) once uninterrupted
and once with ``MS_LLM_FAULT_INJECT=4:1 MAX_RESTARTS=1`` for each ``MS_NODE_TIMEOUT`` asked for
(empty: MindSpore's default), and prints a table: the job's wall time, the time from the
SIGKILL to the failed launch's exit (msrun kills the other workers within ~1 s, then waits for its
scheduler to declare the node lost), the relaunch's wall time (start-up, resume, the replayed and
remaining steps) and the total overhead against the uninterrupted run.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

from benchmarks.harness import ROOT, TINY_MODEL, free_port, machine

SMALL = TINY_MODEL + ["--training.micro_batch_size", "4", "--training.global_batch_size", "8",
                      "--training.log_interval", "1", "--training.jit", "false",
                      "--training.progress_bar", "false", "--training.lr_warmup_steps", "2",
                      "--checkpoint.save_interval", "2"]


def run(tmp: str, name: str, nproc: int, steps: int, fault: bool, node_timeout: str) -> dict:
    d = os.path.join(tmp, name)
    env = dict(os.environ, MASTER_PORT=str(free_port()), LOG_DIR=os.path.join(d, "logs"),
               NPROC=str(nproc), CLUSTER_TIME_OUT="120")
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    for k in ("MS_LLM_FAULT_INJECT", "MAX_RESTARTS", "MS_NODE_TIMEOUT", "MS_LLM_NAN_INJECT"):
        env.pop(k, None)
    if fault:
        env.update(MS_LLM_FAULT_INJECT="4:1", MAX_RESTARTS="1")
    if node_timeout:
        env["MS_NODE_TIMEOUT"] = node_timeout
    t0 = time.time()
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "pretrain.sh"),
                        os.path.join(ROOT, "configs", "tiny.yaml"), *SMALL,
                        "--training.max_steps", str(steps),
                        "--training.output_dir", os.path.join(d, "out"),
                        "--checkpoint.save_dir", os.path.join(d, "ckpt")],
                       capture_output=True, text=True, env=env, cwd=tmp)
    out = {"wall": time.time() - t0, "rc": r.returncode}
    if fault and r.returncode == 0:
        log = open(os.path.join(d, "logs", "worker_1.log"), errors="replace").read()
        killed = float(re.search(r"SIGKILLs itself .*?at unix time ([0-9.]+)", log).group(1))
        failed = float(re.search(r"attempt 1 failed .*?at unix time ([0-9.]+)", r.stderr).group(1))
        out["kill_to_exit"] = failed - killed
        out["relaunch"] = float(re.search(r"attempt 2 succeeded .*?\(([0-9.]+) s\)",
                                          r.stderr).group(1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--node-timeouts", default=",15",
                    help="MS_NODE_TIMEOUT values (empty: default)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = run(tmp, "plain", a.nproc, a.steps, False, "")
        rows = [("uninterrupted", "", base)]
        for nt in a.node_timeouts.split(","):
            rows.append(("kill rank 1 in step 4", nt or "default",
                         run(tmp, f"fault{nt}", a.nproc, a.steps, True, nt)))
    print(f"\n{a.nproc} workers, {a.steps} steps, checkpoint every 2 ({machine()})")
    print("| run | MS_NODE_TIMEOUT | exit | wall (s) | kill -> exit (s) | relaunch (s) | "
          "overhead (s) |")
    print("|---|---|---|---|---|---|---|")
    for name, nt, r in rows:
        extra = (f"{r['kill_to_exit']:.1f} | {r['relaunch']:.1f} | {r['wall'] - base['wall']:.1f}"
                 if "relaunch" in r else "- | - | -")
        print(f"| {name} | {nt or '-'} | {r['rc']} | {r['wall']:.1f} | {extra} |")


if __name__ == "__main__":
    main()
