"""Criterion (d): a worker killed mid-step makes the job exit non-zero within the time-out, and
the automatic restart continues the uninterrupted curve from the last checkpoint.

Runs the user's path, ``scripts/pretrain.sh``, twice at the cell's layout with
``MS_LLM_FAULT_INJECT=STEP:RANK`` (the last rank SIGKILLs itself in the middle of the last-but-one step,
first launch only; checkpoints every 2 steps): with ``MAX_RESTARTS=0`` the job must exit
non-zero, with ``MAX_RESTARTS=1`` it must exit 0 and ``metrics.jsonl`` (restarted steps are
appended) must give the uninterrupted run's curve. Needs automatic restart
(``criteria.restart_built``); until then the criterion reports "not built"."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from typing import Dict, List

from ms_llm.launch import free_port

from .criteria import Check, compare, restart_built
from .matrix import ROOT, Cell
from .runner import job_env

SAVE_INTERVAL = 2


def _launch(cell: Cell, config: str, args: List[str], work: str, restarts: int,
            timeout: float, fault_step: int) -> tuple:
    out = os.path.join(work, f"restarts{restarts}")
    shutil.rmtree(out, ignore_errors=True)
    env = job_env()
    env.update(MS_LLM_FAULT_INJECT=f"{fault_step}:{cell.feature.nproc - 1}",
               MAX_RESTARTS=str(restarts), NPROC=str(cell.feature.nproc),
               MASTER_PORT=str(free_port()), LOG_DIR=os.path.join(out, "msrun"),
               CLUSTER_TIME_OUT="60")
    cmd = ["bash", os.path.join(ROOT, "scripts", "pretrain.sh"), config, *args,
           "--training.output_dir", out, "--checkpoint.save_dir", os.path.join(out, "ckpt"),
           "--checkpoint.save_interval", str(SAVE_INTERVAL)]
    t0 = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout,
                           cwd=ROOT)
        rc, text = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc, text = "timeout", str(e.stdout or "") + str(e.stderr or "")
    return rc, text, time.time() - t0, out


def check_fault(cell: Cell, config: str, layout_args: List[str], uninterrupted: Dict,
                work: str, timeout: float, log: list, steps: int) -> Check:
    fault_step = steps - 1
    missing = restart_built()
    if missing:
        return Check("unmet", missing)
    if uninterrupted["error"]:
        return Check("unmet", "no uninterrupted run to compare with")
    rc0, text, sec, _ = _launch(cell, config, layout_args, work, 0, timeout, fault_step)
    log += [f"--- fault injected, MAX_RESTARTS=0: exit {rc0} after {sec:.0f} s", text[-3000:]]
    if rc0 == 0 or rc0 == "timeout":
        return Check("fail", f"killed worker: job {'timed out' if rc0 else 'exited 0'} "
                             f"(want a non-zero exit within {timeout:.0f} s)")
    rc, text, sec1, out = _launch(cell, config, layout_args, work, 1, timeout, fault_step)
    log += [f"--- fault injected, MAX_RESTARTS=1: exit {rc} after {sec1:.0f} s", text[-3000:]]
    if rc != 0:
        return Check("fail", f"automatic restart: exit {rc}")
    last = {}
    with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            if "loss" in r and "step" in r:
                last[int(r["step"])] = r          # a restarted step's record comes later
    logged = sorted(last)
    if logged != list(range(1, steps + 1)):
        return Check("fail", f"metrics.jsonl steps after restart: {logged}")
    got = {"loss": [last[s]["loss"] for s in logged],
           "grad_norm": [last[s]["grad_norm"] for s in logged]}
    why = compare(got, uninterrupted, cell.feature.tol(cell.family))
    if why:
        return Check("fail", f"restarted curve: {why}")
    return Check("ok", f"rank {cell.feature.nproc - 1} killed in step {fault_step}: exit {rc0} "
                       f"after {sec:.0f} s without restart; with MAX_RESTARTS=1 exit 0, resumed "
                       f"from its last checkpoint and matched the uninterrupted curve")
