"""Every rule of the run config, in one place, all checked when the config is loaded (before
anything starts); the loaded config is then frozen (``config.RunConfig.freeze``).

* Value rules (``RULES``, in ``values``): what each key's value must be, checked on every
  explicitly set key right after its type, so the error names the key's source.
* Cross-key rules (``validate``): combinations of keys, including the stage (DPO, evaluation),
  bf16, fused cross entropy, pipeline, context parallel and MoE rules.
* Launch rules (``check_launch``): the ones that need the worker count.
"""
from __future__ import annotations

import fnmatch
from typing import Sequence, Tuple, Optional

from ms_llm.config.values import RULES, ConfigError, check_value  # noqa: F401 (re-exported)
from ms_llm.optim.kinds import get_optimizer


# ------------------------------------------------------------------------------ cross-key rules
# Rules that involve more than one key, all run by ``validate`` when the config is loaded
# (before any process starts); ``check_launch`` adds the ones that need the worker count.
# A ``Problem`` rule returns the keys the message is about (the first explicitly set one names
# its source) and the message, or None.
Problem = Optional[Tuple[Sequence[str], str]]


def validate(cfg) -> None:
    """Checks that involve more than one key (single values were checked while parsing). Each
    error names the source of the key it is about."""
    for check in CROSS_KEY_CHECKS:
        check(cfg)
    for rule in CROSS_KEY_RULES:
        problem = rule(cfg)
        if problem is not None:
            _fail(cfg, problem[0], problem[1])


def _fail(cfg, keys: Sequence[str], message: str) -> None:
    raise ConfigError(f"{cfg.source_of(*keys)}: {message}")


def _check_schedule(cfg) -> None:
    """Megatron's scheduler rules (training/lr_schedule.py applies the schedule). A sample-based
    run (``training.train_samples``) has ``max_steps`` = ``train_samples // global_batch_size``
    (``schema.load_config`` derives it) unless it was set explicitly (then they must agree)."""
    t = cfg.training
    if t.train_samples:
        iters = t.train_samples // t.global_batch_size
        if iters < 1:
            _fail(cfg, ("training.train_samples",), f"training.train_samples ({t.train_samples}) "
                  f"is less than one global batch ({t.global_batch_size})")
        if "training.max_steps" in cfg.sources and t.max_steps != iters:
            _fail(cfg, ("training.max_steps", "training.train_samples"),
                  f"training.max_steps ({t.max_steps}) disagrees with training.train_samples "
                  f"// global_batch_size ({iters}); set one of them")
    if t.lr_warmup_init > t.lr:
        _fail(cfg, ("training.lr_warmup_init", "training.lr"),
              f"training.lr_warmup_init ({t.lr_warmup_init}) must be <= training.lr ({t.lr})")
    wsd = t.lr_wsd_decay_samples if t.train_samples else t.lr_wsd_decay_steps
    if t.lr_decay_style == "WSD" and not wsd:
        _fail(cfg, ("training.lr_decay_style",), "training.lr_decay_style WSD needs "
              "training.lr_wsd_decay_steps (lr_wsd_decay_samples for a sample-based run)")
    if t.min_lr > t.lr:
        _fail(cfg, ("training.min_lr", "training.lr"),
              f"training.min_lr ({t.min_lr}) must be <= training.lr ({t.lr})")


def _check_parallel(cfg) -> None:
    p = cfg.parallel
    if p.context_parallel_size != 1:
        from ms_llm.parallel.context_parallel.config_check import check_context_parallel
        check_context_parallel(cfg, _fail)
    _check_pipeline(cfg)
    if p.use_distributed_optimizer and p.fsdp_size > 1:
        _fail(cfg, ("parallel.use_distributed_optimizer", "parallel.fsdp_size"),
              "parallel.use_distributed_optimizer with parallel.fsdp_size > 1: FSDP already "
              "shards the optimizer state; use one of them")
    if p.sequence_parallel and p.tensor_model_parallel_size == 1:
        _fail(cfg, ("parallel.sequence_parallel",),
              "parallel.sequence_parallel needs parallel.tensor_model_parallel_size > 1")
    if p.tp_comm_overlap and not p.sequence_parallel:
        _fail(cfg, ("parallel.tp_comm_overlap",),
              "parallel.tp_comm_overlap overlaps the sequence-parallel exchanges: it needs "
              "parallel.sequence_parallel true (as Megatron's --tp-comm-overlap does)")


def _check_moe(cfg) -> None:
    p, m = cfg.parallel, cfg.model
    ep, moe = p.expert_model_parallel_size, m.mlp_type == "moe"
    ep_key = "parallel.expert_model_parallel_size"
    if ep > 1 and not moe:
        _fail(cfg, (ep_key, "model.mlp_type"),
              f"parallel.expert_model_parallel_size={ep} needs model.mlp_type moe")
    if not moe:
        return
    if m.num_moe_experts % ep:
        _fail(cfg, (ep_key, "model.num_moe_experts"),
              f"model.num_moe_experts ({m.num_moe_experts}) is not divisible by "
              f"parallel.expert_model_parallel_size ({ep})")
    if p.tensor_model_parallel_size > 1:
        _fail(cfg, ("parallel.tensor_model_parallel_size", "model.mlp_type"),
              "model.mlp_type moe with parallel.tensor_model_parallel_size > 1 is not "
              "supported (expert tensor parallel is not built); use expert and data parallel")


