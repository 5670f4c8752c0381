"""``ms-llm qualify --cells ... --fault-only WORK --out DIR``: criterion (d) again for cells
whose (a)-(c) and uninterrupted runs come from an earlier run whose scratch folder (``--work``)
was WORK. DIR gets "(d) only" cells; merged into a table holding the same cells (``--merge``,
or ``--merge-from DIR`` later), each patches its cell's (d) (``merge.combine``).

Why: (d) is one fault launch per family (``qualify.fault``) and needs only each cell's
uninterrupted curve to compare with; when (d) itself was broken (the launch, not the cells),
re-running every cell's (a)-(c) to get it again costs the whole matrix (over an hour here),
this costs the fault launches alone, and can start while the earlier run is still in its
later phases (a cell whose uninterrupted run is not recorded yet is skipped). The patched cell
keeps the run its (a)-(c) came from and records this run as ``d_run`` (the table shows both
commits); its log's (d) line and fault-launch section are replaced.

The uninterrupted run of a cell is found by its arguments, not its name: this run plans the
cell again in its own scratch folder, and the earlier run's job with the same arguments (its
WORK prefix for ours) holds the record, however the earlier run's cells shared references.
"""
from __future__ import annotations

import glob
import json
import os
import sys
import time
from typing import Dict, List, Optional

from . import criteria as C
from .data import prepare
from .fault import launch_cells
from .plan import Planner


def _strip_out(args: List[str]) -> List[str]:
    out, i = [], 0
    while i < len(args):
        if args[i] == "--training.output_dir":
            i += 2
            continue
        out.append(args[i])
        i += 1
    return out


def earlier_records(old_work: str) -> Dict[tuple, dict]:
    """``{(workers, config name, arguments without the output folder): record}`` of every run
    of the earlier run's jobs (``WORK/jobs/*/job.json`` and ``results.json``; the config by
    name: the earlier run may be another checkout)."""
    found: Dict[tuple, dict] = {}
    for spec in sorted(glob.glob(os.path.join(old_work, "jobs", "*", "job.json"))):
        res = os.path.join(os.path.dirname(spec), "results.json")
        if not os.path.isfile(res):
            continue
        with open(spec, encoding="utf-8") as f:
            runs = json.load(f)["runs"]
        with open(res, encoding="utf-8") as f:
            got = json.load(f)
        for run in runs:       # dp's run has its reference's arguments, on 2 workers
            if run["name"] in got["runs"]:
                found[(got.get("world_size", 1), os.path.basename(run["config"]),
                       tuple(_strip_out(run["args"])))] = got["runs"][run["name"]]
    return found


def uninterrupted(planner: Planner, name: str, work: str, old_work: str,
                  old: Dict[tuple, dict]) -> Optional[dict]:
    """The earlier run's record of our planned run ``name`` (same config and arguments, our
    scratch folder read as theirs)."""
    nproc, spec = next((j.nproc, r) for j in planner.jobs.values() for r in j.runs
                       if r["name"] == name)
    theirs = [a.replace(work.rstrip("/") + "/", old_work.rstrip("/") + "/")
              for a in _strip_out(spec["args"])]
    return old.get((nproc, os.path.basename(spec["config"]), tuple(theirs)))


def _err(msg: str) -> None:
    print(f"ms-llm qualify: --fault-only: {msg}", file=sys.stderr)


def run(args, cells, work: str, out: str, command: str, t0: float, commit: str,
        old_work: str) -> int:
    """Re-run (d) of ``cells`` into ``out`` as "(d) only" cells (``merge`` applies them to a
    table holding the same cells); the exit code."""
    from .report import write
    old = earlier_records(old_work)
    if not old:
        _err(f"{old_work}: no jobs/*/results.json (not an earlier run's --work folder)")
        return 2
    planner = Planner(work, prepare(os.path.join(work, "data")), steps=args.steps)
    planner.base_from = old_work          # LoRA cells train on the earlier run's base export
    recs: Dict[str, dict] = {}
    todo = []
    for cell in cells:
        if not cell.applicable:
            continue
        names = planner.add(cell)
        rec = uninterrupted(planner, names.run, work, old_work, old)
        if rec is None:        # not run there (yet), or planned otherwise at its commit
            print(f"ms-llm qualify: --fault-only: {old_work} holds no uninterrupted run of "
                  f"{cell.key} with these arguments: skipped", flush=True)
            continue
        if C.trains(rec, args.steps).state == "ok":   # refused or failed: no (d) to measure
            recs[names.run] = rec
            todo.append(cell)
    checks, logs = launch_cells(planner, todo, recs, work, args.steps, args.timeout)
    entries = []
    for cell in todo:
        d = checks.get(cell.key) or C.Check("unmet", C.restart_built() or "no fault launch")
        d.detail = d.detail.replace(work.rstrip("/") + "/", "")
        log = os.path.join("logs", cell.slug + ".d.log")
        os.makedirs(os.path.join(out, "logs"), exist_ok=True)
        with open(os.path.join(out, log), "w", encoding="utf-8") as f:
            f.write("\n".join([f"(d) {d.state}: {d.detail}",
                               f"(d) re-run by `{command}` at {commit}",
                               *logs.get(cell.key, [])]) + "\n")
        entries.append({"family": cell.family.name, "feature": cell.feature.name,
                        "status": "(d) only", "unmet": [], "d_only": True, "log": log,
                        "criteria": {"d": d.to_dict()}})
        print(f"ms-llm qualify: {cell.key}: (d) {d.state}: {d.detail}", flush=True)
    try:
        write(out, "cells (d) only", entries, None, time.time() - t0, command,
              merge=args.merge, commit=commit)
    except ValueError as e:
        _err(str(e))
        return 2
    print(f"ms-llm qualify: (d) of {len(todo)} cell(s) written to {out} "
          f"({time.time() - t0:.0f} s)")
    return 1 if any(e["criteria"]["d"]["state"] == "fail" for e in entries) else 0
