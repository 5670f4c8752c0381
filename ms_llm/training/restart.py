"""Automatic restart: run a launch command, and after a failure relaunch it with
``--training.resume auto`` until it succeeds or ``max_restarts`` relaunches have failed.

``scripts/pretrain.sh`` launches through this module (with ``MAX_RESTARTS``, or the config's
``training.max_restarts``, of 0 it is one plain launch); the msrun command of each attempt comes
from :func:`ms_llm.launch.msrun.msrun_command`. The script's config check supplies N and
``checkpoint.save_dir``, so this loop imports no MindSpore until a relaunch reports its step::

    python -m ms_llm.training.restart --max-restarts N --save-dir SAVE_DIR \\
        --master-port P --log-dir D --worker-num W [--local-worker-num L --node-rank R \\
        --master-addr A --cluster-time-out T] -- ENTRY CONFIG [--section.key VALUE ...]

Relaunch k (1, 2, ...) uses master port ``P + k`` (the previous scheduler's port may still be in
TIME_WAIT, and every node derives the same port) and worker logs in ``D/restart_k`` (the failed
launch's logs stay where they were), and sets ``MS_LLM_RESTART_ATTEMPT=k`` so the fault-injection
test hooks (``ms_llm.training.faults``) fire on the first launch only. Each restart is logged with
the attempt number, the failed launch's exit code and the step it resumes from (the newest
complete checkpoint in ``checkpoint.save_dir``); after the last one the supervisor exits with the
last exit code. One node supervises its own launch: on several nodes, each node's supervisor
relaunches its part after the job failed everywhere (only the single-node case is tested).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from typing import Callable, List, Optional, Sequence

from ms_llm.launch.msrun import msrun_command

from .faults import ATTEMPT_ENV

PORT, LOG_DIR = "@PORT@", "@LOG_DIR@"


def say(msg: str) -> None:
    print(f"ms-llm restart: {msg}", file=sys.stderr, flush=True)


def resume_point(save_dir: Optional[str]) -> str:
    """Where a relaunch resumes: the newest complete checkpoint, or a fresh start."""
    from ms_llm.checkpoint.native.discovery import find_latest_complete, read_state
    path = find_latest_complete(save_dir, report=lambda m: say(m))
    if path is None:
        return f"step 0 (no complete checkpoint in {save_dir} yet: starting fresh)"
    return f"step {read_state(path)['step']} ({path})"


def attempt_log_dir(log_dir: str, attempt: int) -> str:
    return log_dir if attempt == 0 else os.path.join(log_dir, f"restart_{attempt}")


def launch_command(template: Sequence[str], attempt: int, port: int, log_dir: str) -> List[str]:
    """The command of launch ``attempt`` (0 = first): placeholders filled, and relaunches resume
    (a ``--training.resume`` of the template is replaced: a key given twice on the command line
    is refused)."""
    d = attempt_log_dir(log_dir, attempt)
    cmd = [a.replace(PORT, str(port + attempt)).replace(LOG_DIR, d) for a in template]
    if not attempt:
        return cmd
    out, i = [], 0
    while i < len(cmd):
        if cmd[i] == "--training.resume":
            i += 2
            continue
        if not cmd[i].startswith("--training.resume="):
            out.append(cmd[i])
        i += 1
    return out + ["--training.resume", "auto"]


def run_with_restarts(template: Sequence[str], max_restarts: int, save_dir: Optional[str],
                      port: int, log_dir: str,
                      run: Callable[[List[str], dict], int] = None) -> int:
    """Run ``template`` (with ``@PORT@``/``@LOG_DIR@``) until it exits 0 or ``max_restarts``
    relaunches have failed; returns the last exit code."""
    run = run or (lambda cmd, env: subprocess.call(cmd, env=env))
    rc = 0
    for attempt in range(max_restarts + 1):
        env = dict(os.environ, **{ATTEMPT_ENV: str(attempt)})
        cmd = launch_command(template, attempt, port, log_dir)
        if attempt:
            say(f"attempt {attempt + 1} (restart {attempt}/{max_restarts}) after exit code {rc}; "
                f"resuming from {resume_point(save_dir)}; worker logs in "
                f"{attempt_log_dir(log_dir, attempt)}")
        t0 = time.time()
        rc = run(cmd, env)
        if rc == 0:
            if attempt:
                say(f"attempt {attempt + 1} succeeded after {attempt} restart(s) "
                    f"({time.time() - t0:.1f} s)")
            return 0
        if max_restarts:
            say(f"attempt {attempt + 1} failed with exit code {rc} after "
                f"{time.time() - t0:.1f} s (at unix time {time.time():.3f})")
    if max_restarts:
        say(f"giving up after {max_restarts} restart(s); last exit code {rc}")
    return rc


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ms_llm.training.restart",
                                 description="relaunch a failed training job with resume=auto")
    ap.add_argument("--max-restarts", required=True,
                    help="relaunches after a failure (MAX_RESTARTS or training.max_restarts)")
    ap.add_argument("--save-dir", required=True,
                    help="the run's checkpoint.save_dir (where a relaunch resumes from)")
    ap.add_argument("--master-port", type=int, required=True)
    ap.add_argument("--log-dir", required=True)
    ap.add_argument("--worker-num", type=int, default=1, help="workers in the whole job")
    ap.add_argument("--local-worker-num", type=int, default=None,
                    help="workers on this node (default: all)")
    ap.add_argument("--node-rank", type=int, default=None)
    ap.add_argument("--master-addr", default=None)
    ap.add_argument("--cluster-time-out", type=int, default=120)
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- ENTRY CONFIG [overrides]")
    a = ap.parse_args(argv)
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not command:
        print("no training entry point after --", file=sys.stderr)
        return 2
    template = msrun_command(command[0], command[1:], worker_num=a.worker_num,
                             local_worker_num=a.local_worker_num, node_rank=a.node_rank,
                             master_addr=a.master_addr, master_port=PORT, log_dir=LOG_DIR,
                             cluster_time_out=a.cluster_time_out)
    if not a.max_restarts.isdigit():
        print(f"MAX_RESTARTS must be an integer >= 0, got {a.max_restarts!r}", file=sys.stderr)
        return 2
    n = int(a.max_restarts)
    if n and not a.save_dir:
        print("MAX_RESTARTS needs checkpoint.save_dir (a restart resumes from it)",
              file=sys.stderr)
        return 2
    return run_with_restarts(template, n, a.save_dir, a.master_port, a.log_dir)


if __name__ == "__main__":
    sys.exit(main())
