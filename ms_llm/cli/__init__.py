"""``ms-llm`` console entry: ``train``, ``plot``, ``convert``, ``export``, ``checkpoint``,
``preprocess``, ``generate``, ``chat``, ``evaluate``, ``lm-eval``... Each command's argument
parsing is its own module here (``ms_llm.cli.train``, ``ms_llm.cli.lm_eval`` for ``lm-eval``);
the work it asks for stays in the library packages."""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import List, Optional

_LATER = {}
COMMANDS = {
    "train": "train a model (ms-llm train --help lists every config key and its default)",
    "plot": "draw loss.png from a run's metrics.jsonl",
    "convert": "convert weights between Hugging Face and Megatron layouts",
    "export": "export a training checkpoint to Hugging Face or Megatron",
    "checkpoint": "verify training checkpoints (ms-llm checkpoint verify DIR: sizes and crc32)",
    "preprocess": "tokenize text into Megatron indexed datasets",
    "generate": "generate text from a prompt (HF, Megatron or training checkpoint)",
    "chat": "chat on stdin with the tokenizer's chat template",
    "schedule": "print the pipeline schedule a config would run",
    "plan": "per-rank memory of a config and layout before launch, and what makes it fit",
    "qualify": "run every model family x layout as real jobs; write support.md (Pass / Test)",
    "evaluate": "score a checkpoint on MMLU / C-Eval / BoolQ / GSM8K / HumanEval files",
    "lm-eval": "lm-evaluation-harness's own command line with the ms-llm model registered",
    **{name: f"{what} (not available yet)" for name, what in _LATER.items()},
}


def _top_parser() -> argparse.ArgumentParser:
    commands = "\n".join(f"  {name:<12} {text}" for name, text in COMMANDS.items())
    parser = argparse.ArgumentParser(
        prog="ms-llm", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="MindSpore-native LLM training.",
        epilog=f"commands:\n{commands}\n\nms-llm COMMAND --help shows a command's options.")
    parser.add_argument("command", choices=list(COMMANDS))
    return parser


# The commands whose command line lives with its library (``qualify`` runs them in-process, and
# it sits below ``cli``); every other command is the module ``ms_llm.cli.<command>``.
_ELSEWHERE = {"convert": "ms_llm.checkpoint.convert", "preprocess": "ms_llm.data.preprocess"}


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _top_parser()
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command in _LATER:
        p = argparse.ArgumentParser(prog=f"ms-llm {command}",
                                    description=f"{_LATER[command]}: not available yet")
        p.parse_known_args(rest)  # --help prints the usage and exits 0
        print(f"ms-llm {command}: not available yet ({_LATER[command]} is not implemented)",
              file=sys.stderr)
        return 2
    if command not in COMMANDS:
        parser.parse_args(argv)  # prints the choices error
        return 2
    # Imported only when run: most commands import MindSpore, --help must not wait for it.
    module = _ELSEWHERE.get(command, f"ms_llm.cli.{command.replace('-', '_')}")
    return importlib.import_module(module).main(rest)
