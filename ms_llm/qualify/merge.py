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
from typing import Dict, List, Optional

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


def combine(base: dict, new: dict) -> dict:
    """``base`` with ``new``'s cells added or replacing base's (same family and feature); the
    runs that still hold a cell, oldest first."""
    by = {(c["family"], c["feature"]): c for c in base["cells"]}
    for c in new["cells"]:
        by[c["family"], c["feature"]] = c
    cells = list(by.values())
    used = {c["run"] for c in cells} | {c["d_run"] for c in cells if c.get("d_run")}
    runs: Dict[str, dict] = {}
    for r in base["runs"] + new["runs"]:
        if r["id"] in used:
            runs[r["id"]] = r                # a run seen in both: the newer record
    return {"runs": sorted(runs.values(), key=lambda r: (r["generated"] or "", r["id"])),
            "cells": cells}


def copy_logs(src: str, dst: str, cells: List[dict]) -> None:
    """Copy each cell's log from out folder ``src`` to ``dst`` (the same relative path)."""
    for c in cells:
        if not c.get("log"):
            continue
        a, b = os.path.join(src, c["log"]), os.path.join(dst, c["log"])
        if os.path.abspath(a) == os.path.abspath(b):
            continue
        if not os.path.isfile(a):
            raise ValueError(f"{os.path.join(src, 'support.json')}: cell "
                             f"{c['family']}:{c['feature']}: its log {a} is missing")
        os.makedirs(os.path.dirname(b), exist_ok=True)
        shutil.copyfile(a, b + ".tmp")
        os.replace(b + ".tmp", b)


def merge_folders(dst: str, sources: List[str]) -> dict:
    """Merge the out folders ``sources`` (in order: a later one's cell wins) into ``dst``
    (which may hold a table already, or nothing yet): their logs are copied; the merged table
    is returned for ``report.write_table``."""
    table: Optional[dict] = load(dst) if os.path.isfile(os.path.join(dst, "support.json")) \
        else None
    loaded = [(src, load(src)) for src in sources]        # every source checked before writing
    for src, got in loaded:
        copy_logs(src, dst, got["cells"])
        table = got if table is None else combine(table, got)
    return table
