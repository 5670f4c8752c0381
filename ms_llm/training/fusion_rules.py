"""Cross-key rules of ``model.cross_entropy_loss_fusion`` (the chunked output layer + cross
entropy, ``ms_llm.ops.fused_cross_entropy``), kept out of ``config.py``. Returns the keys the
message is about and the message, or None."""
from __future__ import annotations

import fnmatch
from typing import Optional, Sequence, Tuple

Problem = Optional[Tuple[Sequence[str], str]]

# The layouts whose output layer is not the plain one-process head the fused op reads.
_LAYOUTS = (("tensor_model_parallel_size", "the vocabulary-parallel cross entropy"),
            ("pipeline_model_parallel_size", "the last pipeline stage's head"),
            ("context_parallel_size", "context parallel"),
            ("fsdp_size", "FSDP's gathered output weight"))


def cross_entropy_fusion_problem(cfg) -> Problem:
    if not cfg.model.cross_entropy_loss_fusion:
        return None
    for key, what in _LAYOUTS:
        if getattr(cfg.parallel, key) > 1:
            return ("model.cross_entropy_loss_fusion", f"parallel.{key}"), (
                f"model.cross_entropy_loss_fusion with parallel.{key} > 1 is not built yet "
                f"({what}); data parallel and the distributed optimizer are")
    if cfg.lora.r and any(t == "output_layer" or fnmatch.fnmatchcase("output_layer", t)
                          for t in cfg.lora.target_modules):
        return ("model.cross_entropy_loss_fusion", "lora.target_modules"), (
            "model.cross_entropy_loss_fusion with a LoRA adapter on output_layer is not built "
            "yet (the fused op reads the plain output weight)")
    return None
