"""``ms-llm`` console entry: ``train``, ``plot``, ``convert``, ``export``, ``checkpoint``,
``preprocess``, ``generate``, ``chat``, ``evaluate``, ``lm-eval``..."""
from __future__ import annotations

import argparse
import os
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


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _top_parser()
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "train":
        from ms_llm.train import main as train_main
        return train_main(rest)
    if command == "plot":
        p = argparse.ArgumentParser(prog="ms-llm plot", description=COMMANDS["plot"])
        p.add_argument("output_dir")
        p.add_argument("--out", default=None, help="PNG path (default <output_dir>/loss.png)")
        args = p.parse_args(rest)
        from ms_llm.training.plot import plot_loss
        try:
            print(plot_loss(args.output_dir, args.out))
        except (FileNotFoundError, ValueError) as e:
            print(f"ms-llm plot: {e}", file=sys.stderr)
            return 2
        return 0
    if command == "preprocess":
        from ms_llm.data.preprocess import main as preprocess_main
        return preprocess_main(rest)
    if command == "convert":
        from ms_llm.checkpoint.convert import main as convert_main
        return convert_main(rest)
    if command == "export":
        return export_main(rest)
    if command == "checkpoint":
        from ms_llm.checkpoint.verify import main as checkpoint_main
        return checkpoint_main(rest)
    if command == "schedule":
        from ms_llm.training.schedule_cli import main as schedule_main
        return schedule_main(rest)
    if command == "plan":
        from ms_llm.training.memory_plan_cli import main as plan_main
        return plan_main(rest)
    if command == "qualify":
        from ms_llm.qualify.cli import main as qualify_main
        return qualify_main(rest)
    if command == "evaluate":
        from ms_llm.evaluation.cli import main as evaluate_main
        return evaluate_main(rest)
    if command == "lm-eval":
        from ms_llm.evaluation.lm_eval_cli import lm_eval_main
        return lm_eval_main(rest)
    if command in ("generate", "chat"):
        from ms_llm import inference_cli   # outside the package: its __init__ imports MindSpore
        return (inference_cli.generate_main if command == "generate"
                else inference_cli.chat_main)(rest)
    if command in _LATER:
        p = argparse.ArgumentParser(prog=f"ms-llm {command}",
                                    description=f"{_LATER[command]}: not available yet")
        p.parse_known_args(rest)  # --help prints the usage and exits 0
        print(f"ms-llm {command}: not available yet ({_LATER[command]} is not implemented)",
              file=sys.stderr)
        return 2
    parser.parse_args(argv)  # prints the choices error
    return 2


def export_main(argv: List[str]) -> int:
    """``ms-llm export CKPT OUT --format hf|megatron``: a training checkpoint (the distributed
    format of ``checkpoint.save_dir``, any layout it was saved with) as a Hugging Face folder or
    a Megatron legacy folder. ``CKPT`` is an ``iter_*`` directory or a save_dir (its newest
    complete checkpoint)."""
    p = argparse.ArgumentParser(prog="ms-llm export", description=export_main.__doc__)
    p.add_argument("checkpoint")
    p.add_argument("out_dir")
    p.add_argument("--format", choices=("hf", "megatron"), default="hf")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: as saved)")
    p.add_argument("--target-tensor-parallel-size", type=int, default=1, dest="tp")
    p.add_argument("--target-pipeline-parallel-size", type=int, default=1, dest="pp")
    p.add_argument("--target-expert-parallel-size", type=int, default=1, dest="ep")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=None, dest="divisible")
    p.add_argument("--lora-only", action="store_true",
                   help="LoRA checkpoint: write the adapters in PEFT's layout instead of merged "
                        "weights")
    p.add_argument("--base", default=None,
                   help="LoRA checkpoint: its base folder, if moved (default: the recorded one)")
    args = p.parse_args(argv)
    from ms_llm.checkpoint import dcp, dcp_export
    try:
        path = args.checkpoint
        if not os.path.basename(os.path.normpath(path)).startswith("iter_"):
            latest = dcp.find_latest_complete(path)
            if latest is None:
                raise dcp.DCPError(f"{path}: no complete checkpoint found")
            path = latest
        from ms_llm.checkpoint import lora_export
        if lora_export.is_lora_checkpoint(path):
            out = lora_export.export_peft(path, args.out_dir) if args.lora_only else \
                lora_export.export_merged(path, args.out_dir, fmt=args.format, dtype=args.dtype,
                                          base=args.base, tp=args.tp, pp=args.pp, ep=args.ep,
                                          divisible=args.divisible)
        elif args.lora_only or args.base:
            raise ValueError(f"--lora-only / --base: {path} is not a LoRA checkpoint")
        elif args.format == "hf":
            out = dcp_export.export_hf(path, args.out_dir, dtype=args.dtype)
        else:
            out = dcp_export.export_megatron(path, args.out_dir, tp=args.tp, pp=args.pp,
                                             ep=args.ep, dtype=args.dtype,
                                             make_vocab_size_divisible_by=args.divisible)
    except (dcp.DCPError, ValueError, FileNotFoundError) as e:
        print(f"ms-llm export: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
