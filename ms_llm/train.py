"""Training entry point: ``python -m ms_llm.train [CONFIG.yaml] [--section.key VALUE ...]``.

This is the script ``scripts/pretrain.sh`` hands to ``msrun``. Config errors print one line
(``config error: <file or command line>: <key> ...``) and exit with code 2.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import List, Optional

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                              "configs", "tiny.yaml")


def split_args(argv: List[str]):
    if argv and not argv[0].startswith("--"):
        return argv[0], argv[1:]
    return None, argv


def main(argv: Optional[List[str]] = None) -> int:
    from ms_llm.config import ConfigError, load_config

    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=os.environ.get("MS_LLM_LOG_LEVEL", "WARNING"),
                        format="%(levelname)s %(name)s: %(message)s")
    path, overrides = split_args(argv)
    if path is None:
        path = os.environ.get("MS_LLM_CONFIG", DEFAULT_CONFIG)
    try:
        cfg = load_config(path, overrides)
        from ms_llm.training.trainer import run
        run(cfg)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
