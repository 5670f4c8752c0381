"""``ms-llm export``: a training checkpoint as a Hugging Face or Megatron folder (the export
itself is ``checkpoint.native.export`` / ``checkpoint.adapters.export``)."""
from __future__ import annotations

import argparse
import os
import sys
from typing import List


def main(argv: List[str]) -> int:
    """``ms-llm export CKPT OUT --format hf|megatron``: a training checkpoint (the distributed
    format of ``checkpoint.save_dir``, any layout it was saved with) as a Hugging Face folder or
    a Megatron legacy folder. ``CKPT`` is an ``iter_*`` directory or a save_dir (its newest
    complete checkpoint)."""
    p = argparse.ArgumentParser(prog="ms-llm export", description=main.__doc__)
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
    from ms_llm.checkpoint.native import dcp, export as dcp_export
    try:
        path = args.checkpoint
        if not os.path.basename(os.path.normpath(path)).startswith("iter_"):
            latest = dcp.find_latest_complete(path)
            if latest is None:
                raise dcp.DCPError(f"{path}: no complete checkpoint found")
            path = latest
        from ms_llm.checkpoint.adapters import export as lora_export
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
