"""``ms-llm plot``: draw loss.png from a run's metrics.jsonl (the drawing is
``training.plot``)."""
from __future__ import annotations

import argparse
import sys
from typing import List


def main(argv: List[str]) -> int:
    from ms_llm.cli import COMMANDS
    p = argparse.ArgumentParser(prog="ms-llm plot", description=COMMANDS["plot"])
    p.add_argument("output_dir")
    p.add_argument("--out", default=None, help="PNG path (default <output_dir>/loss.png)")
    args = p.parse_args(argv)
    from ms_llm.training.plot import plot_loss
    try:
        print(plot_loss(args.output_dir, args.out))
    except (FileNotFoundError, ValueError) as e:
        print(f"ms-llm plot: {e}", file=sys.stderr)
        return 2
    return 0
