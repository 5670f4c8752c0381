"""Cross-key rules of ``training.stage: dpo`` and of evaluation (``training.eval_interval``),
kept out of ``config.py`` so the schema file stays small. Each rule returns the keys the
message is about (their source is named) and the message, or None."""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

Problem = Optional[Tuple[Sequence[str], str]]


def stage_problem(cfg) -> Problem:
    t, p, m = cfg.training, cfg.parallel, cfg.model
    dpo_keys = sorted(k for k in cfg.sources if k.startswith("dpo."))
    if t.stage != "dpo":
        if dpo_keys:
            return (dpo_keys[0], "training.stage"), \
                f"{dpo_keys[0]} is set but training.stage is not dpo"
    else:
        if not cfg.data.data_path:
            return ("training.stage", "data.data_path"), (
                "training.stage dpo needs data.data_path: the prefix `ms-llm preprocess "
                "--handler-name AlpacaStylePairwiseHandler` (or SharegptStylePairwiseHandler) wrote")
        if p.pipeline_model_parallel_size > 1:
            return ("training.stage", "parallel.pipeline_model_parallel_size"), (
                "training.stage dpo with parallel.pipeline_model_parallel_size > 1 is not built "
                "yet (data, tensor and fully-sharded data parallel are)")
        if m.hidden_dropout > 0 or m.attention_dropout > 0:
            return ("model.hidden_dropout", "model.attention_dropout", "training.stage"), (
                "training.stage dpo needs model.hidden_dropout and model.attention_dropout 0 "
                "(policy and reference log-probs must come from the same deterministic forward, "
                "as TRL's disable_dropout)")
        if cfg.lora.r and cfg.lora.dropout > 0:
            return ("lora.dropout", "training.stage"), (
                "training.stage dpo needs lora.dropout 0 (as TRL's disable_dropout: the policy "
                "and the adapters-off reference must see the same deterministic forward)")
        if cfg.dpo.label_smoothing > 0 and cfg.dpo.loss_type != "sigmoid":
            return ("dpo.label_smoothing", "dpo.loss_type"), (
                f"dpo.label_smoothing applies to dpo.loss_type sigmoid only, not "
                f"{cfg.dpo.loss_type}")
    if t.eval_interval is not None and p.pipeline_model_parallel_size > 1:
        return ("training.eval_interval", "parallel.pipeline_model_parallel_size"), (
            "training.eval_interval with parallel.pipeline_model_parallel_size > 1 is not built "
            "yet (evaluation runs on data, tensor and fully-sharded data parallel layouts)")
    return None
