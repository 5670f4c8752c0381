"""``ms-llm plan``: per-rank memory of a run before launching it, and the cheapest fix if it
does not fit.

What is counted, per rank (every pipeline stage is planned; the worst one decides):

* parameters, gradients and optimizer state (its size per element asked of ``ms_llm.optim``):
  exact per-rank element counts from ``ms_llm.parallel.plan_shapes`` (training's own model,
  placement and sharding code);
* activations: per micro-batch, per layer, the tensors the backward pass keeps (a sum of
  ``[tokens, width]`` and ``[b, heads, s, s]`` terms, each with the number of copies the
  PyNative executor keeps, ``ACT``; each layer's token mixer adds its own registered term,
  ``MixerKind.activation_bytes``), times the micro-batches in flight (the pipeline schedule's
  own action lists), minus what recompute drops;
* communication buffers: data-parallel buckets, FSDP's gathered units and flat gradients,
  sequence-parallel gathers, expert all-to-all and pipeline send/receive buffers;
* context parallel (cp): every ``[tokens, width]`` term holds ``s / cp`` tokens of each
  sequence; the attention core is the blockwise kernel's (no ``[s, s]`` scores: its output
  kept, one score block, the ring's K/V blocks in flight and, for Ulysses, the all-to-all'd
  q/k/v); parameters, gradients and AdamW state are replicated over cp, gradients summed over
  data x context parallel, and the distributed optimizer cuts over that dp-cp group;
* gradients: the step's gradients and, while ``clip_`` scales them one at a time, one more of
  the largest (several micro-batches add the accumulator and the sum being formed);
* a large vocabulary's ``[V, h]`` gradient copies beside the activations and the gradients
  (``memory_vocab``: one stage, no tensor parallel);
* peak = parameters + optimizer state + the larger of (activations, with the micro-batch
  accumulator when there is one) and the gradients' copies + buffers + ``FIXED_BYTES``.

"Peak" is what a training process adds above its resident memory just before the model is built
(``rss_before_model_gb`` in ``metrics.jsonl``): the OS high-water mark (MindSpore's CPU memory
pool never returns memory, so RSS is its high-water mark). The per-copy coefficients were
measured on MindSpore 2.10's CPU backend (``tests/planning/test_memory_plan.py`` checks six configs and
layouts against measured peaks); on Ascend the same accounting applies with the device
allocator's copies, which have not been measured here.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from ms_llm.models.config import TransformerConfig
from ms_llm.models.mixers import MixerKind, layer_mixer
from ms_llm.optim import state_elements
from .memory_vocab import logits_tokens, vocab_head_bytes

GB = 1024 ** 3
FP32 = 4

# Copies of each activation the backward keeps per micro-batch and layer (MindSpore 2.10 CPU,
# PyNative, fp32), in units of one tensor of that shape. Measured, see the module docstring.
ACT = {
    "hidden": 4.0,       # [T, h]: norm inputs/outputs, residual branches, attention/MLP outputs
    # the token mixers' own terms (q/k/v, attention scores, ...) are their registrations'
    # (ms_llm.models.mixers: MixerKind.activation_bytes)
    "ffn": 1.5,          # [T, F / tp]: fc1 output ([gate; up] = 2 F) and the SwiGLU output
    "logits": 1.0,       # [T, V]: fp32 logits kept for the cross entropy's backward (2.0
                         # while a reshape to [T, V] copied them and their gradient)
    "logits_tp": 6.0,    # [T, V / tp]: vocab-parallel cross entropy (shifted, exp, gathers...)
    "moe_routed": 6.0,   # [T * topk, h]: permuted tokens, per-expert pieces, outputs back
    "accumulator": 2.0,  # accumulated + new gradients live with activations (micro-batches > 1)
    "grads_dp": 4.0,     # [params]: gradient copies at the step under data parallel (dp > 1)
    "grads_distopt": 5.8,  # the same with parallel.use_distributed_optimizer
    "norm": 0.0,         # [T, h] per RMSNorm that training.recompute_norm drops: measured ~0
    # context parallel (blockwise attention, ``context_parallel.kernel``: no [s, s] scores kept)
    "cp_out": 2.0,       # [b, nh / tp, s / cp, d]: the attention output and its fp32 copy
    "cp_a2a": 1.0,       # Ulysses: q/k/v after the all-to-all, kept by the attention's backward
    "cp_block": 12.0,    # one score block: the scaled, masked scores, exp, P; dP, dS... of
                         # the backward, transient (measured: ring cp=2, seq 1024 and 2048)
    "cp_grouped": 4.0,   # [b, nh / tp, s / cp, d]: the backward's grouped q, dout, out and dq
    "cp_kv": 4.0,        # ring: [2, b, ng, s / cp, d] K/V block: in hand, sent copy, received
                         # (backward: + the dK/dV accumulator travelling with it)
}
# kernels' workspaces and the pool's first blocks, independent of size (re-measured after the
# kernels read bf16/fp32 in place: every tiny config's peak fell by 8-9 MB, whatever recompute)
FIXED_BYTES = 0.03 * GB
DIST_FIXED_BYTES = 0.03 * GB  # a distributed worker's communicators and their buffers
RING_FIXED_BYTES = 0.04 * GB  # context parallel's ring: its two-rank broadcast groups (measured)


@dataclass
class StagePlan:
    """One pipeline stage's rank (the first data/tensor-parallel rank: it holds the largest
    uneven shards)."""
    rank: int
    params: int
    grads: int
    optimizer: int
    activations: int
    comm: int
    fixed: int
    peak: int
    num_params: int
    in_flight: int        # micro-batches whose activations are held at once


@dataclass
class MemoryPlan:
    nproc: int
    layout: Dict[str, object]
    total_params: int
    stages: List[StagePlan]
    device_memory_gb: Optional[float] = None
    suggestion: Optional[dict] = None        # {"change": {...}, "peak_gb": ..., "why": ...}
    notes: List[str] = field(default_factory=list)

    @property
    def worst(self) -> StagePlan:
        return max(self.stages, key=lambda s: s.peak)

    @property
    def peak_gb(self) -> float:
        return self.worst.peak / GB

    @property
    def fits(self) -> Optional[bool]:
        return None if self.device_memory_gb is None else self.peak_gb <= self.device_memory_gb

    def to_dict(self) -> dict:
        return {"nproc": self.nproc, "layout": self.layout, "total_params": self.total_params,
                "peak_gb": round(self.peak_gb, 3), "device_memory_gb": self.device_memory_gb,
                "fits": self.fits, "stages": [dataclasses.asdict(s) for s in self.stages],
                "suggestion": self.suggestion, "notes": self.notes}


# --------------------------------------------------------------------------- model config
def planned_model_config(cfg) -> TransformerConfig:
    """The architecture training would build: a ``checkpoint.load`` folder's, or the config's
    with the tokenizer's padded vocabulary (as ``build_data`` decides), without reading data."""
    from ms_llm.data.tokenizer import padded_vocab
    if cfg.checkpoint.load:     # load_config adopted the folder's architecture
        return cfg.model
    if "padded_vocab_size" in cfg.model_overrides:
        return cfg.model
    from ms_llm.data import ensure_default_corpus, load_tokenizer
    tok = cfg.data.tokenizer
    if tok == "embedded":
        _, tok = ensure_default_corpus(cfg.data.cache_dir, cfg.data.embedded_vocab_size)
    vocab = load_tokenizer(tok).vocab_size
    return cfg.model.replace(
        padded_vocab_size=padded_vocab(vocab, cfg.data.make_vocab_size_divisible_by))


