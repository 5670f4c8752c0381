"""Run the planned jobs: one process (``python -m ms_llm.qualify.worker``) or one msrun launch
each, with a time-out; collect rank 0's results and the workers' logs."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from typing import Dict, List

from .matrix import ROOT
from .plan import Job

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_env() -> dict:
    env = dict(os.environ, GLOG_v=os.environ.get("GLOG_v", "3"), PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return env


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
    if job.nproc == 1:
        cmd = [sys.executable, WORKER, spec]
        log_files = [os.path.join(jdir, "worker_0.log")]
    else:
        cmd = ["msrun", "--worker_num", str(job.nproc), "--local_worker_num", str(job.nproc),
               "--master_port", str(free_port()), "--log_dir", os.path.join(jdir, "msrun"),
               "--join", "True", "--cluster_time_out", "120", WORKER, spec]
        log_files = [os.path.join(jdir, "msrun", f"worker_{i}.log") for i in range(job.nproc)]
    with open(os.path.join(jdir, "launcher.log"), "w") as out:
        try:
            rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=job_env(),
                                timeout=timeout, cwd=ROOT,
                                stdin=subprocess.DEVNULL).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    if job.nproc == 1:   # the single process's output is the launcher log
        os.replace(os.path.join(jdir, "launcher.log"), log_files[0])
    logs = []
    for p in log_files:
        try:
            with open(p, errors="replace") as f:
                logs.append(f.read())
        except OSError:
            logs.append("")
    out = {"runs": {}, "logs": logs, "rc": rc, "seconds": round(time.time() - t0, 1),
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
