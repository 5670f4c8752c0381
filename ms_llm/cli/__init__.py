"""``ms-llm`` console entry: ``train``, ``plot``, ``convert``, ``export``, ``checkpoint``,
``preprocess``, ``generate``, ``chat``, ``evaluate``, ``lm-eval``... Each command's argument
parsing is its own module here (``ms_llm.cli.train``, ``ms_llm.cli.lm_eval`` for ``lm-eval``);
the work it asks for stays in the library packages."""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Callable, List, Optional

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


# The commands that run a model with no run config: their device (``MS_LLM_DEVICE``, else
# MindSpore's default) is chosen before they read a file, so one that cannot be used stops them
# at once. ``train`` and the MindSpeed entries choose theirs from the run config
# (``ms_llm.training.trainer.run``); the other commands never touch a device.
RUNS_A_MODEL = ("generate", "chat", "evaluate", "lm-eval")

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

    def start() -> int:
        if command in RUNS_A_MODEL and not {"-h", "--help"} & set(rest):
            from ms_llm.compat import setup_device
            setup_device()
        return importlib.import_module(module).main(rest)
    return run_command(start)


def run_command(command: Callable[[], int], prefix: str = "") -> int:
    """Run a command's ``main``; a device it cannot use ends it with one line
    ``device error: ...`` on stderr and exit code 2, the same for every command (``ms-llm``'s and
    the ``pretrain_gpt.py`` / ``posttrain_gpt.py`` entries). The device is chosen where the
    command first needs it (``ms_llm.compat.setup_device``), which raises
    ``DeviceUnavailableError``: ``training.device`` / ``MS_LLM_DEVICE`` Ascend on a MindSpore that
    cannot use it (the plugin's load error, a CPU build), or ``quant.mx_path native`` without
    MindSpore's MX ops."""
    try:
        return command()
    except RuntimeError as e:
        device = sys.modules.get("ms_llm.compat.device")   # not loaded: not a device error
        if device is None or not isinstance(e, device.DeviceUnavailableError):
            raise
        print(f"{prefix}device error: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
        return 2
