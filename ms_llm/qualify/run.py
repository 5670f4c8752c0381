"""``ms-llm qualify``'s run (its command line is ``ms_llm.cli.qualify``): the qualification
matrix as real jobs, written to DIR/support.md, DIR/support.json and DIR/logs/
(docs/qualification.md defines the criteria), or one table merged from several runs
(``qualify.merge``)."""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from typing import Dict, List

from . import criteria as C
from .fault import launch_cells
from .matrix import select
from .plan import Planner
from .runner import run_job, segment


def _cell_log(path: str, cell, status: str, unmet, test, checks, runs: List[str],
              logs: Dict[str, list], owner: Dict[str, str], recs, extra: List[str]) -> None:
    lines = [f"# {cell.key}: {status}" + (f" ({'; '.join(unmet)})" if unmet else ""), "",
             f"Test: {test.state}: {test.detail}"]
    lines += [f"({k}) {c.state}: {c.detail}" for k, c in checks.items()]
    for name in runs:
        rec = recs.get(name)
        if rec is None:
            continue
        lines += ["", f"## run {name}: " + ("ok" if not rec["error"] else rec["error"]),
                  f"loss {['%.6f' % x for x in rec['loss']]}",
                  f"grad_norm {['%.6f' % x for x in rec['grad_norm']]}"]
        job_logs = logs.get(owner.get(name, ""), [])
        for rank, text in enumerate(job_logs):
            if rank > 0 and not rec["error"]:
                break
            seg = segment(text, name)
            if not seg and rec["error"]:      # the job died: its log's tail
                seg = text.splitlines()[-30:]
            if seg:
                lines += [f"### rank {rank} log", "```", *seg, "```"]
    lines += extra
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(path + ".tmp", path)


def qualify(args, argv: List[str]) -> int:
    """Run the cells ``args`` (``ms_llm.cli.qualify``'s options) select, or only merge
    (``--merge-from``); ``argv`` is recorded as the command in the table."""
    if args.merge_from:
        return _merge_only(args)
    try:
        cells = select(args.suite, args.cells.split(",") if args.cells else None)
        for b in args.break_cell:
            select("full", [b])
    except ValueError as e:
        print(f"ms-llm qualify: {e}", file=sys.stderr)
        return 2
    if args.merge and os.path.isfile(os.path.join(args.out, "support.json")):
        from .merge import load
        try:                 # refused before the run, not after an hour of it
            load(args.out)
        except ValueError as e:
            print(f"ms-llm qualify: --merge: {e}", file=sys.stderr)
            return 2
    command = "ms-llm qualify " + " ".join(argv) if argv else "ms-llm qualify"
    t0 = time.time()
    from .report import git_commit
    commit = git_commit(os.path.abspath(args.out))   # the code this run starts with
    work = args.work or tempfile.mkdtemp(prefix="ms_llm_qualify_")
    os.makedirs(work, exist_ok=True)
    out = os.path.abspath(args.out)
    if not args.merge:       # a merged run rewrites only its own cells' logs
        shutil.rmtree(os.path.join(out, "logs"), ignore_errors=True)
    try:
        if args.fault_only:
            from . import fault_only
            return fault_only.run(args, cells, work, out, command, t0, commit,
                                  os.path.abspath(args.fault_only))
        return _run(args, cells, work, out, command, t0, commit)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


def _merge_only(args) -> int:
    """``--merge-from``: merge out folders into ``--out`` without running a cell."""
    from .merge import merge_folders
    if args.cells or args.merge or args.break_cell:
        print("ms-llm qualify: --merge-from runs nothing: drop --cells / --merge / "
              "--break-cell", file=sys.stderr)
        return 2
    try:
        table = merge_folders(os.path.abspath(args.out), args.merge_from)
        from .report import write_table
        write_table(os.path.abspath(args.out), table)
    except (ValueError, OSError) as e:
        print(f"ms-llm qualify: --merge-from: {e}", file=sys.stderr)
        return 2
    print(f"ms-llm qualify: merged {len(args.merge_from)} folder(s) into {args.out}: "
          f"{len(table['cells'])} cells from {len(table['runs'])} run(s)")
    return 1 if any(c["status"] == "Fail" for c in table["cells"]) else 0


def _run(args, cells, work: str, out: str, command: str, t0: float, commit: str) -> int:
    from .data import prepare
    planner = Planner(work, prepare(os.path.join(work, "data")), args.break_cell, args.steps)
    for cell in cells:
        if cell.applicable:
            planner.add(cell)
    recs: Dict[str, dict] = {}
    logs: Dict[str, list] = {}
    owner: Dict[str, str] = {}
    device = None
    for job in planner.ordered_jobs():
        res = run_job(job, work, args.timeout)
        recs.update(res["runs"])
        logs[job.name] = res["logs"]
        owner.update({r["name"]: job.name for r in job.runs})
        device = device or res["device"]
    faults, fault_logs = ({}, {}) if args.no_fault else \
        launch_cells(planner, cells, recs, work, args.steps, args.timeout)
    results = []
    for cell in cells:
        entry = {"family": cell.family.name, "feature": cell.feature.name, "log": None,
                 "criteria": {}}
        if not cell.applicable:
            entry.update(status="n/a", unmet=[])
            results.append(entry)
            continue
        names = planner.cells[cell.key]
        test = C.trains(recs[names.run], args.steps)
        checks: Dict[str, C.Check] = {}
        extra: List[str] = []
        if test.state == "ok":
            checks["a"] = C.parity(cell, recs, names)
            checks["b"] = C.round_trip(cell, recs, names, work)
            checks["c"] = C.resume(cell, recs, names, planner.resume_at, args.steps)
            checks["d"] = faults.get(cell.key) or C.Check(
                "unmet", C.restart_built() or "not run (--no-fault)")
            extra += fault_logs.get(cell.key, [])
        for chk in [test, *checks.values()]:   # the scratch folder's name says nothing
            chk.detail = chk.detail.replace(work.rstrip("/") + "/", "")
        status, unmet = C.verdict(test, checks)
        log_rel = os.path.join("logs", cell.slug + ".log")
        runs = [n for n in dict.fromkeys([names.ref, names.run, names.part, names.resume,
                                          names.other, names.reload]) if n]
        if "base" in cell.feature.needs:
            runs.insert(0, f"{cell.family.name}.base")
        _cell_log(os.path.join(out, log_rel), cell, status, unmet, test, checks, runs, logs,
                  owner, recs, extra)
        entry.update(status=status, unmet=unmet, log=log_rel,
                     criteria={"test": test.to_dict(),
                               **{k: c.to_dict() for k, c in checks.items()}},
                     tolerance=cell.feature.tol(cell.family).describe())
        results.append(entry)
        print(f"ms-llm qualify: {cell.key}: {status}" + (f" ({'; '.join(unmet)})" if unmet
                                                         else ""), flush=True)
    from .report import write
    try:
        paths = write(out, args.suite if not args.cells else "cells", results, device,
                      time.time() - t0, command, merge=args.merge, commit=commit)
    except ValueError as e:          # --merge into a folder whose support.json is not a table
        print(f"ms-llm qualify: --merge: {e}", file=sys.stderr)
        return 2
    print(f"ms-llm qualify: wrote {paths['support.md']} and {paths['support.json']} "
          f"({time.time() - t0:.0f} s)")
    return 1 if any(r["status"] == "Fail" for r in results) else 0
