"""``ms-llm lm-eval ARGS``: lm-evaluation-harness's command line with the ``ms-llm`` model
registered (the harness is imported only here, so ``--help`` works without the ``eval`` extra)."""
from __future__ import annotations

import sys
from typing import List

USAGE = """usage: ms-llm lm-eval [lm-eval arguments ...]

lm-evaluation-harness's own command line (`lm_eval ...`) with the `ms-llm` model registered:
  ms-llm lm-eval --model ms-llm --model_args pretrained=DIR[,max_length=N,
      tokenizer=PATH,dtype=bfloat16,add_bos_token=true] --tasks TASKS [--batch_size N]
The harness's options follow.
"""


def main(argv: List[str]) -> int:
    """``ms-llm lm-eval ARGS``: the harness's ``lm_eval ARGS`` with ``ms-llm`` registered."""
    if argv in (["-h"], ["--help"]):
        print(USAGE, flush=True)
    try:
        from ms_llm.evaluation.lm_eval_backend import register
    except ImportError as e:
        if argv in (["-h"], ["--help"]):
            print(f"({e})")
            return 0
        print(f"ms-llm lm-eval: {e}", file=sys.stderr)
        return 2
    register()
    from lm_eval.__main__ import cli_evaluate
    saved = sys.argv
    sys.argv = ["lm-eval", *argv]
    try:
        cli_evaluate()
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = saved
    return 0
