"""``ms-llm qualify --cells ... --fault-only WORK --merge --out DIR``: criterion (d) again for
cells already in DIR's table, whose (a)-(c) and uninterrupted runs come from an earlier run
whose scratch folder (``--work``) was WORK.

Why: (d) is one fault launch per family (``qualify.fault``) and needs only each cell's
uninterrupted curve to compare with; when (d) itself was broken (the launch, not the cells),
re-running every cell's (a)-(c) to get it again costs the whole matrix (over an hour here),
this costs the fault launches alone. The cell keeps the run its (a)-(c) came from and records
this run as ``d_run`` (the table shows both commits); its log's (d) line and fault-launch
section are replaced.

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
from .merge import load
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
    """``{(workers, config, arguments without the output folder): record}`` of every run of
    the earlier run's jobs (``WORK/jobs/*/job.json`` and ``results.json``)."""
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
                found[(got.get("world_size", 1), run["config"],
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
    return old.get((nproc, spec["config"], tuple(theirs)))


def _update_log(path: str, key: str, status: str, unmet: List[str], d: C.Check,
                lines: List[str], note: str) -> None:
    if not os.path.isfile(path):
        return
    with open(path, encoding="utf-8") as f:
        text = f.read().splitlines()
    cut = next((i for i, ln in enumerate(text)
                if ln.startswith("--- fault launch (restart supervisor)")), len(text))
    text = text[:cut]
    text[0] = f"# {key}: {status}" + (f" ({'; '.join(unmet)})" if unmet else "")
    text = [f"(d) {d.state}: {d.detail}" if ln.startswith("(d) ") else ln for ln in text]
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write("\n".join(text + [note] + lines) + "\n")
    os.replace(path + ".tmp", path)


def _err(msg: str) -> None:
    print(f"ms-llm qualify: --fault-only: {msg}", file=sys.stderr)


def run(args, cells, work: str, out: str, command: str, t0: float, commit: str,
        old_work: str) -> int:
    """Re-run (d) of ``cells`` and merge it into ``out``'s table; the exit code."""
    from .report import new_run, write_table
    table = load(out)
    by = {(c["family"], c["feature"]): c for c in table["cells"]}
    missing = [c.key for c in cells if (c.family.name, c.feature.name) not in by]
    if missing:
        _err(f"{os.path.join(out, 'support.json')} has no cell {missing[0]} (run it first)")
        return 2
    old = earlier_records(old_work)
    if not old:
        _err(f"{old_work}: no jobs/*/results.json (not an earlier run's --work folder)")
        return 2
    planner = Planner(work, prepare(os.path.join(work, "data")), steps=args.steps)
    recs: Dict[str, dict] = {}
    todo = []
    for cell in cells:
        entry = by[cell.family.name, cell.feature.name]
        if not cell.applicable or entry["criteria"].get("test", {}).get("state") != "ok":
            continue            # n/a, refused or not training: no (d) to measure
        names = planner.add(cell)
        rec = uninterrupted(planner, names.run, work, old_work, old)
        if rec is None:
            _err(f"{old_work} holds no uninterrupted run of {cell.key} with these arguments "
                 f"(another commit's plan?)")
            return 2
        recs[names.run] = rec
        todo.append(cell)
    checks, logs = launch_cells(planner, todo, recs, work, args.steps, args.timeout)
    run_rec = new_run("cells (d) only", None, time.time() - t0, command, commit)
    for cell in todo:
        entry = by[cell.family.name, cell.feature.name]
        d = checks.get(cell.key) or C.Check("unmet", C.restart_built() or "no fault launch")
        d.detail = d.detail.replace(work.rstrip("/") + "/", "")
        have = {k: C.Check(v["state"], v["detail"]) for k, v in entry["criteria"].items()}
        test = have.pop("test")
        have["d"] = d
        status, unmet = C.verdict(test, have)
        entry.update(status=status, unmet=unmet, d_run=run_rec["id"],
                     criteria=dict(entry["criteria"], d=d.to_dict()))
        if entry.get("log"):
            _update_log(os.path.join(out, entry["log"]), cell.key, status, unmet, d,
                        logs.get(cell.key, []), f"(d) re-run by `{command}` at {commit}")
        print(f"ms-llm qualify: {cell.key}: {status}" + (f" ({'; '.join(unmet)})" if unmet
                                                         else ""), flush=True)
    table["runs"].append(run_rec)
    write_table(out, table)
    print(f"ms-llm qualify: (d) of {len(todo)} cell(s) merged into {out} "
        f"({time.time() - t0:.0f} s)")
    return 1 if any(c["status"] == "Fail" for c in table["cells"]) else 0
