"""The value rules of the run config: what each key's value must be (positive sizes, rates,
probabilities, choices, existing folders). ``parse`` checks them on every explicitly set
key right after its type, so the error names the key's source; ``help`` prints them.
The cross-key and launch rules are in ``rules``."""
from __future__ import annotations

import os
from typing import Any, Dict, Optional

from ms_llm.optim.kinds import optimizer_names, optimizer_value_rule
from ms_llm.validation import Rule, at_least, greater_than, one_of, value_rule, within


class ConfigError(ValueError):
    """A bad config: the message is one line naming the file/argument and the key."""


# ------------------------------------------------------------------------------ value rules
# A rule returns None for a good value, else what the value must be. Rules run on every
# explicitly set key right after its type is checked, so the error names that key's source
# (and nothing downstream, e.g. TransformerConfig's head arithmetic, sees a zero or a negative).
# The rule builders are ``ms_llm.validation``'s (a registered optimizer's keys use them too).
_rule, _gt, _ge, _within, _one_of = value_rule, greater_than, at_least, within, one_of


def _one_of_int(*choices: int) -> Rule:
    return _rule("one of " + ", ".join(map(str, choices)), lambda v: v in choices)


def _existing_dir() -> Rule:
    return _rule("an existing folder", lambda v: os.path.isdir(os.path.expanduser(v)))


class _RegisteredOptimizer:
    """``training.optimizer``'s rule: a registered optimizer (``ms_llm.optim.kinds``), asked when
    the value is checked, so one registered after this module was imported counts too."""

    @property
    def desc(self) -> str:
        return "one of " + ", ".join(optimizer_names())

    def __call__(self, value: Any) -> Optional[str]:
        return None if value in optimizer_names() else self.desc


