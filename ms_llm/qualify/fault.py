"""Criterion (d): a worker killed mid-step makes the job exit non-zero within the time-out, and
the automatic restart continues the uninterrupted curve from the last checkpoint.

Why one launch per family and worker count (instead of two ``pretrain.sh`` launches per cell):
a launch costs ~15-20 s of start-up here, and (d) ran three of them per cell (a launch without
restart, then a launch and its relaunch), so the full table skipped it. Now every cell of a
family with the same worker count is one run of one qualify job (``worker.py``), and that job
runs under the restart supervisor ``scripts/pretrain.sh`` uses (``ms_llm.training.restart``)
with ``--max-restarts`` = the number of cells:

* each run checkpoints every 2 steps and has ``MS_LLM_FAULT_INJECT=STEP:LAST_RANK`` armed on its
  first attempt only (``worker.arm_fault``: a per-rank marker in its output folder), so the
  last rank SIGKILLs itself in step STEP (the last-but-one) of every cell once;
* the kill ends the launch with a non-zero exit (the supervisor logs each failed attempt's exit
  code and duration: the time-out half of (d)), and the relaunch skips the runs already
  recorded and resumes the killed one with ``training.resume auto``;
* per cell, (d) holds when the run's relaunch trained only the steps after its last checkpoint
  and ``metrics.jsonl`` (restarted steps appended) gives the uninterrupted curve.

A family's fault launch thus costs one launch per cell plus one, each restart a real one.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from typing import Dict, List

from ms_llm.launch.msrun import free_port

from .criteria import Check, compare, restart_built, trains
from .matrix import ROOT, Cell
from .plan import Job
from .runner import WORKER, job_env

SAVE_INTERVAL = 2
_FAILED = re.compile(r"attempt (\d+) failed with exit code (-?\d+) after ([\d.]+) s")


def fault_run(cell: Cell, config: str, layout_args: List[str], work: str, steps: int) -> dict:
    """The worker run of ``cell`` in its family's fault launch."""
    out = os.path.join(work, "fault", cell.slug)
    shutil.rmtree(out, ignore_errors=True)
    return dict(name=f"{cell.slug}.fault", config=config, out=out,
                fault=[steps - 1, cell.feature.nproc - 1],
                args=[*layout_args, "--training.output_dir", out, "--checkpoint.save_dir",
                      os.path.join(out, "ckpt"), "--checkpoint.save_interval",
                      str(SAVE_INTERVAL), "--training.resume", "auto"])


def supervisor_command(job: Job, jdir: str, spec: str, port: int) -> List[str]:
    """The restart supervisor's command line for ``job``: it builds each attempt's msrun
    command itself (``ms_llm.training.restart``: ``--worker-num`` workers of ``-- ENTRY ARGS``),
    so a one-worker job is a one-worker msrun launch too."""
    return [sys.executable, "-m", "ms_llm.training.restart", "--max-restarts",
            str(len(job.runs)), "--save-dir", jdir, "--master-port", str(port),
            "--log-dir", os.path.join(jdir, "msrun"), "--worker-num", str(job.nproc),
            "--cluster-time-out", "60", "--", WORKER, spec]


def run_fault_launch(job: Job, work: str, timeout: float, say=print) -> Dict:
    """Run ``job`` (fault runs, one per cell) under the restart supervisor. Returns the
    records, the failed attempts ``[(exit code, seconds)]`` in order, the supervisor's exit
    code and its log."""
    jdir = os.path.join(work, "fault_jobs", job.name)
    shutil.rmtree(jdir, ignore_errors=True)
    os.makedirs(jdir)
    results, spec = os.path.join(jdir, "results.json"), os.path.join(jdir, "job.json")
    with open(spec, "w", encoding="utf-8") as f:
        json.dump({"results": results, "runs": job.runs, "resumable": True}, f, indent=1)
    sup = supervisor_command(job, jdir, spec, free_port())
    say(f"ms-llm qualify: fault launch {job.name}: {len(job.runs)} cell(s) on {job.nproc} "
        f"worker(s), one kill and restart each")
    t0 = time.time()
    try:
        p = subprocess.run(sup, capture_output=True, text=True, env=job_env(), timeout=timeout,
                           cwd=ROOT, stdin=subprocess.DEVNULL)
        rc, text = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc = "timeout"
        text = "".join(x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
                       for x in (e.stdout, e.stderr))
    with open(os.path.join(jdir, "supervisor.log"), "w", encoding="utf-8") as f:
        f.write(text)
    runs = {}
    if os.path.exists(results):
        with open(results, encoding="utf-8") as f:
            runs = json.load(f)["runs"]
    failed = [(int(m[2]), float(m[3])) for m in _FAILED.finditer(text)]
    say(f"ms-llm qualify: fault launch {job.name}: exit {rc} after {len(failed)} kill(s) in "
        f"{time.time() - t0:.0f} s")
    return {"runs": runs, "failed": failed, "rc": rc, "log": text,
            "seconds": round(time.time() - t0, 1)}


