"""Megatron tensor-parallel layers, built from an existing full module by keeping this rank's
shard of its parameters (so a tp run starts from exactly the single-process weights).

Activations are ``[b, s, h]``; with sequence parallel the residual stream is split along ``s``.
Each sharded parameter's ``Placement`` gains a ``("tp", dim)`` shard; replicated parameters whose
gradient is only partial on each rank (norm weights under sequence parallel, QK-norm weights under
tp, the row-parallel bias under sp) are marked partial over ``tp``. Gradient reduction, the norm
and checkpoints read nothing else.

``apply_tensor_parallel`` swaps a ``GPTModel``'s linears and embedding for these layers from
outside; the model reads its head counts from the sharded weights' shapes. A LoRA adapter
(``ms_llm.lora``) on a sharded linear is split like its base weight:

* column-parallel base (``linear_qkv``, ``linear_fc1``): B's rows are split like W's rows (the
  ``[gate_r; up_r]`` rows for a fused fc1), A is replicated. Each rank's A gradient only covers
  its B rows, so A is marked partial over ``tp`` (summed like the QK-norm weights).
* row-parallel base (``linear_proj``, ``linear_fc2``): A's columns are split like W's columns,
  B is replicated. The adapter's partial output is added to the base's partial output *before*
  the all-reduce (reduce-scatter under sequence parallel), so one collective sums both; B's
  gradient is then partial over ``tp``.

Dropout under column parallel draws a mask per rank (the ranks' output slices see different
masks); with ``lora.dropout`` 0 (the default) tp and one process compute the same thing.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import numpy as np
from mindspore import Parameter, Tensor

from ms_llm.compat import F, float32, int32, nn
from ms_llm import ops as hot
from ms_llm.ops import IGNORE_INDEX
from ms_llm.lora.modules import LoRABranch, LoRALinear, LoRAWeight
from ms_llm.models.mixers import mixer_of, mixers_used
from . import autograd as pa
from . import tp_overlap
from .mixer_plans import plan_for
from .placement import add_partial, add_shard, placement_of, set_placement


def _shard_param(full: Parameter, dim: int, rank: int, size: int,
                 rows: Optional[np.ndarray] = None) -> Parameter:
    data = full.asnumpy()
    if rows is not None:
        part = np.take(data, rows, axis=dim)
    else:
        n = data.shape[dim] // size
        part = np.take(data, np.arange(rank * n, (rank + 1) * n), axis=dim)
    if rows is not None and placement_of(full).layout not in ("glu_halves", "row_parts"):
        raise ValueError("tensor parallel: a split of named parts ([gate; up], [q; k; v]) needs "
                         "a glu_halves / row_parts placement")
    p = Parameter(Tensor(np.ascontiguousarray(part)).astype(full.dtype),
                  requires_grad=full.requires_grad)
    set_placement(p, add_shard(full, full.shape, "tp", dim))
    return p


def _local_matmul(full: nn.Module, in_features: int, out_features: int, has_bias: bool):
    """The kernel the shard runs, as the module being sharded describes it."""
    make = getattr(full, "local_matmul", None)
    if make is None:
        raise ValueError(f"tensor parallel: {type(full).__name__} does not describe its "
                         f"shard's matmul (no local_matmul)")
    return make(in_features, out_features, has_bias)


def glu_rows(out_features: int, rank: int, size: int) -> np.ndarray:
    """Rows of a fused ``[gate; up]`` weight that rank ``rank`` holds: ``[gate_r; up_r]``."""
    half = out_features // 2
    n = half // size
    own = np.arange(rank * n, (rank + 1) * n)
    return np.concatenate([own, half + own])


class ColumnParallelLinear(nn.Module):
    """``Y_r = X W_r^T``: output features split over the group. The input is all-reduced in
    backward (or all-gathered along the sequence in forward under sequence parallel)."""

    def __init__(self, full: nn.Linear, group, *, sequence_parallel: bool = False,
                 gather_output: bool = False, rows: Optional[np.ndarray] = None,
                 comm_overlap: bool = False):
        super().__init__()
        size, rank = group.size, group.rank
        # parallel.tp_comm_overlap: the sequence all-gather split around the GEMM (tp_overlap)
        self.comm_overlap = comm_overlap and sequence_parallel
        if full.out_features % size:
            raise ValueError(f"ColumnParallelLinear: {full.out_features} output features are not "
                             f"divisible by tensor_model_parallel_size {size}")
        self.group, self.sequence_parallel, self.gather_output = group, sequence_parallel, \
            gather_output
        self.in_features, self.out_features = full.in_features, full.out_features // size
        self.weight = _shard_param(full.weight, 0, rank, size, rows)
        self.bias = None if full.bias is None else _shard_param(full.bias, 0, rank, size, rows)
        # A quantized source keeps its recipe on the shard (quantization runs first).
        self.matmul = _local_matmul(full, self.in_features, self.out_features,
                                    self.bias is not None)

    def forward(self, x: Tensor) -> Tensor:
        if self.comm_overlap:
            y = tp_overlap.gathered_matmul(x, self._local, self.group, 1)
        else:
            if self.sequence_parallel:
                x = pa.gather_from_sequence_parallel(x, self.group, 1)
            else:
                x = pa.copy_to_group(x, self.group)
            y = self._local(x)
        return pa.gather_from_group(y, self.group, -1) if self.gather_output else y

    def _local(self, x: Tensor) -> Tensor:
        return self.matmul(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``Y = sum_r X_r W_r^T``: input features split; the partial outputs are all-reduced (or
    reduce-scattered along the sequence under sequence parallel); the bias is added after."""

    def __init__(self, full: nn.Linear, group, *, sequence_parallel: bool = False,
                 comm_overlap: bool = False):
        super().__init__()
        size, rank = group.size, group.rank
        # parallel.tp_comm_overlap: the sequence reduce-scatter split around the GEMM
        self.comm_overlap = comm_overlap and sequence_parallel
        if full.in_features % size:
            raise ValueError(f"RowParallelLinear: {full.in_features} input features are not "
                             f"divisible by tensor_model_parallel_size {size}")
        self.group, self.sequence_parallel = group, sequence_parallel
        self.in_features, self.out_features = full.in_features // size, full.out_features
        self.weight = _shard_param(full.weight, 1, rank, size)
        self.bias = full.bias
        if self.bias is not None and sequence_parallel:
            add_partial(self.bias, "tp")
        self.matmul = _local_matmul(full, self.in_features, self.out_features, False)

    def forward(self, x: Tensor) -> Tensor:
        if self.comm_overlap:
            y = tp_overlap.matmul_scattered(x, self._local, self.group, 1)
            return y if self.bias is None else y + self.bias
        y = self._local(x)
        if self.sequence_parallel:
            y = pa.reduce_scatter_to_sequence_parallel(y, self.group, 1)
        else:
            y = pa.reduce_from_group(y, self.group)
        return y if self.bias is None else y + self.bias

    def _local(self, x: Tensor) -> Tensor:
        return self.matmul(x, self.weight)


