"""One published table from several qualify runs.

The full matrix takes over an hour here, so a table is built from runs at different commits:
the big run, then a few cells re-run after a fix or added for a new family. Rather than
footnotes written by hand, ``support.json`` records every run (commit, date, command, versions)
under ``runs`` and each cell names the run it came from (``run``); ``support.md`` lists the
runs in its header and each cell's commit. Merging replaces a cell by (family, feature): the
newest evidence for a cell is the one published, and a run no cell comes from any more is
dropped from the header.

``ms-llm qualify --cells ... --out DIR --merge`` adds its cells to DIR's table;
``ms-llm qualify --merge-from SRC [--merge-from SRC2] --out DIR`` merges whole out folders
(their cells and logs) into DIR without running anything.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Dict, List, Tuple

RUN_KEYS = ("generated", "command", "suite", "commit", "versions", "seconds")


def run_id(run: dict) -> str:
    """A run's name in ``support.json``: its date and short commit (unique in practice: two
    runs of one commit start at different minutes)."""
    return f"{run['generated']} {str(run['commit'])[:7]}"


def load(folder: str) -> dict:
    """``folder/support.json`` as ``{"runs": [...], "cells": [...]}`` with every cell naming
    its run. A table written before runs were recorded is one run holding all its cells."""
    path = os.path.join(folder, "support.json")
    try:
        with open(path, encoding="utf-8") as f:
            info = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file (not a qualify --out folder)") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    if not isinstance(info, dict) or not isinstance(info.get("cells"), list):
        raise ValueError(f"{path}: no 'cells' list (not written by ms-llm qualify)")
    runs = info.get("runs")
    if runs is None:                       # one run: its keys are the top level's
        run = {k: info.get(k) for k in RUN_KEYS}
        run["id"] = run_id(run)
        runs = [run]
        cells = [dict(c, run=run["id"]) for c in info["cells"]]
    else:
        cells = info["cells"]
    ids = {r["id"] for r in runs}
    for c in cells:
        if not {"family", "feature", "status"} <= set(c) or c.get("run") not in ids or \
                c.get("d_run", c["run"]) not in ids:
            raise ValueError(f"{path}: cell {c.get('family')}:{c.get('feature')} lacks "
                             f"family / feature / status or names no recorded run")
    return {"runs": runs, "cells": cells}


def _patch_d(cell: dict, d_only: dict) -> dict:
    """``cell`` with criterion (d) from a ``--fault-only`` run's cell, its status again."""
    from .criteria import Check, verdict
    key = f"{cell['family']}:{cell['feature']}"
    if cell["criteria"].get("test", {}).get("state") != "ok":
        raise ValueError(f"cell {key}: a (d)-only result for a cell that did not train "
                         f"({cell['status']})")
    crit = dict(cell["criteria"], d=d_only["criteria"]["d"])
    have = {k: Check(v["state"], v["detail"]) for k, v in crit.items() if k != "test"}
    status, unmet = verdict(Check(**crit["test"]), have)
    return dict(cell, criteria=crit, status=status, unmet=unmet, d_run=d_only["run"],
                d_log=d_only["log"])


def combine(base: dict, new: dict) -> dict:
    """``base`` with ``new``'s cells added or replacing base's (same family and feature; a
    "(d) only" cell of ``--fault-only`` patches the same cell's (d)); the runs that still hold
    a cell, oldest first."""
    by = {(c["family"], c["feature"]): c for c in base["cells"]}
    for c in new["cells"]:
        key = (c["family"], c["feature"])
        if c.get("d_only"):
            if key not in by or by[key].get("d_only"):
                raise ValueError(f"cell {':'.join(key)}: a (d)-only result, but the table has "
                                 f"no run of that cell to patch (merge the cell's run first)")
            c = _patch_d(by[key], c)
        by[key] = c
    cells = list(by.values())
    used = {c["run"] for c in cells} | {c["d_run"] for c in cells if c.get("d_run")}
    runs: Dict[str, dict] = {}
    for r in base["runs"] + new["runs"]:
        if r["id"] in used:
            runs[r["id"]] = r                # a run seen in both: the newer record
    return {"runs": sorted(runs.values(), key=lambda r: (r["generated"] or "", r["id"])),
            "cells": cells}