def _check_pipeline(cfg) -> None:
    """Megatron's and MindSpeed's stage rules, checked before any process starts."""
    from ms_llm.parallel.pipeline.stages import check_noop_layers, layer_ranges
    p, n = cfg.parallel, cfg.model.num_layers
    pp, vpp = p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size
    keys = ("parallel.pipeline_model_parallel_size", "parallel.virtual_pipeline_model_parallel_size",
            "parallel.num_layer_list", "parallel.noop_layers", "model.num_layers")
    if vpp > 1 and pp == 1:
        _fail(cfg, keys[1:2], "parallel.virtual_pipeline_model_parallel_size > 1 needs "
                              "parallel.pipeline_model_parallel_size > 1")
    if p.num_layer_list and pp == 1:
        _fail(cfg, keys[2:3], "parallel.num_layer_list needs pipeline_model_parallel_size > 1")
    try:
        layer_ranges(n, pp, vpp, p.num_layer_list or None)
        check_noop_layers(p.noop_layers, n)
    except ValueError as e:
        _fail(cfg, keys, str(e))


def _check_misc(cfg) -> None:
    t = cfg.training
    if t.profile and t.profile_step_end <= t.profile_step_start:
        _fail(cfg, ("training.profile_step_end", "training.profile_step_start"),
              f"training.profile_step_end ({t.profile_step_end}) must be > "
              f"training.profile_step_start ({t.profile_step_start})")
    if cfg.training.resume == "auto" and not cfg.checkpoint.save_dir:
        _fail(cfg, ("training.resume", "checkpoint.save_dir"),
              "training.resume=auto needs checkpoint.save_dir")
    if cfg.training.max_restarts and not cfg.checkpoint.save_dir:
        _fail(cfg, ("training.max_restarts", "checkpoint.save_dir"),
              "training.max_restarts needs checkpoint.save_dir (a restart resumes from it)")


def _check_lora(cfg) -> None:
    if cfg.lora.r and not cfg.checkpoint.load:
        _fail(cfg, ("lora.r", "checkpoint.load"),
              "lora.r > 0 needs checkpoint.load (the base weights the adapters train on)")


def _mtp_problem(cfg) -> Problem:
    if cfg.training.stage == "dpo" and cfg.model.mtp_num_layers:
        return ("training.stage", "model.mtp_num_layers"), (
            "training.stage dpo with model.mtp_num_layers is not built yet (the DPO loss has no "
            "MTP term); set model.mtp_num_layers 0")
    if cfg.parallel.context_parallel_size > 1 and cfg.model.mtp_num_layers:
        return ("model.mtp_num_layers", "parallel.context_parallel_size"), (
            "model.mtp_num_layers with parallel.context_parallel_size > 1 is not built yet "
            "(rolling the tokens would cross the ranks' chunks)")
    return None


def _eval_split_problem(cfg) -> Problem:
    """Evaluation needs a validation part of ``data.split`` (its weight above 0)."""
    if cfg.training.eval_interval is None:
        return None
    parts = [p for p in str(cfg.data.split).replace("/", ",").split(",") if p.strip()]
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        return None     # the data set-up names a malformed split
    if len(weights) >= 2 and weights[1] == 0 and not cfg.data.data_path:
        return ("training.eval_interval", "data.split"), (
            f"training.eval_interval needs validation samples, but data.split "
            f"{cfg.data.split!r} gives none")
    return None


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
    return None


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


def sample_order_problem(cfg) -> Problem:
    """``data.shuffle: false`` / ``data.padded_samples`` order instruction and pairwise samples
    (MindSpeed-LLM's ``DecoderPackedMTFDataset``); Megatron's pretraining datasets keep their
    own shuffle, so there the keys would silently change nothing."""
    d = cfg.data
    if d.shuffle and not d.padded_samples:
        return None
    key = "data.padded_samples" if d.padded_samples else "data.shuffle"
    if not d.data_path or (d.dataset_type != "sft" and cfg.training.stage != "dpo"):
        return (key, "data.dataset_type"), (
            f"{key} orders instruction or pairwise samples (data.data_path with data.dataset_type "
            f"sft, or training.stage dpo), as MindSpeed-LLM's --no-shuffle/--padded-samples; "
            f"pretraining data keeps Megatron's GPTDataset order")
    return None


