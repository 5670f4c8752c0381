"""Training entry point: ``python -m ms_llm.cli.train [CONFIG.yaml] [--section.key VALUE ...]``.

This is the script ``scripts/pretrain.sh`` hands to ``msrun``. Config errors print one line
(``config error: <file or command line --key>: <key> ...``) and exit with code 2; ``--help``
prints the usage and every config key with its default, generated from ``ms_llm.config``.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import List, Optional

DEFAULT_CONFIG = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    "configs", "tiny.yaml")


USAGE = """usage: ms-llm train [CONFIG.yaml] [--section.key VALUE | --section.key=VALUE ...]

Train a model. CONFIG.yaml defaults to $MS_LLM_CONFIG, else configs/tiny.yaml. Every key below can
be set in the YAML file (section: {key: value}) or on the command line (--section.key VALUE);
the command line wins. Lists are comma-separated on the command line, null means None.
Under msrun: bash scripts/pretrain.sh [CONFIG.yaml] [--section.key VALUE ...].

config keys (type, default, [allowed values]):
"""


def wants_help(argv: List[str]) -> bool:
    """``-h``/``--help`` anywhere among the arguments (a config value is never spelled so)."""
    return any(a in ("-h", "--help") for a in argv)


def print_help() -> None:
    from ms_llm.config.help import schema_help
    print(USAGE + schema_help())


def split_args(argv: List[str]):
    if argv and not argv[0].startswith("--"):
        return argv[0], argv[1:]
    return None, argv


def main(argv: Optional[List[str]] = None) -> int:
    from ms_llm.checkpoint.native.format import DCPError
    from ms_llm.checkpoint.torch_pickle.format import TorchFormatError
    from ms_llm.config import ConfigError, load_config

    argv = list(sys.argv[1:] if argv is None else argv)
    if wants_help(argv):
        print_help()
        return 0
    from ms_llm.compat.environment import setting, variable
    logging.basicConfig(level=str(setting("runtime.log_level")).upper(),
                        format="%(levelname)s %(name)s: %(message)s")
    path, overrides = split_args(argv)
    if path is None:
        path = variable("MS_LLM_CONFIG") or DEFAULT_CONFIG
    try:
        cfg = load_config(path, overrides, command_line=True)
        if "runtime.log_level" in cfg.sources:
            logging.getLogger().setLevel(cfg.runtime.log_level.upper())
        from ms_llm.training.trainer import run
        run(cfg)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr, flush=True)
        return 2
    except (DCPError, TorchFormatError) as e:   # a checkpoint that cannot be used as asked
        print(f"checkpoint error: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
        return 2
    except FloatingPointError as e:   # training.nan_policy (ms_llm.training.nonfinite)
        print(f"training stopped: {e}", file=sys.stderr, flush=True)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