def uses_distributed_optimizer(cfg) -> bool:
    return bool(cfg.parallel.use_distributed_optimizer)   # distopt-merge: plain read since merge


# --------------------------------------------------------------------------- the model
def _in_flight(pp: int, vpp: int, num_micro: int, stage: int,
               method: Optional[str] = None) -> Tuple[int, int]:
    """(micro-batch x chunk activations held at once, chunks) on ``stage``: walked from the
    pipeline schedule training runs."""
    if pp == 1:
        return 1, 1
    from ms_llm.parallel.pipeline.schedules import get_schedule
    actions = get_schedule(method, vpp).build(pp, num_micro, vpp)[stage]
    live = peak = 0
    for a in actions:
        live += {"F": 1, "B": -1}.get(a.kind, 0)     # (a zero-bubble W: no activation)
        peak = max(peak, live)
    return peak, vpp


def _cp_attention_bytes(c: TransformerConfig, b: int, s: int, tp: int, cp: int, u: int
                        ) -> Tuple[int, int]:
    """(kept, transient) bytes of one layer's context-parallel attention core per micro-batch:
    this rank holds ``s / cp`` tokens; Ulysses (degree ``u``) trades heads for the tokens of its
    ``u`` ranks by all-to-all, the ring (``cp / u`` members) passes K/V blocks around. The
    blockwise kernel keeps only the output (and its LSE): score blocks exist one at a time, of
    one chunk pair (``s / 2cp`` tokens each side), or of whole K/V blocks when the chunks are
    short (``kernel.fused_blocks``)."""
    from ms_llm.parallel.context_parallel.kernel import fused_blocks
    d = c.kv_channels
    nh, ng = c.num_attention_heads // tp, c.num_query_groups // tp
    s_loc = s // cp
    ng_u = max(ng, u) // u                # KV heads per rank after Ulysses (replicated if fewer)
    chunk = s // (2 * cp)
    rows = u * s_loc                      # query (and K/V block) tokens after Ulysses
    block = b * (nh // u) * (rows * rows if fused_blocks(chunk) else chunk * chunk)
    kept = ACT["cp_out"] * b * nh * s_loc * d
    if u > 1:
        kept += ACT["cp_a2a"] * b * (nh + 2 * ng_u * u) * s_loc * d
    transient = ACT["cp_block"] * block + ACT["cp_grouped"] * b * nh * s_loc * d
    if cp // u > 1:
        transient += ACT["cp_kv"] * 2 * b * ng_u * rows * d
    return int(FP32 * kept), int(FP32 * transient)


def _layer_activation_bytes(c: TransformerConfig, b: int, s: int, tp: int, sp: bool,
                            t, moe_layer: bool, mixer: MixerKind, cp: int = 1,
                            u: int = 1) -> Tuple[int, int]:
    """(kept through forward, re-materialized while its backward runs) for one layer and one
    micro-batch, under the recompute settings ``t``; ``cp``/``u``: context parallel size and
    its Ulysses degree (this rank's tokens are ``s / cp`` of each sequence); ``mixer``: the
    layer's token-mixer kind, whose own term (``activation_bytes``) this adds."""
    full_s, s = s, s // cp
    tokens = b * s
    t_sp = tokens // tp if sp else tokens
    h = c.hidden_size
    ffn = (c.moe_ffn_hidden_size * c.moe_router_topk if moe_layer else c.ffn_hidden_size) // tp
    if moe_layer and c.moe_shared_expert_intermediate_size:
        ffn += c.moe_shared_expert_intermediate_size // tp
    hidden = FP32 * (ACT["hidden"] - (2 * ACT["norm"] if t.recompute_norm else 0)) * t_sp * h
    if sp:   # column-parallel linears keep their all-gathered input (two per layer)
        hidden += FP32 * 2 * tokens * h
    mlp = FP32 * ACT["ffn"] * tokens * ffn
    if moe_layer:   # routed copies of the hidden states: permuted in, expert outputs back
        mlp += FP32 * ACT["moe_routed"] * tokens * c.moe_router_topk * h
    mix = mixer.activation_bytes(c, b, s, tp)
    core, transient, rerun_transient = mix.core, mix.transient, mix.rerun_transient
    if cp > 1 and mixer.core_attention:   # ring / Ulysses attention: no [s, s] scores
        core, transient = _cp_attention_bytes(c, b, full_s, tp, cp, u)
        rerun_transient = transient
    whole = hidden + mix.projections + mlp + core
    if t.recompute_granularity == "full":
        return FP32 * t_sp * h, whole + rerun_transient
    if t.recompute_granularity == "selective" and mixer.core_attention:
        return whole - core, core + transient
    return whole, transient


def _ulysses(cfg) -> int:
    """The Ulysses degree of the config's context-parallel algorithm (training's own rule)."""
    p = cfg.parallel
    if p.context_parallel_size == 1:
        return 1
    from ms_llm.parallel.context_parallel.apply import ulysses_degree
    return ulysses_degree(p.context_parallel_size, p.context_parallel_algo,
                          p.ulysses_degree_in_cp)


def _stage_layers(cfg, c: TransformerConfig, stage: int, pp: int, vpp: int) -> List[int]:
    """Global indices of the layers on ``stage`` (training's own stage split)."""
    from ms_llm.parallel.pipeline.stages import layer_ranges
    if pp == 1:
        return list(range(c.num_layers))
    from ms_llm.parallel.pipeline.schedules import schedule_of
    ranges = layer_ranges(c.num_layers, pp, vpp, cfg.parallel.num_layer_list or None)
    placement = schedule_of(cfg.parallel).placement
    out = []
    for v in range(vpp):
        out += list(ranges[placement.virtual_stage(stage, v, pp)])
    return out


def _holds_last_stage(cfg, stage: int, pp: int) -> bool:
    """Whether pipeline rank ``stage`` runs the model's last stage (the head, MTP, the loss):
    the last rank, or rank 0 in a V (the schedule's ``placement``)."""
    if pp == 1:      # no schedule runs
        return stage == 0
    from ms_llm.parallel.pipeline.schedules import schedule_of
    p = cfg.parallel
    last = pp * p.virtual_pipeline_model_parallel_size - 1
    return stage == schedule_of(p).placement.stage_of(last, pp)[0]


def _recomputed(t, position: int) -> object:
    """The recompute settings that apply to the layer at ``position`` of its stage (``block``
    covers the first ``recompute_num_layers`` of each stage)."""
    if t.recompute_method == "block" and position >= (t.recompute_num_layers or 0):
        return dataclasses.replace(t, recompute_granularity=None)
    return t


def plan_stage(cfg, c: TransformerConfig, params, stage: int, rank: int, nproc: int,
               distributed_optimizer: bool, shapes: Optional[dict] = None) -> StagePlan:
    """The memory of ``rank`` (pipeline stage ``stage``) holding ``params``; ``shapes``: the
    global shapes (``full_shapes``) the optimizer's state count may depend on."""
    p, t = cfg.parallel, cfg.training
    tp, pp, vpp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, \
        p.virtual_pipeline_model_parallel_size
    cp, u = p.context_parallel_size, _ulysses(cfg)
    dp = nproc // (tp * pp * cp)
    ep = p.expert_model_parallel_size
    b, s, sp = t.micro_batch_size, cfg.data.seq_length, p.sequence_parallel
    s_loc = s // cp          # this rank's tokens of each sequence (context parallel)
    num_micro = t.global_batch_size // (b * dp)
    param_bytes = sum(q.numel * q.itemsize for q in params)
    trainable = [q for q in params if q.trainable]
    grad_bytes = sum(q.numel * FP32 for q in trainable)
    # The optimizer's state (``state_elements`` fp32 values per element, asked of the optimizer:
    # AdamW's two moments); the distributed optimizer keeps it, and an fp32 main-parameter
    # shard, only for this rank's (first, largest) shard of its group (a group of one: the
    # model's parameter is the main one). Under context parallel the cp ranks are replicas too:
    # the group is (expert-)data parallel x cp, Megatron's dp-cp group.
    opt_bytes, shard_grad_bytes = 0, 0
    for q in trainable:
        shape = shapes[q.name][0] if shapes and q.name in shapes else (q.full_numel,)
        k = state_elements(cfg, q.name, shape)
        group = (dp // ep if q.expert else dp) * cp if distributed_optimizer else 1
        if group > 1:
            shard = -(-q.numel // group)
            opt_bytes += (k + 1) * FP32 * shard
            shard_grad_bytes += FP32 * shard
        else:
            opt_bytes += k * FP32 * q.numel
    # activations: the layers this stage runs, times the micro-batches in flight per chunk
    layers = _stage_layers(cfg, c, stage, pp, vpp)
    in_flight, chunks = _in_flight(pp, vpp, num_micro, stage, p.schedules_method)
    per_chunk = max(1, len(layers) // chunks)
    chunk_kept, remat = [0] * chunks, 0
    for pos, i in enumerate(layers):
        k, r = _layer_activation_bytes(c, b, s, tp, sp, _recomputed(t, pos % per_chunk),
                                       c.is_moe_layer(i), layer_mixer(c, i), cp, u)
        chunk_kept[min(pos // per_chunk, chunks - 1)] += k
        remat = max(remat, r)
    if _holds_last_stage(cfg, stage, pp):
        # Multi-token prediction layers run on the last stage after the decoder, each built like
        # the last decoder layer (``is_moe_layer`` of an index >= num_layers says so).
        for i in range(c.num_layers, c.num_layers + (c.mtp_num_layers or 0)):
            k, r = _layer_activation_bytes(c, b, s, tp, sp, t, c.is_moe_layer(i),
                                           layer_mixer(c, i), cp, u)
            chunk_kept[-1] += k
            remat = max(remat, r)
    if pp > 1:
        # The executor keeps only each in-flight micro-batch's chunk input and re-runs the
        # chunk's forward inside its backward (compat.autograd.DeferredVJP: MindSpore 2.10 runs
        # pending backwards last-in first-out only), so one micro-batch's chunk is live.
        kept = max(chunk_kept) + in_flight * FP32 * b * (s_loc // tp if sp else s_loc) * \
            c.hidden_size
    else:
        kept = sum(chunk_kept)
    last = _holds_last_stage(cfg, stage, pp)
    copies = ACT["logits"] if tp == 1 else ACT["logits_tp"]
    logits = int(FP32 * copies * logits_tokens(c, b * s_loc, tp) * c.padded_vocab_size // tp) \
        if last else 0
    acts = kept + remat + logits
    # a large vocabulary's [V, h] gradients beside the activations / the gradients (memory_vocab)
    head_early, head_late = vocab_head_bytes(c, tp, pp) if last else (0, 0)
    acts += head_early
    # communication buffers
    comm = 0
    replicas = dp * cp       # gradients are summed over data x context parallel (dp_cp)
    if replicas > 1 and not p.fsdp_size > 1:
        comm += 2 * min(int(p.ddp_bucket_mb * 2 ** 20), grad_bytes)
    if p.fsdp_size > 1:
        units: Dict[str, int] = {}
        for q in params:
            if q.fsdp:
                units[q.unit] = units.get(q.unit, 0) + q.full_numel * q.itemsize
        biggest = max(units.values(), default=0)
        # one unit gathered + prefetched ones, and a unit's full-size gradient before its
        # reduce-scatter; the root and the last unit keep their gathered weights
        comm += (2 + p.fsdp_prefetch) * biggest
        comm += sum(v for k, v in units.items() if k.endswith(":root"))
    if sp:
        comm += 2 * FP32 * b * s_loc * c.hidden_size
    if ep > 1:
        comm += 2 * FP32 * b * s_loc * c.moe_router_topk * c.hidden_size
    if pp > 1:
        comm += 2 * FP32 * b * (s_loc // tp if sp else s_loc) * c.hidden_size
    # Gradient copies: the step's gradients plus the largest one's scaled copy (``clip_`` replaces
    # them one at a time) and, over several micro-batches, the accumulator plus the new
    # micro-batch's gradients while they are summed. The accumulator is also live during later
    # forwards.
    accum = num_micro > 1
    largest = max((q.numel * FP32 for q in trainable), default=0)
    grad_phase = (3 * grad_bytes if accum else grad_bytes + largest) + head_late
    if replicas > 1 and p.fsdp_size == 1:
        # data parallel's per-parameter accumulators and flat buckets (measured, one dp=2 run
        # each; the distributed optimizer's flat reduce-scatter/all-gather buffers add more)
        copies = ACT["grads_distopt"] if shard_grad_bytes else ACT["grads_dp"]
        grad_phase = (copies + (1 if accum else 0)) * grad_bytes
    state = param_bytes + opt_bytes
    fixed = int(FIXED_BYTES + (DIST_FIXED_BYTES if nproc > 1 else 0) +
                (RING_FIXED_BYTES if cp // u > 1 else 0))
    peak = state + max(acts + (ACT["accumulator"] * grad_bytes if accum else 0),
                       grad_phase) + comm + fixed
    return StagePlan(rank, param_bytes, grad_phase, opt_bytes, int(acts), comm, fixed, int(peak),
                     sum(q.numel for q in params), in_flight)


def _layout(cfg, nproc: int, distributed_optimizer: bool) -> Dict[str, object]:
    p, t = cfg.parallel, cfg.training
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    dp = nproc // (tp * pp * p.context_parallel_size)
    return {"tp": tp, "sp": p.sequence_parallel, "pp": pp, "cp": p.context_parallel_size,
            "cp_algo": p.context_parallel_algo if p.context_parallel_size > 1 else None,
            "vpp": p.virtual_pipeline_model_parallel_size, "ep": p.expert_model_parallel_size,
            "dp": dp, "fsdp": p.fsdp_size, "distributed_optimizer": distributed_optimizer,
            "micro_batch": t.micro_batch_size, "seq": cfg.data.seq_length,
            "micro_batches_per_step": t.global_batch_size // max(1, t.micro_batch_size * dp),
            "recompute": t.recompute_granularity, "recompute_method": t.recompute_method,
            "recompute_num_layers": t.recompute_num_layers, "recompute_norm": t.recompute_norm}


def check_layout(cfg, nproc: int) -> None:
    """The layout rules training applies before building anything (one-line errors)."""
    from ms_llm.parallel.state import ParallelSizes
    p, t = cfg.parallel, cfg.training
    sizes = ParallelSizes(tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size,
                          cp=p.context_parallel_size, ep=p.expert_model_parallel_size,
                          world=nproc)
    sizes.validate()
    if sizes.cp > 1:   # training's own checks (ContextParallel's sequence split)
        from ms_llm.parallel.context_parallel.layout import local_token_index
        local_token_index(cfg.data.seq_length, sizes.cp, 0)
        _ulysses(cfg)
    mb_total = t.micro_batch_size * sizes.dp
    if t.global_batch_size % mb_total:
        raise ValueError(f"training.global_batch_size ({t.global_batch_size}) must be a multiple "
                         f"of micro_batch_size x data-parallel size ({mb_total})")


def plan_memory(cfg, nproc: int, device_memory_gb: Optional[float] = None,
                distributed_optimizer: Optional[bool] = None, model_config=None,
                _shapes=None, _cache=None) -> MemoryPlan:
    """Plan ``cfg`` on ``nproc`` workers. ``distributed_optimizer`` None: the config's setting
    (what-if otherwise). ``model_config``: the architecture (default: ``planned_model_config``)."""
    from ms_llm.parallel.parallelize import jit_blockers
    from ms_llm.parallel.plan_experts import fold_experts, unfold_params, unfold_shapes
    from ms_llm.parallel.plan_shapes import full_shapes, plan_state, rank_params
    from ms_llm.parallel.state import ParallelSizes
    check_layout(cfg, nproc)
    if distributed_optimizer is None:
        distributed_optimizer = uses_distributed_optimizer(cfg)
    c = model_config or planned_model_config(cfg)
    u = _ulysses(cfg)
    if u > 1:    # apply_context_parallel's check, on the architecture training builds
        from ms_llm.parallel.context_parallel.ulysses import check_heads
        tp = cfg.parallel.tensor_model_parallel_size
        check_heads(c.num_attention_heads // tp, c.num_query_groups // tp, u,
                    "parallel.context_parallel_algo: ")
    p = cfg.parallel
    # many small experts: built folded, unfolded to the real count (ms_llm.parallel.plan_experts)
    built, fold = fold_experts(c, p.expert_model_parallel_size)
    built_shapes = full_shapes(built, p.noop_layers) if fold > 1 or _shapes is None else None
    shapes = _shapes or unfold_shapes(built_shapes, fold)
    sizes = ParallelSizes(tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size,
                          cp=p.context_parallel_size, ep=p.expert_model_parallel_size,
                          world=nproc)
    stages = []
    per_stage = sizes.world // sizes.pp
    cache = {} if _cache is None else _cache     # what-ifs of recompute/optimizer share layouts
    for stage in range(sizes.pp):
        rank = stage * per_stage
        key = (sizes, rank, p.sequence_parallel, p.fsdp_size,
               p.virtual_pipeline_model_parallel_size, tuple(p.num_layer_list),
               tuple(p.noop_layers))
        if key not in cache:
            cache[key] = unfold_params(rank_params(cfg, built, sizes, rank, built_shapes or
                                                   shapes), fold)
        params = cache[key]
        stages.append(plan_stage(cfg, c, params, stage, rank, nproc, distributed_optimizer,
                                 shapes))
    total = sum(math.prod(shape) for shape, _, _ in shapes.values())
    plan = MemoryPlan(nproc, _layout(cfg, nproc, distributed_optimizer), total, stages,
                      device_memory_gb)
    if cfg.training.jit and not jit_blockers(cfg, plan_state(sizes, 0)):
        plan.notes.append("training.jit: planned as PyNative; a compiled step keeps more "
                          "(measured up to 1.8x the RSS on CPU)")
    return plan