def patch_logs(folder: str, cells: List[dict]) -> None:
    """Each cell's log with its (d) re-run (``d_log``): the (d) line replaced and the earlier
    fault-launch section by the re-run's (idempotent: a second patch cuts the first)."""
    for c in cells:
        if not (c.get("d_log") and c.get("log")):
            continue
        path, d_path = os.path.join(folder, c["log"]), os.path.join(folder, c["d_log"])
        if not (os.path.isfile(path) and os.path.isfile(d_path)):
            continue
        with open(d_path, encoding="utf-8") as f:
            d_lines = f.read().splitlines()
        with open(path, encoding="utf-8") as f:
            text = f.read().splitlines()
        # the criteria block's "(d) ..." line; after it, the fault section starts at the
        # first "(d) re-run by" / "(d) from" line (a (d) log's second line) or the launch
        crit = next((i for i, ln in enumerate(text) if ln.startswith("(d) ")), None)
        start = 0 if crit is None else crit + 1
        cut = next((i for i in range(start, len(text)) if text[i].startswith(
            ("--- fault launch (restart supervisor)", "(d) "))), len(text))
        text = text[:cut]
        text[0] = f"# {c['family']}:{c['feature']}: {c['status']}" + (
            f" ({'; '.join(c['unmet'])})" if c["unmet"] else "")
        if crit is not None:
            text[crit] = d_lines[0]
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            f.write("\n".join(text + d_lines[1:]) + "\n")
        os.replace(path + ".tmp", path)


def copy_logs(src: str, dst: str, cells: List[dict]) -> None:
    """Copy each cell's log (and (d) re-run log) from out folder ``src`` to ``dst`` (the same
    relative paths)."""
    for rel in [p for c in cells for p in (c.get("log"), c.get("d_log")) if p]:
        a, b = os.path.join(src, rel), os.path.join(dst, rel)
        if os.path.abspath(a) == os.path.abspath(b):
            continue
        if not os.path.isfile(a):
            raise ValueError(f"{os.path.join(src, 'support.json')}: the log {a} is missing")
        os.makedirs(os.path.dirname(b), exist_ok=True)
        shutil.copyfile(a, b + ".tmp")
        os.replace(b + ".tmp", b)


def d_only_view(src: str, got: dict) -> Tuple[dict, Dict[str, List[str]]]:
    """``got`` (out folder ``src``'s table) as "(d) only" cells: only criterion (d) and its
    log lines are taken (``--merge-d-from``: the newest (d) evidence of cells whose other
    criteria come from a later run). Returns the table and ``{d log path: lines}``."""
    cells, logs = [], {}
    runs = {r["id"]: r for r in got["runs"]}
    for c in got["cells"]:
        d = c.get("criteria", {}).get("d")
        if not d or not c.get("log"):
            continue
        with open(os.path.join(src, c["log"]), encoding="utf-8") as f:
            text = f.read().splitlines()
        at = next((i for i, ln in enumerate(text)
                   if ln.startswith("--- fault launch (restart supervisor)")), len(text))
        run = runs[c["run"]]
        rel = c["log"][:-len(".log")] + ".d.log" if c["log"].endswith(".log") else \
            c["log"] + ".d"
        logs[rel] = [f"(d) {d['state']}: {d['detail']}",
                     f"(d) from `{run['command']}` at {run['commit']} ({run['generated']}), "
                     f"its log: {os.path.join(src, c['log'])}", *text[at:]]
        cells.append({"family": c["family"], "feature": c["feature"], "status": "(d) only",
                      "unmet": [], "d_only": True, "log": rel, "criteria": {"d": d},
                      "run": c["run"]})
    return {"runs": got["runs"], "cells": cells}, logs


def merge_folders(dst: str, sources: List) -> dict:
    """Merge the out folders ``sources`` (in order: a later one's cell wins) into ``dst``
    (which may hold a table already, or nothing yet): their logs are copied; the merged table
    is returned for ``report.write_table``. A source given as ``("d", DIR)`` contributes only
    criterion (d) of its cells (``d_only_view``); ``("all", DIR)`` or ``DIR``: everything."""
    table = load(dst) if os.path.isfile(os.path.join(dst, "support.json")) else \
        {"runs": [], "cells": []}
    loaded = []
    for item in sources:             # every source checked before anything is written
        kind, src = item if isinstance(item, tuple) else ("all", item)
        got = load(src)
        loaded.append((src, *(d_only_view(src, got) if kind == "d" else (got, None))))
    for _, got, _ in loaded:
        table = combine(table, got)
    for src, got, d_logs in loaded:
        if d_logs is None:
            copy_logs(src, dst, got["cells"])
            continue
        for rel, lines in d_logs.items():
            os.makedirs(os.path.dirname(os.path.join(dst, rel)), exist_ok=True)
            with open(os.path.join(dst, rel), "w", encoding="utf-8") as f:
                f.write("\n".join(lines) + "\n")
    patch_logs(dst, table["cells"])
    return table
