"""One place that parallelizes a model, in one order (the shape of torchtitan's
``parallelize_llama``).

Every rank builds the same full model (same seed); ``parallelize_model`` then applies, in order:

1. layouts: tensors whose checkpoint layout is not plain say so (``[gate; up]`` halves, grouped
   expert rows), so every later step and the checkpoint derive regions from one record;
2. module conversions that must precede sharding (MXFP8 replacement, then LoRA adapters: both
   reuse the Parameters);
3. tensor (+ sequence) parallel; 4. expert parallel and the token dispatcher; 5. noop layers
   and pipeline stages: this rank's model chunks (layers under their global index);
6. activation recompute (under FSDP with the weights as explicit inputs: ``fsdp.recompute``);
7. FSDP; 8. gradient synchronisation: each trainable parameter's gradient is summed over the
   mesh dim its ``Placement`` names (data parallel, expert-data parallel, or none after FSDP).

A new capability (pipeline or context parallel, recompute, LoRA) is one more step here that adds
mesh dims or global indices to the records; the trainer only calls this function.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from ms_llm.compat.device import bf16_graph_supported
from ms_llm.models.gpt import GPTModel
from ms_llm.models.layers import MLP
from ms_llm.models.moe import SharedExpertMLP, moe_layers
from ms_llm.lora.apply import apply_lora, buffer_names, mark_frozen_shards, trainable_report
from ms_llm.lora.modules import LoRALinear
from ms_llm.quant import apply_quantization, kept_unaligned
from . import comm
from .data_parallel import PartitionedGradSync, grad_reduce_dtype
from .expert_parallel import apply_expert_parallel
from .mixer_plans import plan_for
from .fsdp import MixedPrecisionPolicy, apply_fsdp, fsdp_group
from .fsdp.recompute import check_recompute_under_fsdp, recompute_under_fsdp
from .pipeline.schedules import schedule_of
from .pipeline.stages import apply_noop_layers, split_model
from .context_parallel.apply import apply_context_parallel
from .placement import grad_replica_dims, placement_of, update_placement
from .recompute import apply_recompute
from .state import ParallelState
from .tensor_parallel import apply_tensor_parallel


@dataclass
class ParallelizedModel:
    """What the trainer needs after parallelization: the model, its parameters (trainable ones
    in a fixed order), their gradient synchronisation, whether the step may be compiled, and
    under pipeline parallel this rank's model chunks."""
    model: GPTModel
    named_params: list           # every (name, Parameter) this rank holds, buffers included
    params: list
    grad_sync: PartitionedGradSync
    fsdp: bool
    jit: bool
    notes: List[str] = field(default_factory=list)   # one line each, printed by rank 0
    chunks: Optional[list] = None
    context_parallel: Optional[object] = None   # ContextParallel: splits each micro-batch


def describe_layouts(model: GPTModel) -> None:
    """Record the non-plain storage layouts of a model's tensors (idempotent; run again after
    LoRA, whose B of a fused ``[gate; up]`` base has ``[gate; up]`` rows too)."""
    for _, cell in model.cells_and_names():
        if isinstance(cell, MLP) and not isinstance(cell, SharedExpertMLP) \
                and cell.config.gated_linear_unit:
            for p in (cell.linear_fc1.weight, cell.linear_fc1.bias):
                if p is not None:
                    update_placement(p, layout="glu_halves")
        if isinstance(cell, LoRALinear) and placement_of(cell.weight).layout == "glu_halves":
            update_placement(cell.lora_B.weight, layout="glu_halves")
        kind = getattr(cell, "mixer_kind", None)
        if kind is not None:                 # a token mixer's own layouts (its parallel plan)
            plan_for(kind).describe(cell)
    for layer in moe_layers(model):
        experts = layer.experts
        if hasattr(experts, "weight1"):      # grouped: weight1 [H, E*2F] stored as rows of 2F
            update_placement(experts.weight1, layout="row_blocks",
                             row_width=2 * layer.config.moe_ffn_hidden_size)


def jit_blockers(cfg, pstate: ParallelState) -> List[str]:
    """Layouts whose collectives or routing run only in PyNative (custom backward functions,
    host-side token counts)."""
    p = cfg.parallel
    out = []
    if cfg.training.bf16 and not bf16_graph_supported():
        out.append("bf16 on CPU (MindSpore 2.10)")
    if pstate.sizes.tp > 1:
        out.append("tensor parallel")
    if p.fsdp_size > 1:
        out.append("FSDP")
    if cfg.model.mlp_type == "moe":
        out.append("MoE routing")
    if pstate.sizes.pp > 1:
        out.append("pipeline parallel")
    if pstate.sizes.cp > 1:
        out.append("context parallel")
    if cfg.training.recompute_granularity or cfg.training.recompute_norm:
        out.append("activation recompute")
    if cfg.model.mtp_num_layers:
        out.append("multi-token prediction (its per-depth losses are logged from PyNative)")
    return out


def _pipeline_chunks(model: GPTModel, cfg, pstate: ParallelState) -> Optional[list]:
    """This rank's model chunks; None without pipeline parallel (the stage rules, e.g. vpp
    needing pp > 1, are checked with the config)."""
    p = cfg.parallel
    if pstate.sizes.pp == 1:
        return None
    return split_model(model, pstate, p.virtual_pipeline_model_parallel_size,
                       p.num_layer_list or None, p.noop_layers,
                       placement=schedule_of(p).placement)


