"""``pretrain_gpt.py`` / ``posttrain_gpt.py``: MindSpeed-LLM's training entries under msrun.

A MindSpeed script's launch line ``torchrun $DISTRIBUTED_ARGS pretrain_gpt.py <flags>`` becomes
``msrun <msrun args> /path/to/ms-llm/pretrain_gpt.py <flags>``, every flag unchanged. Rank 0
prints the no-op flags with their reasons; a refused flag stops the job before any training with
one line naming it (exit code 2, like ``ms-llm train``'s config errors).
"""
from __future__ import annotations

import logging
import os
import sys
from typing import List, Optional

USAGE = """usage: msrun <msrun args> {entry} [Megatron / MindSpeed-LLM flags ...]

Runs ms-llm training from a MindSpeed-LLM example script's arguments. Each flag maps to a run-config
key, is accepted as a no-op (printed with its reason), or is refused naming it. The keys it maps
to are printed with --print-config (then nothing runs).
"""


def main(argv: Optional[List[str]] = None, entry: str = "pretrain_gpt.py") -> int:
    from ms_llm.checkpoint.native.format import DCPError
    from ms_llm.config import ConfigError, load_config
    from .flags import explain, to_overrides, to_yaml, translate

    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE.format(entry=entry))
        return 0
    show = "--print-config" in argv
    argv = [a for a in argv if a != "--print-config"]
    logging.basicConfig(level=os.environ.get("MS_LLM_LOG_LEVEL", "WARNING"),
                        format="%(levelname)s %(name)s: %(message)s")
    rank0 = os.environ.get("RANK_ID", os.environ.get("MS_NODE_ID", "0")) in ("0", "")
    try:
        tr = translate(argv)
        if show:
            print(to_yaml(tr.keys), end="")
            return 0
        cfg = load_config(None, to_overrides(tr.keys))
        if rank0:
            for note in tr.notes:
                print(f"{entry}: {note}", flush=True)
        from ms_llm.training.trainer import run
        run(cfg)
    except ConfigError as e:
        print(f"{entry}: {explain(str(e))}", file=sys.stderr, flush=True)
        return 2
    except DCPError as e:   # a checkpoint that cannot be resumed from or written beside
        print(f"{entry}: checkpoint error: {' '.join(str(e).split())}", file=sys.stderr,
              flush=True)
        return 2
    except FloatingPointError as e:   # training.nan_policy
        print(f"training stopped: {e}", file=sys.stderr, flush=True)
        return 3
    return 0
