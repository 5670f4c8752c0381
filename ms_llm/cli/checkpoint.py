"""``ms-llm checkpoint verify DIR``: one line per checkpoint of DIR (the checks are
``checkpoint.verify``)."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from ms_llm.checkpoint.formats import tracker_problem
from ms_llm.checkpoint.verify import checkpoints_in, verify_any


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``ms-llm checkpoint verify DIR``: one line per checkpoint (``ok`` or why not); exit 0
    when every checkpoint verifies, 1 when one does not, 2 when DIR holds none."""
    p = argparse.ArgumentParser(prog="ms-llm checkpoint",
                                description="inspect training checkpoints")
    sub = p.add_subparsers(dest="action", required=True)
    v = sub.add_parser("verify", help="check every file's size and crc32 against the metadata",
                       description="DIR: an iter_* checkpoint or a checkpoint.save_dir")
    v.add_argument("dir")
    v.add_argument("--size-only", action="store_true",
                   help="check sizes and structure only (no crc32 read)")
    a = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    path = a.dir
    if not os.path.isdir(path):
        print(f"ms-llm checkpoint verify: {path}: no such directory", file=sys.stderr)
        return 2
    found = checkpoints_in(path)
    if not found:
        print(f"ms-llm checkpoint verify: {path}: no iter_* checkpoint here", file=sys.stderr)
        return 2
    bad = 0
    why = tracker_problem(path) if found != [path] else None
    if why:   # the tracker is what Megatron and ms-llm's resume read first
        bad += 1
        print(f"{path}: FAILED: {why}")
    for cp in found:
        why, ok = verify_any(cp, not a.size_only)
        bad += why is not None
        print(f"{cp}: {ok if why is None else 'FAILED: ' + why}")
    return 1 if bad else 0