_POSITIVE, _NON_NEGATIVE, _PROBABILITY = _gt(0), _ge(0), _within(0, 1)
_DTYPES = ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16")
RULES: Dict[str, Rule] = {
    **{f"training.{k}": _POSITIVE for k in (
        "max_steps", "micro_batch_size", "global_batch_size", "log_interval", "lr_decay_steps",
        "peak_tflops")},
    **{f"training.{k}": _NON_NEGATIVE for k in (
        "seed", "lr", "min_lr", "lr_warmup_steps", "weight_decay", "clip_grad")},
    "training.lr_decay_style": _one_of("cosine", "linear", "constant", "inverse-square-root",
                                       "WSD"),
    "training.lr_wsd_decay_style": _one_of("linear", "cosine", "exponential", "minus_sqrt"),
    "training.lr_warmup_fraction": _within(0, 1, hi_open=True),
    **{f"training.{k}": _POSITIVE for k in (
        "train_samples", "lr_decay_samples", "lr_wsd_decay_samples", "lr_wsd_decay_steps")},
    **{f"training.{k}": _NON_NEGATIVE for k in ("lr_warmup_init", "lr_warmup_samples")},
    # the optimizer's own keys (adam_*, muon_*) are its registration's (``optimizer_value_rule``)
    "training.optimizer": _RegisteredOptimizer(),
    "training.resume": _one_of("none", "auto"),
    "training.recompute_granularity": _one_of("full", "selective", null=True),
    "training.recompute_method": _one_of("uniform", "block", null=True),
    "training.recompute_num_layers": _ge(1),
    "training.device": _one_of("auto", "cpu", "ascend", case=False),
    "training.stage": _one_of("dpo", null=True),
    "training.eval_interval": _ge(1),
    "training.eval_iters": _ge(1),
    "training.max_restarts": _NON_NEGATIVE,
    "training.nan_policy": _one_of("stop", "skip"),
    "training.max_skipped_steps": _NON_NEGATIVE,
    "training.timing_log_level": _one_of_int(0, 1, 2),
    "training.profile_step_start": _ge(1),
    "training.profile_step_end": _ge(1),
    "training.profile_ranks": _NON_NEGATIVE,
    "dpo.beta": _POSITIVE,
    "dpo.loss_type": _one_of("sigmoid", "hinge", "ipo"),
    "dpo.label_smoothing": _within(0, 0.5, hi_open=True),
    **{f"data.{k}": _POSITIVE for k in (
        "seq_length", "embedded_vocab_size", "make_vocab_size_divisible_by")},
    "data.dataset_type": _one_of("pretrain", "sft"),
    **{f"parallel.{k}": _ge(1) for k in (
        "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
        "expert_model_parallel_size", "fsdp_size", "virtual_pipeline_model_parallel_size")},
    "parallel.ddp_bucket_mb": _POSITIVE,
    "parallel.context_parallel_algo": _one_of("megatron_cp_algo", "ulysses_cp_algo",
                                              "hybrid_cp_algo"),
    "parallel.ulysses_degree_in_cp": _ge(1),
    "parallel.collective_timeout_s": _POSITIVE,
    "parallel.fsdp_prefetch": _NON_NEGATIVE,
    "parallel.fsdp_param_dtype": _one_of(*_DTYPES, null=True, case=False),
    "parallel.fsdp_reduce_dtype": _one_of(*_DTYPES, null=True, case=False),
    "checkpoint.save_interval": _NON_NEGATIVE,
    "checkpoint.keep_last": _ge(1),
    "checkpoint.load": _existing_dir(),
    "checkpoint.format": _one_of("ms_llm", "torch_dist", "torch"),
    "checkpoint.resume_from": _existing_dir(),
    "quant.recipe": _one_of("mxfp8", null=True),
    "quant.scale_mode": _one_of("floor", "rceil"),
    "quant.elem_dtype": _one_of("float8_e4m3fn", "float8_e5m2"),
    "lora.r": _NON_NEGATIVE,
    "lora.alpha": _POSITIVE,
    "lora.dropout": _within(0, 1, hi_open=True),
    "lora.target_modules": _rule(
        "linear_qkv, linear_proj, linear_fc1, linear_fc2 (Gated DeltaNet: in_proj_qkvz, "
        "in_proj_ba, out_proj; latent attention: linear_q_proj, linear_q_down_proj, "
        "linear_q_up_proj, linear_kv_down_proj, linear_kv_up_proj) or a glob ending in one of them",
        lambda v: v.rsplit(".", 1)[-1] in ("linear_qkv", "linear_proj", "linear_fc1",
                                           "linear_fc2", "in_proj_qkvz", "in_proj_ba",
                                           "out_proj", "linear_q_proj", "linear_q_down_proj",
                                           "linear_q_up_proj", "linear_kv_down_proj",
                                           "linear_kv_up_proj", "*")),
    "quant.mx_path": _one_of("auto", "native", "emulated"),
    "quant.mx_unaligned": _one_of("keep", "error"),
    "runtime.log_level": _one_of("debug", "info", "warning", "error", "critical", case=False),
    "runtime.cpu_threads": _ge(1),
    "runtime.blas_threads": _ge(1),
    "runtime.bf16_gemm": _one_of("auto", "mkl", "openblas", "dnnl"),
    "moe.dispatcher": _one_of("alltoall", "megamoe"),
    "moe.expert_groups": _ge(1),
    "moe.token_chunks": _ge(1),
    **{f"model.{k}": _POSITIVE for k in (
        "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
        "kv_channels", "padded_vocab_size", "max_position_embeddings", "layernorm_epsilon",
        "rotary_base", "num_moe_experts", "moe_ffn_hidden_size",
        "moe_shared_expert_intermediate_size", "moe_router_topk_scaling_factor")},
    **{f"model.{k}": _NON_NEGATIVE for k in (
        "init_method_std", "moe_aux_loss_coeff", "moe_z_loss_coeff",
        "moe_router_bias_update_rate", "mtp_num_layers", "mtp_loss_scaling_factor")},
    "model.moe_router_topk": _ge(1),
    "model.moe_layer_freq": _ge(1),
    "model.hidden_dropout": _PROBABILITY,
    "model.attention_dropout": _PROBABILITY,
    "model.rotary_percent": _within(0, 1),
    "model.qk_clip_alpha": _within(0, 1),
    "model.qk_clip_threshold": _POSITIVE,
    "model.normalization": _one_of("RMSNorm"),
    "model.position_embedding_type": _one_of("rope", "yarn"),
    **{f"model.{k}": _POSITIVE for k in (
        "yarn_rotary_scaling_factor", "yarn_original_max_position_embeddings", "yarn_beta_fast",
        "yarn_beta_slow")},
    "model.activation_func": _one_of("silu", "gelu"),
    "model.mlp_type": _one_of("dense", "moe"),
    "model.moe_router_score_function": _one_of("softmax", "sigmoid"),
    "model.moe_router_load_balancing_type": _one_of("aux_loss", "seq_aux_loss", "none"),
    **{f"model.{k}": _POSITIVE for k in (
        "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
        "moe_router_num_groups", "moe_router_group_topk")},
}


def rule_for(key: str) -> Optional[Rule]:
    """The value rule of ``key``: the table's, or the registered optimizer's that owns it."""
    return RULES.get(key) or optimizer_value_rule(key)


def check_value(key: str, value: Any, source: str) -> None:
    rule = rule_for(key)
    if rule is None or value is None:
        return
    for v in value if isinstance(value, list) else [value]:
        need = rule(v)
        if need is not None:
            raise ConfigError(f"{source}: {key} must be {need}, got {v!r}")