def _metrics_curve(out: str) -> Dict[int, dict]:
    last: Dict[int, dict] = {}
    path = os.path.join(out, "metrics.jsonl")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            for line in f:
                r = json.loads(line)
                if "loss" in r and "step" in r:
                    last[int(r["step"])] = r          # a restarted step's record comes later
    return last


def check_cell(cell: Cell, run: dict, index: int, launch: Dict, uninterrupted: Dict,
               steps: int, timeout: float) -> Check:
    """(d) of ``cell``, whose fault run is the ``index``-th of its launch."""
    missing = restart_built()
    if missing:
        return Check("unmet", missing)
    if uninterrupted["error"]:
        return Check("unmet", "no uninterrupted run to compare with")
    if index >= len(launch["failed"]):
        return Check("fail", f"killed worker did not end the launch (launch exit "
                             f"{launch['rc']}, {len(launch['failed'])} failed attempt(s))")
    code, sec = launch["failed"][index]
    if code == 0 or sec > timeout:
        return Check("fail", f"killed worker: attempt exited {code} after {sec:.0f} s")
    rec = launch["runs"].get(run["name"])
    if rec is None or rec.get("error"):
        return Check("fail", f"automatic restart: {rec['error'] if rec else 'no record'} "
                             f"(launch exit {launch['rc']})")
    fault_step = run["fault"][0]
    resumed_at = (fault_step - 1) // SAVE_INTERVAL * SAVE_INTERVAL
    if rec.get("steps") != list(range(resumed_at + 1, steps + 1)):
        return Check("fail", f"relaunch trained steps {rec.get('steps')}, expected "
                             f"{resumed_at + 1}-{steps} (resume from step {resumed_at})")
    last = _metrics_curve(run["out"])
    if sorted(last) != list(range(1, steps + 1)):
        return Check("fail", f"metrics.jsonl steps after restart: {sorted(last)}")
    got = {"loss": [last[s]["loss"] for s in sorted(last)],
           "grad_norm": [last[s]["grad_norm"] for s in sorted(last)]}
    why = compare(got, uninterrupted, cell.feature.tol(cell.family))
    if why:
        return Check("fail", f"restarted curve: {why}")
    return Check("ok", f"rank {run['fault'][1]} killed in step {fault_step}: launch exit {code} "
                       f"after {sec:.0f} s; automatic restart resumed from step {resumed_at} "
                       f"and matched the uninterrupted curve")


def restart_logs(launch: Dict, tail: int = 40) -> List[str]:
    """The supervisor's lines (restarts, exit codes) for a cell log."""
    # the supervisor's "resuming from" names its --save-dir; each run resumes from its own
    lines = [re.sub(r"resuming from .*?; worker logs", "each killed run resumes from its own "
                    "save_dir; worker logs", ln)
             for ln in launch["log"].splitlines() if ln.startswith("ms-llm restart:")]
    return ["--- fault launch (restart supervisor)", *lines[-tail:]]


def launch_cells(planner, cells, recs: Dict[str, dict], work: str, steps: int,
                 timeout: float) -> tuple:
    """Criterion (d) for every cell that trains: one fault launch per family and worker count
    (``qualify.fault``). Returns ``({cell key: Check}, {cell key: log lines})``."""
    if restart_built():
        return {}, {}
    groups: Dict[tuple, list] = {}
    for cell in cells:
        if not cell.applicable:
            continue
        names = planner.cells[cell.key]
        if trains(recs[names.run], steps).state != "ok":
            continue
        layout = planner.single_args(cell) + list(cell.layout)
        run = fault_run(cell, planner.config(cell.family), layout, work, steps)
        groups.setdefault((cell.family.name, cell.feature.nproc), []).append((cell, run))
    checks, logs = {}, {}
    for (family, nproc), members in groups.items():
        job = Job(f"fault_{family}_n{nproc}", nproc, [r for _, r in members])
        launch = run_fault_launch(job, work, timeout * len(members))
        for (cell, run), i in zip(members, attempt_indices([r for _, r in members], launch)):
            names = planner.cells[cell.key]
            checks[cell.key] = check_cell(cell, run, i, launch, recs[names.run], steps,
                                          timeout)
            logs[cell.key] = restart_logs(launch)
    return checks, logs


def attempt_indices(runs: List[dict], launch: Dict) -> List[int]:
    """The failed attempt each fault run's kill ended, in order. A run that failed on its own
    before its kill step (recorded with an error, no step logged at or past the one before the
    kill) ended no attempt: the job went on to the next run, whose kill is then the same
    attempt number, not the next."""
    out, i = [], 0
    for run in runs:
        out.append(i)
        rec = launch["runs"].get(run["name"])
        logged = _metrics_curve(run["out"])
        if not (rec and rec.get("error") and max(logged, default=0) < run["fault"][0] - 1):
            i += 1
    return out
