"""``ms-llm qualify [--suite quick|full] [--cells ...] [--out DIR] [--merge]``: run the
qualification matrix as real jobs and write DIR/support.md, DIR/support.json and DIR/logs/
(docs/qualification.md defines the criteria); ``--merge`` / ``--merge-from`` build one table
from several runs (``qualify.merge``). Exit 0 when no cell fails, 1 when one does, 2 on bad
arguments."""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from ms_llm.qualify.matrix import STEPS, SUITES
from ms_llm.qualify.run import qualify


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ms-llm qualify", description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", choices=sorted(SUITES), default="quick",
                   help="quick: 2 families x 4 layouts (< 10 min on 2 cores); full: everything")
    p.add_argument("--out", default="outputs/qualify", help="where support.md/.json and logs/ go")
    p.add_argument("--work", default=None,
                   help="scratch folder for checkpoints and exports (default: a temporary one, "
                        "removed at the end)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per job")
    p.add_argument("--cells", default=None,
                   help="only these cells: family:feature, comma-separated (e.g. a re-run "
                        "after a fix, with --merge)")
    p.add_argument("--merge", action="store_true",
                   help="add this run's cells to the table already in --out (a cell replaces "
                        "the same family:feature; each cell names its run's commit)")
    p.add_argument("--merge-from", action="append", default=[], metavar="DIR",
                   type=lambda v: ("all", v),
                   help="run nothing: merge the qualify --out folder DIR (its cells and logs) "
                        "into --out; repeatable, a later DIR's cell wins")
    p.add_argument("--merge-d-from", action="append", dest="merge_from", metavar="DIR",
                   type=lambda v: ("d", v),
                   help="as --merge-from, but only criterion (d) of DIR's cells patches the "
                        "same cells (the newest (d) evidence of cells re-run since)")
    p.add_argument("--fault-only", default=None, metavar="WORK",
                   help="run criterion (d) alone, comparing with the uninterrupted runs of the "
                        "earlier run whose --work folder was WORK; merged into a table holding "
                        "those cells, it patches their (d) (qualify.fault_only)")
    # test-only: cells whose parallel run is deliberately changed (another seed), to show a
    # Fail is reported
    p.add_argument("--steps", type=int, default=STEPS, help=argparse.SUPPRESS)
    p.add_argument("--break-cell", action="append", default=[], help=argparse.SUPPRESS)
    # test-only: skip criterion (d)'s fault launches (reported as not run, never as met)
    p.add_argument("--no-fault", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    return qualify(build_parser().parse_args(argv), argv)
