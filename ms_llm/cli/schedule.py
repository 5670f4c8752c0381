"""``ms-llm schedule``: print the pipeline schedule a config would run, before any process
starts (per rank, the actions of each lockstep round, and the simulated bubble); ``parallel``
builds the schedule."""
from __future__ import annotations

import argparse
import sys
from typing import List

from ms_llm.config import ConfigError, load_config
from ms_llm.parallel.pipeline.schedules import format_schedule, plan_rounds, schedule_of


def main(argv: List[str]) -> int:
    p = argparse.ArgumentParser(
        prog="ms-llm schedule", description="print the pipeline schedule of a training config",
        epilog="Other arguments are config overrides, as for ms-llm train "
               "(e.g. --parallel.pipeline_model_parallel_size 4).")
    p.add_argument("config", nargs="?", default=None, help="YAML config (default: built-in)")
    p.add_argument("--workers", type=int, default=None,
                   help="msrun workers (default: tensor x context x pipeline size, i.e. dp=1)")
    if any(a in ("-h", "--help") for a in argv):
        p.parse_args(["--help"])
    # The config is the first argument unless it is an override (overrides' values would
    # otherwise be taken for it).
    config = argv[0] if argv and not argv[0].startswith("-") else None
    rest = argv[1:] if config else list(argv)
    opts = argparse.ArgumentParser(add_help=False)
    opts.add_argument("--workers", type=int, default=None)
    args, overrides = opts.parse_known_args(rest)
    args.config = config
    try:
        cfg = load_config(args.config, overrides, command_line=True)
        par, t = cfg.parallel, cfg.training
        inner = par.tensor_model_parallel_size * par.context_parallel_size * \
            par.pipeline_model_parallel_size
        workers = args.workers or inner
        if workers % inner:
            raise ConfigError(f"--workers {workers} is not divisible by tensor x context x "
                              f"pipeline size ({inner})")
        dp = workers // inner
        if t.global_batch_size % (t.micro_batch_size * dp):
            raise ConfigError(f"training.global_batch_size ({t.global_batch_size}) is not a "
                              f"multiple of micro_batch_size x data-parallel size "
                              f"({t.micro_batch_size} x {dp})")
        m = t.global_batch_size // (t.micro_batch_size * dp)
        pp, vpp = par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size
        spec = schedule_of(par)
        schedule = spec.build(pp, m, vpp)
    except (ConfigError, ValueError) as e:
        print(f"ms-llm schedule: {e}", file=sys.stderr)
        return 2
    rounds = plan_rounds(schedule, pp, vpp, placement=spec.placement)
    print(f"{spec.label}: pp={pp} vpp={vpp} micro-batches={m} (dp={dp}); actions "
          f"F|B|W<microbatch>.<chunk>, one column per round")
    print(format_schedule(schedule, rounds))
    print(spec.bubble_note(rounds, pp, m))
    return 0
