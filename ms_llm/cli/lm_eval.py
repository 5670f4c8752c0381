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
    except Exception as e:   # a missing task, unreadable data, a bad --model_args: one line
        print(f"ms-llm lm-eval: {one_line(e)}", file=sys.stderr, flush=True)
        return 2
    finally:
        sys.argv = saved
    return 0


def one_line(e: BaseException) -> str:
    """``e`` and the error it was raised from (the harness and ``datasets`` wrap the real
    cause: "An error occurred while generating the dataset" from a JSON decode error)."""
    parts = []
    while e is not None and len(parts) < 3:
        text = " ".join(str(e).split()) or type(e).__name__
        parts.append(f"{type(e).__name__}: {text}")
        e = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
    return parts[0] + "".join(f" (from {p})" for p in parts[1:])