def _recompute(model: GPTModel, chunks: Optional[list], cfg) -> List[str]:
    """Under FSDP recomputed modules re-run with their gathered weights as explicit inputs
    (``fsdp.recompute``)."""
    t = cfg.training
    if t.recompute_granularity is None and not t.recompute_norm:
        return []
    kw = {"mark": recompute_under_fsdp} if cfg.parallel.fsdp_size > 1 else {}
    names = apply_recompute(chunks or [model], t.recompute_granularity, t.recompute_method,
                            t.recompute_num_layers, t.recompute_norm, **kw)
    return [f"recompute: {len(names)} modules ({t.recompute_granularity or 'norm'})"]


def _named(model: GPTModel, chunks: Optional[list]) -> list:
    if chunks is None:
        return list(model.named_parameters())
    seen, out = set(), []
    for chunk in chunks:
        for n, q in chunk.parameters_and_names():
            if id(q) not in seen:
                seen.add(id(q))
                out.append((n, q))
    return out


def build_grad_sync(params: list, pstate: ParallelState, cfg, overlap: bool
                    ) -> PartitionedGradSync:
    """Partition the parameters by the mesh dim their gradients are summed over."""
    parts = []
    for dims in ((), ("cp",), ("dp", "cp"), ("edp", "cp")):
        idx = [i for i, q in enumerate(params) if grad_replica_dims(placement_of(q)) == dims]
        # (): FSDP's reduce-scatter over dp x cp summed them already (a one-rank group: no sync)
        group = pstate.group("_".join(dims)) if dims else comm.ProcessGroup((pstate.rank,))
        parts.append((idx, [params[i] for i in idx], group, group.size > 1))
    return PartitionedGradSync(parts, bucket_mb=cfg.parallel.ddp_bucket_mb, overlap=overlap,
                               grad_dtype=grad_reduce_dtype(cfg))


def parallelize_model(model: GPTModel, cfg, pstate: ParallelState) -> ParallelizedModel:
    """Apply every configured parallelism to ``model`` in place. Raises ``ValueError`` with a
    one-line message naming the config key when a layout does not fit the model."""
    p, notes = cfg.parallel, []
    describe_layouts(model)
    if cfg.quant.recipe:
        names = apply_quantization(model, cfg.quant)
        notes.append(f"quant {cfg.quant.recipe} ({cfg.quant.scale_mode}) replaced "
                     f"{len(names)} modules: {', '.join(names)}")
    lora = cfg.lora if cfg.lora.r else None
    if lora is not None:
        names = apply_lora(model, lora, seed=cfg.training.seed)
        describe_layouts(model)
        notes.append(f"lora r={lora.r} alpha={lora.alpha} on {len(names)} modules; "
                     f"{trainable_report(model)}")
        buffers = buffer_names(model)
    apply_tensor_parallel(model, pstate.group("tp"), sequence_parallel=p.sequence_parallel,
                          comm_overlap=p.tp_comm_overlap)
    if cfg.quant.recipe and kept_unaligned(model):     # quant.mx_unaligned: keep
        notes.append(f"quant {cfg.quant.recipe}: kept in high precision (a dim not a multiple "
                     f"of 32): {', '.join(kept_unaligned(model))}")
    if lora is not None:
        mark_frozen_shards(model, buffers)
    cp = apply_context_parallel(model, cfg, pstate)
    if cp is not None and model.mtp is not None:
        raise ValueError("model.mtp_num_layers with parallel.context_parallel_size > 1 is not "
                         "built yet (rolling the tokens would cross the ranks' chunks)")
    expert_params = []
    if cfg.model.mlp_type == "moe":
        expert_params = apply_expert_parallel(
            model, pstate.group("ep"), dispatcher=cfg.moe.dispatcher,
            expert_groups=cfg.moe.expert_groups, token_chunks=cfg.moe.token_chunks)
    apply_noop_layers(model, p.noop_layers)
    chunks = _pipeline_chunks(model, cfg, pstate)
    notes += _recompute(model, chunks, cfg)
    fsdp = p.fsdp_size > 1
    if fsdp:
        dp, dp_dim = fsdp_group(pstate, p.fsdp_size)     # dp x cp (Megatron's dp_cp group)
        policy = MixedPrecisionPolicy(param_dtype=p.fsdp_param_dtype,
                                      reduce_dtype=p.fsdp_reduce_dtype)
        modules = p.fsdp_modules
        if model.mtp is not None:   # read again by the MTP depths: left gathered in the root
            modules = [m for m in modules if m not in ("embedding", "output_layer")]
        # Under pipeline parallel each model chunk is its own FSDP root.
        for unit, tied, strict in ([(model, None, True)] if chunks is None else
                                   [(c, c.last and c.output_layer is None, False)
                                    for c in chunks]):
            apply_fsdp(unit, dp, modules=modules,
                       reshard_after_forward=p.reshard_after_forward, prefetch=p.fsdp_prefetch,
                       ignored_params=expert_params, mp_policy=policy, tied=tied, strict=strict,
                       mesh_dim=dp_dim)
        check_recompute_under_fsdp(chunks or [model])
    jit = cfg.training.jit
    blockers = jit_blockers(cfg, pstate)
    if jit and blockers:
        jit = False
        notes.append(f"training.jit ignored: {', '.join(blockers)} run(s) only in PyNative "
                     f"(custom-backward collectives), so this run trains in PyNative")
    model.set_train(True)
    named = _named(model, chunks)
    params = [q for _, q in named if q.requires_grad]
    # Gradient hooks overlap the all-reduce with one autograd pass; the pipeline runs one vjp
    # per action instead, so it reduces after the step.
    # (the distributed optimizer brings its own reduce-scatter; no all-reduce hooks here)
    overlap = (p.ddp_overlap and not jit and chunks is None and not p.use_distributed_optimizer)
    grad_sync = build_grad_sync(params, pstate, cfg, overlap=overlap)
    return ParallelizedModel(model, named, params, grad_sync, fsdp, jit, notes, chunks, cp)
