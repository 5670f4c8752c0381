"""Run the planned jobs: one process (``python -m ms_llm.qualify.worker``) or one msrun launch
each, with a time-out; collect rank 0's results and the workers' logs."""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Dict, List

from ms_llm.launch.msrun import MsrunJob, free_port, launch_env, msrun_command

from .matrix import ROOT
from .plan import Job

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")


def job_env() -> dict:
    """The launch environment (:func:`ms_llm.launch.msrun.launch_env`)."""
    return launch_env()


def run_job(job: Job, work: str, timeout: float, say=print) -> Dict:
    """Run ``job``; return ``{"runs": {name: record}, "logs": [log text per rank], "rc",
    "seconds", "device"}``. A job that dies or times out gives every run without a record an
    error naming the exit."""
    jdir = os.path.join(work, "jobs", job.name)
    os.makedirs(jdir, exist_ok=True)
    results = os.path.join(jdir, "results.json")
    if os.path.exists(results):
        os.remove(results)
    spec = os.path.join(jdir, "job.json")
    with open(spec, "w", encoding="utf-8") as f:
        json.dump({"results": results, "runs": job.runs}, f, indent=1)
    t0 = time.time()
    say(f"ms-llm qualify: job {job.name}: {len(job.runs)} run(s) on {job.nproc} worker(s)")
    if job.nproc == 1:   # one plain process: its output is rank 0's log
        cmd, log_dir = [sys.executable, WORKER, spec], None   # MsrunJob reads jdir/worker_0.log
        output = os.path.join(jdir, "worker_0.log")
    else:
        log_dir = os.path.join(jdir, "msrun")
        cmd = msrun_command(WORKER, [spec], worker_num=job.nproc, master_port=free_port(),
                            log_dir=log_dir, cluster_time_out=120)
        output = os.path.join(jdir, "launcher.log")
    # a time-out kills the whole launch (its workers too)
    launch = MsrunJob(cmd, log_dir or jdir, job.nproc, env=job_env(), cwd=ROOT,
                      output=output).wait(timeout)
    rc = launch.returncode
    out = {"runs": {}, "logs": launch.logs, "rc": rc, "seconds": round(time.time() - t0, 1),
           "device": None}
    if os.path.exists(results):
        with open(results, encoding="utf-8") as f:
            res = json.load(f)
        out["runs"], out["device"] = res["runs"], res["device"]
    why = f"job {job.name} timed out after {timeout:.0f} s" if rc == "timeout" else \
        f"job {job.name} exited {rc} before recording this run"
    for run in job.runs:
        out["runs"].setdefault(run["name"], {"name": run["name"], "loss": [], "grad_norm": [],
                                             "error": why, "refused": False})
    say(f"ms-llm qualify: job {job.name}: exit {rc} in {out['seconds']} s")
    return out


def segment(log: str, name: str, head: int = 12, tail: int = 40) -> List[str]:
    """The lines of ``log`` between run ``name``'s begin and end markers (trimmed)."""
    begin, end = f"=== qualify run {name} begin ===", f"=== qualify run {name} end"
    lines = log.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.strip() == begin), None)
    if start is None:
        return []
    stop = next((i for i in range(start + 1, len(lines)) if lines[i].startswith(end)),
                len(lines) - 1)
    seg = lines[start:stop + 1]
    if len(seg) > head + tail + 1:
        seg = seg[:head] + [f"... ({len(seg) - head - tail} lines trimmed) ..."] + seg[-tail:]
    return seg