def bf16_problem(cfg) -> Problem:
    """Combinations with ``training.bf16`` that are not built."""
    t, p, m = cfg.training, cfg.parallel, cfg.model
    if not t.bf16:
        return None
    if m.params_dtype not in ("float32", "fp32") + _LOW:
        return ("training.bf16", "model.params_dtype"), (
            f"training.bf16 with model.params_dtype {m.params_dtype}: leave params_dtype at "
            f"float32 (bf16 sets the model's dtype itself)")
    if not p.grad_reduce_in_fp32 and p.fsdp_size > 1 and p.fsdp_reduce_dtype is not None \
            and p.fsdp_reduce_dtype.lower() not in _LOW:
        return ("parallel.grad_reduce_in_fp32", "parallel.fsdp_reduce_dtype"), (
            f"parallel.grad_reduce_in_fp32 false reduces in bf16, but parallel.fsdp_reduce_dtype "
            f"is {p.fsdp_reduce_dtype} (leave it unset)")
    if p.fsdp_size > 1 and p.fsdp_param_dtype is not None \
            and p.fsdp_param_dtype.lower() not in _LOW:
        return ("training.bf16", "parallel.fsdp_param_dtype"), (
            f"training.bf16 with parallel.fsdp_param_dtype {p.fsdp_param_dtype}: bf16 gathers "
            f"bf16 weights (leave fsdp_param_dtype unset)")
    return None


def optimizer_problem(cfg) -> Problem:
    """Layouts QK-clip (``ms_llm.training.qk_clip``) does not support."""
    m, t, p = cfg.model, cfg.training, cfg.parallel
    if not (m.qk_clip or m.log_max_attention_logit):
        return None
    key = "model.qk_clip" if m.qk_clip else "model.log_max_attention_logit"
    for other, on, why in (
            ("training.jit", t.jit, "the max logit is recorded in PyNative; set it false"),
            ("parallel.context_parallel_size", p.context_parallel_size > 1,
             "ring attention does not record the max logit"),
            ("model.multi_latent_attention", m.multi_latent_attention, "MLA's clip is not built"),
            ("model.attention_output_gate", m.attention_output_gate,
             "the gated QKV layout's clip is not built")):
        if on:
            return (key, other), f"{key} with {other}: {why}"
    return None


def optimizer_kind_problem(cfg) -> Problem:
    """What the selected optimizer's registration refuses (``OptimizerKind.validate``)."""
    return get_optimizer(cfg.training.optimizer).validate(cfg)


_LOW = ("bfloat16", "bf16")
CROSS_KEY_CHECKS = (_check_schedule, _check_parallel, _check_moe, _check_misc, _check_lora)
CROSS_KEY_RULES = (stage_problem, _mtp_problem, _eval_split_problem, sample_order_problem,
                   bf16_problem, cross_entropy_fusion_problem, optimizer_problem,
                   optimizer_kind_problem)


def check_launch(cfg, world_size: int) -> None:
    """The rules that need the worker count: the mesh (tensor x context x pipeline must divide
    it, expert parallel the data-parallel size), the global batch (a multiple of micro batch x
    data-parallel size), FSDP's group size and the pipeline schedule (its micro-batch count). ``scripts/pretrain.sh``
    runs them before msrun starts, the trainer again in every worker (the same function)."""
    from ms_llm.parallel.pipeline.schedules import schedule_of
    from ms_llm.parallel.state import ParallelSizes
    p, t = cfg.parallel, cfg.training
    sizes = ParallelSizes(tp=p.tensor_model_parallel_size, cp=p.context_parallel_size,
                          pp=p.pipeline_model_parallel_size, ep=p.expert_model_parallel_size,
                          world=world_size)
    mesh_keys = ("parallel.tensor_model_parallel_size", "parallel.context_parallel_size",
                 "parallel.pipeline_model_parallel_size", "parallel.expert_model_parallel_size")
    try:
        sizes.validate()
    except ValueError as e:
        raise ConfigError(f"launch with {world_size} worker(s): {e}") from None
    mb_total = t.micro_batch_size * sizes.dp
    if t.global_batch_size % mb_total:
        _fail(cfg, ("training.global_batch_size", "training.micro_batch_size"),
              f"training.global_batch_size ({t.global_batch_size}) must be a multiple of "
              f"micro_batch_size x data-parallel size ({mb_total})")
    if p.fsdp_size > 1 and p.fsdp_size != sizes.dp * sizes.cp:
        _fail(cfg, ("parallel.fsdp_size",),
              f"parallel.fsdp_size ({p.fsdp_size}) must equal data parallel x context parallel "
              f"({sizes.dp * sizes.cp} = {sizes.dp} x {sizes.cp}; workers / (tensor x pipeline "
              f"parallel)): FSDP shards over that group; hybrid sharding is not supported")
    if sizes.pp > 1:
        try:
            schedule_of(p).build(sizes.pp, t.global_batch_size // mb_total,
                                 p.virtual_pipeline_model_parallel_size)
        except ValueError as e:
            _fail(cfg, mesh_keys[2:3] + ("training.global_batch_size",
                                         "parallel.schedules_method"), str(e))
