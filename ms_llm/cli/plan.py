"""``ms-llm plan``: per-rank memory of a config and layout before launch, and what makes it fit
(the plan is ``planning.memory_plan_fit``)."""
from __future__ import annotations

from typing import Sequence

from ms_llm.planning.memory_plan_fit import format_plan, plan_with_fix


def main(argv: Sequence[str]) -> int:
    """``ms-llm plan CONFIG [--section.key VALUE ...] --nproc N [--device-memory-gb G]
    [--json] [--distributed-optimizer]``."""
    import argparse
    import json
    import sys
    from ms_llm.config import ConfigError, load_config
    ap = argparse.ArgumentParser(
        prog="ms-llm plan", description="Per-rank memory of a training run before launch "
        "(parameters, gradients, optimizer state, activations, communication buffers, peak) "
        "and the cheapest change that makes it fit. Config overrides as for ms-llm train.")
    ap.add_argument("config")
    ap.add_argument("--nproc", type=int, required=True, help="number of workers")
    ap.add_argument("--device-memory-gb", type=float, default=None, dest="mem",
                    help="memory per device; says whether the run fits and what would")
    ap.add_argument("--distributed-optimizer", action="store_true", dest="distopt",
                    help="plan with the distributed optimizer (what-if)")
    ap.add_argument("--json", action="store_true", help="machine-readable output")
    args, overrides = ap.parse_known_args(list(argv))
    if args.nproc < 1:
        print("ms-llm plan: --nproc must be >= 1", file=sys.stderr)
        return 2
    try:
        cfg = load_config(args.config, overrides, command_line=True)
        plan = plan_with_fix(cfg, args.nproc, args.mem, True if args.distopt else None)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"ms-llm plan: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan.to_dict(), indent=1))
    else:
        print(format_plan(plan, args.config))
    return 0
