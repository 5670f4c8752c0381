"""``ms-llm convert``'s command line: MindSpeed-LLM's ``convert_ckpt_v2.py`` flags, the ones
accepted for compatibility, and the ones refused with one line because they ask for something
this converter has no counterpart for."""
from __future__ import annotations

import argparse
from typing import List, Optional

import ml_dtypes
import numpy as np

from ms_llm.models import layouts as L
from ms_llm.parallel.pipeline.schedules import all_schedules

DTYPES = {"fp32": np.dtype(np.float32), "bf16": np.dtype(ml_dtypes.bfloat16),
          "fp16": np.dtype(np.float16), "float32": np.dtype(np.float32),
          "bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16)}


class ConvertError(ValueError):
    """Bad arguments or input for the converter (reported as one line)."""


class _ArgParser(argparse.ArgumentParser):
    def error(self, message):
        raise ConvertError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _ArgParser(prog="ms-llm convert", allow_abbrev=False,
                   description="Convert checkpoints between Hugging Face and Megatron layouts.")
    p.add_argument("--load-model-type", choices=["hf", "mg"], required=True)
    p.add_argument("--save-model-type", choices=["hf", "mg"], required=True)
    p.add_argument("--load-dir", required=True)
    p.add_argument("--save-dir", required=True)
    p.add_argument("--model-type-hf", default=None, choices=sorted(L.megatron_names()))
    p.add_argument("--target-tensor-parallel-size", type=int, default=1)
    p.add_argument("--target-pipeline-parallel-size", type=int, default=1)
    p.add_argument("--target-expert-parallel-size", type=int, default=1)
    p.add_argument("--expert-tensor-parallel-size", type=int, default=None)
    p.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    p.add_argument("--num-layer-list", default=None)
    p.add_argument("--noop-layers", default=None)
    p.add_argument("--moe-grouped-gemm", action="store_true")
    p.add_argument("--params-dtype", choices=sorted(DTYPES), default=None)
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=None)
    p.add_argument("--max-shard-size", default="5GB")
    p.add_argument("--save-layer-by-layer", action="store_true",
                   help="accepted for compatibility; conversion always streams layer by layer")
    p.add_argument("--hf-cfg-dir", default=None,
                   help="mg -> hf: the original HF folder; its config.json describes the output "
                        "and its tokenizer / generation_config files are copied beside it")
    p.add_argument("--num-layers", type=int, default=None,
                   help="accepted when it equals the checkpoint's layer count")
    p.add_argument("--model-type", choices=["GPT"], default="GPT", help="accepted (GPT only)")
    p.add_argument("--use-mcore-models", action="store_true",
                   help="accepted for compatibility; checkpoints always use Megatron-Core names")
    for flag, kind, why in _REFUSED:
        p.add_argument(flag, help=f"not supported: {why}", **kind)
    p.add_argument("--lora-load", default=None,
                   help="merge LoRA adapters into the weights: an ms-llm LoRA training "
                        "checkpoint (iter_* or save_dir) or a PEFT adapter folder")
    p.add_argument("--lora-r", type=int, default=None)
    p.add_argument("--lora-alpha", type=int, default=None)
    p.add_argument("--lora-target-modules", nargs="*", default=None)
    p.add_argument("--allow-non-finite", action="store_true",
                   help="convert tensors holding NaN/inf (refused by default)")
    p.add_argument("--mtp-num-layers", type=int, default=None,
                   help="multi-token prediction depths to convert: the checkpoint's "
                        "(num_nextn_predict_layers, the default) or 0 to drop them")
    return p


_FLAG, _INT, _MAMBA = dict(action="store_true"), dict(type=int), "Mamba models are not built"
# MindSpeed-LLM flags that parse (its scripts carry over) and are refused with one line when
# given a value: what they ask for has no counterpart here.
_REFUSED = [
    ("--pipeline-model-parallel-layout", {}, "custom layouts; use --num-layer-list, "
     "--num-layers-per-virtual-pipeline-stage and --noop-layers"),
    ("--moe-tp-extend-ep", _FLAG, "experts are split by expert parallel only"),
    ("--mla-mm-split", _FLAG, "MLA up-projections are written whole (linear_qb / linear_kvb)"),
    ("--schedules-method", dict(choices=[s.method for s in all_schedules() if s.mindspeed]),
     "Megatron's round-robin stage order only"),
    ("--first-k-dense-replace", _INT, "the dense layers come from config.json "
     "(first_k_dense_replace, or mlp_only_layers / decoder_sparse_step)"),
    ("--input-tp-rank", _INT, "the whole checkpoint is converted"),
    ("--input-pp-rank", _INT, "the whole checkpoint is converted"),
    ("--transformer-impl", dict(choices=["local", "transformer_engine"], default="local"),
     "checkpoints use the local spec's parameter names"),
    ("--hidden-size", _INT, _MAMBA), ("--mamba-state-dim", _INT, _MAMBA),
    ("--mamba-num-groups", _INT, _MAMBA), ("--mamba-head-dim", _INT, _MAMBA),
    ("--save-lora-to-hf", _FLAG, "--lora-load merges the adapters; ms-llm export --lora-only "
     "writes them in PEFT's layout"),
    ("--load-checkpoint-loosely", _FLAG, "every tensor is read strictly; missing or extra "
     "weights are an error"),
]


def _refuse_unsupported(opts: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """One line for the first MindSpeed flag given a value this converter cannot honour."""
    for flag, _, why in _REFUSED:
        dest = flag[2:].replace("-", "_")
        value = getattr(opts, dest)
        if value != parser.get_default(dest):
            raise ConvertError(f"{flag}{'' if value is True else f' {value}'}: not supported "
                               f"({why})")
    if not opts.lora_load and (opts.lora_r or opts.lora_alpha or opts.lora_target_modules):
        raise ConvertError("--lora-r/--lora-alpha/--lora-target-modules describe the adapters "
                           "of --lora-load, which is missing")
    if opts.hf_cfg_dir and not (opts.load_model_type == "mg" and opts.save_model_type == "hf"):
        raise ConvertError(f"--hf-cfg-dir applies to mg -> hf only (for {opts.load_model_type} "
                           f"-> {opts.save_model_type} the HF config comes from "
                           f"{'--load-dir' if opts.load_model_type == 'hf' else 'the checkpoint'})")


def _check_num_layers(opts: argparse.Namespace, spec: L.ModelSpec) -> None:
    """MindSpeed's ``--num-layers`` (real layers, or with ``--noop-layers`` counted) must be the
    checkpoint's: converting a subset of the layers is not supported."""
    noop = len(_int_list(opts.noop_layers, "--noop-layers") or ())
    if opts.num_layers is not None and opts.num_layers not in (spec.num_layers,
                                                              spec.num_layers + noop):
        raise ConvertError(f"--num-layers {opts.num_layers}: the checkpoint has "
                           f"{spec.num_layers} decoder layers (converting a subset of the layers "
                           f"is not supported)")


def _int_list(text: Optional[str], flag: str) -> Optional[List[int]]:
    if text is None:
        return None
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise ConvertError(f"{flag}: expected comma-separated integers, got {text!r}") from None