class LoRAColumnParallelLinear(LoRABranch, ColumnParallelLinear):
    """Column-parallel base; B split on its rows like W, A replicated (gradient partial)."""

    def __init__(self, full: LoRALinear, group, *, sequence_parallel: bool = False,
                 gather_output: bool = False, rows: Optional[np.ndarray] = None,
                 comm_overlap: bool = False):
        # the adapter reads the gathered input too: no split exchange (comm_overlap unused)
        super().__init__(full, group, sequence_parallel=sequence_parallel,
                         gather_output=gather_output, rows=rows)
        b = _shard_param(full.lora_B.weight, 0, group.rank, group.size, rows)
        add_partial(full.lora_A.weight, "tp")
        self.init_branch(full.lora_A, LoRAWeight(b), full.scaling, full.lora_dropout)

    def forward(self, x: Tensor) -> Tensor:
        if self.sequence_parallel:
            x = pa.gather_from_sequence_parallel(x, self.group, 1)
        else:
            x = pa.copy_to_group(x, self.group)
        y = self.add_delta(self.matmul(x, self.weight, self.bias), x)
        return pa.gather_from_group(y, self.group, -1) if self.gather_output else y


class LoRARowParallelLinear(LoRABranch, RowParallelLinear):
    """Row-parallel base; A split on its columns like W, B replicated (gradient partial); the
    adapter's partial output joins the base's before the one reduction."""

    def __init__(self, full: LoRALinear, group, *, sequence_parallel: bool = False,
                 comm_overlap: bool = False):
        # the adapter's partial joins the base's before one reduction: no split exchange
        super().__init__(full, group, sequence_parallel=sequence_parallel)
        a = _shard_param(full.lora_A.weight, 1, group.rank, group.size)
        add_partial(full.lora_B.weight, "tp")
        self.init_branch(LoRAWeight(a), full.lora_B, full.scaling, full.lora_dropout)

    def forward(self, x: Tensor) -> Tensor:
        y = self.add_delta(self.matmul(x, self.weight), x)
        if self.sequence_parallel:
            y = pa.reduce_scatter_to_sequence_parallel(y, self.group, 1)
        else:
            y = pa.reduce_from_group(y, self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows of the vocabulary split over the group; out-of-range ids look up zeros and the
    partial embeddings are summed (reduce-scattered along the sequence under SP)."""

    def __init__(self, full: nn.Embedding, group, *, sequence_parallel: bool = False):
        super().__init__()
        size, rank = group.size, group.rank
        if full.num_embeddings % size:
            raise ValueError(f"VocabParallelEmbedding: vocabulary {full.num_embeddings} is not "
                             f"divisible by tensor_model_parallel_size {size} (pad it with "
                             f"model.padded_vocab_size)")
        self.group, self.sequence_parallel = group, sequence_parallel
        self.num_embeddings = full.num_embeddings // size
        self.embedding_dim = full.embedding_dim
        self.vocab_start = rank * self.num_embeddings
        self.weight = _shard_param(full.weight, 0, rank, size)

    def forward(self, ids: Tensor) -> Tensor:
        local = ids - self.vocab_start
        inside = (local >= 0) & (local < self.num_embeddings)
        local = F.where(inside, local, F.zeros_like(local))
        emb = F.embedding(local, self.weight)
        emb = emb * inside.astype(emb.dtype).expand_dims(-1)
        if self.sequence_parallel:
            return pa.reduce_scatter_to_sequence_parallel(emb, self.group, 1)
        return pa.reduce_from_group(emb, self.group)


def vocab_parallel_cross_entropy(logits: Tensor, labels: Tensor, group, vocab_start: int,
                                 ignore_index: int = IGNORE_INDEX) -> Tensor:
    """Per-token cross entropy over vocabulary-sharded logits ``[..., V/tp]`` without gathering
    them: the max, the exp-sum and the target logit are reduced over the group. Gradients flow
    through the sums' identity backward, giving each rank ``softmax_r - onehot_r``."""
    logits = logits.astype(float32)
    vloc = logits.shape[-1]
    lmax = F.stop_gradient(logits.max(axis=-1, keepdims=True))
    gmax = F.clone(lmax)
    from . import comm
    if group.size > 1:
        comm.all_reduce(gmax, op="max", group=group)
    shifted = logits - gmax
    sumexp = pa.reduce_from_group(F.sum(F.exp(shifted), -1), group)
    valid = labels != ignore_index
    local = labels - vocab_start
    inside = valid & (local >= 0) & (local < vloc)
    safe = F.where(inside, local, F.zeros_like(local)).astype(int32)
    picked = F.gather(shifted, -1, safe.expand_dims(-1)).squeeze(-1)
    target = pa.reduce_from_group(F.where(inside, picked, F.zeros_like(picked)), group)
    loss = sumexp.log() - target
    return F.where(valid, loss, F.zeros_like(loss))


# --------------------------------------------------------------------------- applying it
def validate_tp(config, tp: int) -> None:
    checks = (("model.num_attention_heads", config.num_attention_heads),
              ("model.num_query_groups", config.num_query_groups),
              ("model.ffn_hidden_size", config.ffn_hidden_size),
              ("model.padded_vocab_size", config.padded_vocab_size))
    for key, value in checks:
        if value % tp:
            raise ValueError(f"{key} ({value}) is not divisible by "
                             f"parallel.tensor_model_parallel_size ({tp})")
    for kind in mixers_used(config):
        plan_for(kind).validate_tp(config, tp)


def _tp_logits(h: Tensor, weight: Tensor, group, sequence_parallel: bool) -> Tensor:
    if sequence_parallel:
        h = pa.gather_from_sequence_parallel(h, group, 1)
    else:
        h = pa.copy_to_group(h, group)
    return hot.linear(h, weight).astype(float32)


def _mark_partial(module) -> None:
    for _, p in module.parameters_and_names():
        add_partial(p, "tp")


def _column(full: nn.Module, group, **kwargs) -> nn.Module:
    """The column-parallel version of ``full`` (a LoRA adapter follows its base weight's
    split)."""
    if isinstance(full, LoRALinear):
        return LoRAColumnParallelLinear(full, group, **kwargs)
    return ColumnParallelLinear(full, group, **kwargs)


def _row(full: nn.Module, group, **kwargs) -> nn.Module:
    if isinstance(full, LoRALinear):
        return LoRARowParallelLinear(full, group, **kwargs)
    return RowParallelLinear(full, group, **kwargs)


@dataclass(frozen=True)
class TensorParallelContext:
    """What a mixer's tensor-parallel plan (``mixer_plans``) splits with: the group and the
    run's sequence-parallel / communication-overlap switches, and the one set of (LoRA-aware)
    builders every split uses. ``overlap=True`` lets a linear overlap its sequence-parallel
    exchange with its GEMM when ``parallel.tp_comm_overlap`` is on."""
    group: object
    sequence_parallel: bool
    comm_overlap: bool

    def column(self, full: nn.Module, sequence_parallel: Optional[bool] = None,
               overlap: bool = False, **kwargs) -> nn.Module:
        sp = self.sequence_parallel if sequence_parallel is None else sequence_parallel
        return _column(full, self.group, sequence_parallel=sp,
                       comm_overlap=self.comm_overlap and overlap, **kwargs)

    def row(self, full: nn.Module, overlap: bool = False, **kwargs) -> nn.Module:
        return _row(full, self.group, sequence_parallel=self.sequence_parallel,
                    comm_overlap=self.comm_overlap and overlap, **kwargs)

    def shard(self, param, dim: int, rows: Optional[np.ndarray] = None):
        return _shard_param(param, dim, self.group.rank, self.group.size, rows)

    @staticmethod
    def mark_partial(module) -> None:
        _mark_partial(module)


def apply_tensor_parallel(model, group, sequence_parallel: bool = False,
                          comm_overlap: bool = False) -> None:
    """Shard a ``GPTModel`` over ``group`` (Megatron's column/row split of every layer, the
    vocabulary-parallel embedding, head and loss), in place. ``comm_overlap``
    (``parallel.tp_comm_overlap``): the attention and MLP linears overlap their sequence-parallel
    exchanges with their GEMMs (``tp_overlap``)."""
    tp, sp = group.size, sequence_parallel
    if tp == 1:
        if sp:
            raise ValueError("parallel.sequence_parallel needs tensor_model_parallel_size > 1")
        return
    c = model.config
    validate_tp(c, tp)
    if comm_overlap and sp:
        tp_overlap.open_exchanges(group)
    mtp = getattr(model, "mtp", None)
    emb = VocabParallelEmbedding(model.embedding.word_embeddings, group, sequence_parallel=sp)
    model.embedding.word_embeddings = emb
    # The MTP depths' transformer layers split like the decoder's; their enorm / hnorm /
    # eh_proj / final_layernorm stay replicated (full inputs, identical gradients per rank;
    # under sequence parallel they see this rank's shard: partial gradients, marked below).
    extra = [m.transformer_layer for m in mtp.layers] if mtp is not None else []

    ctx = TensorParallelContext(group, sp, comm_overlap)
    for layer in list(model.decoder.layers) + extra:
        plan_for(mixer_of(layer.self_attention)).tensor_parallel(layer.self_attention, ctx)
        mlp = layer.mlp
        if not hasattr(mlp, "linear_fc1"):   # a MoE layer: parallel.moe_tensor_parallel
            if sp:
                _mark_partial(layer.input_layernorm)
                _mark_partial(layer.pre_mlp_layernorm)
            continue
        rows = glu_rows(mlp.linear_fc1.out_features, group.rank, tp) \
            if c.gated_linear_unit else None
        mlp.linear_fc1 = _column(mlp.linear_fc1, group, sequence_parallel=sp, rows=rows,
                                 comm_overlap=comm_overlap)
        mlp.linear_fc2 = _row(mlp.linear_fc2, group, sequence_parallel=sp,
                              comm_overlap=comm_overlap)
        if sp:
            _mark_partial(layer.input_layernorm)
            _mark_partial(layer.pre_mlp_layernorm)
    if sp:
        _mark_partial(model.decoder.final_layernorm)
        for m in (mtp.layers if mtp is not None else []):
            # replicated, on this rank's sequence shard (the embedding reduce-scatters)
            for module in (m.enorm, m.hnorm, m.eh_proj, m.final_layernorm):
                _mark_partial(module)
    if model.output_layer is not None:
        model.output_layer = ColumnParallelLinear(model.output_layer, group, sequence_parallel=sp)
    model.compute_logits = functools.partial(_tp_logits, group=group, sequence_parallel=sp)
    model.finalize_logits = functools.partial(pa.gather_from_group, group=group, dim=-1)
    model.loss_fn = functools.partial(vocab_parallel_cross_entropy, group=group,
                                      vocab_start=emb.vocab_start)
