"""Megatron tensor-parallel layers, built from an existing full module by keeping this rank's
shard of its parameters (so a tp run starts from exactly the single-process weights).

Activations are ``[b, s, h]``; with sequence parallel the residual stream is split along ``s``.
Parameters that are sharded carry ``tensor_model_parallel = True`` (the gradient norm sums their
squares over the tp group); replicated parameters whose gradient is only partial on each rank
(norm weights under sequence parallel, QK-norm weights under tp) carry ``tp_partial_grad = True``
and get their gradients all-reduced over the tp group.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
from mindspore import Parameter, Tensor

from ms_llm.compat import F, float32, int32, nn
from ms_llm import ops as hot
from ms_llm.ops import IGNORE_INDEX
from ms_llm.quant.modules import apply_mx_matmul, mx_matmul_like
from . import autograd as pa


def _shard_param(full: Parameter, dim: int, rank: int, size: int,
                 rows: Optional[np.ndarray] = None) -> Parameter:
    data = full.asnumpy()
    if rows is not None:
        part = np.take(data, rows, axis=dim)
    else:
        n = data.shape[dim] // size
        part = np.take(data, np.arange(rank * n, (rank + 1) * n), axis=dim)
    p = Parameter(Tensor(np.ascontiguousarray(part)).astype(full.dtype),
                  requires_grad=full.requires_grad)
    p.tensor_model_parallel = True
    p.tp_dim = dim                      # which dim is split over tp (checkpoint regions)
    p.tp_glu = rows is not None         # rows are [gate_r; up_r] of a fused [gate; up] weight
    return p


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
                 gather_output: bool = False, rows: Optional[np.ndarray] = None):
        super().__init__()
        size, rank = group.size, group.rank
        if full.out_features % size:
            raise ValueError(f"ColumnParallelLinear: {full.out_features} output features are not "
                             f"divisible by tensor_model_parallel_size {size}")
        self.group, self.sequence_parallel, self.gather_output = group, sequence_parallel, \
            gather_output
        self.in_features, self.out_features = full.in_features, full.out_features // size
        self.weight = _shard_param(full.weight, 0, rank, size, rows)
        self.bias = None if full.bias is None else _shard_param(full.bias, 0, rank, size, rows)
        # An MXFP8-quantized source keeps its recipe on the shard (quantization runs first).
        self.mx = mx_matmul_like(full, self.in_features, self.out_features,
                                 self.bias is not None, "ColumnParallelLinear")

    def forward(self, x: Tensor) -> Tensor:
        if self.sequence_parallel:
            x = pa.gather_from_sequence_parallel(x, self.group, 1)
        else:
            x = pa.copy_to_group(x, self.group)
        y = apply_mx_matmul(self.mx, x, self.weight, self.bias) if self.mx is not None \
            else hot.linear(x, self.weight, self.bias)
        return pa.gather_from_group(y, self.group, -1) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """``Y = sum_r X_r W_r^T``: input features split; the partial outputs are all-reduced (or
    reduce-scattered along the sequence under sequence parallel); the bias is added after."""

    def __init__(self, full: nn.Linear, group, *, sequence_parallel: bool = False):
        super().__init__()
        size, rank = group.size, group.rank
        if full.in_features % size:
            raise ValueError(f"RowParallelLinear: {full.in_features} input features are not "
                             f"divisible by tensor_model_parallel_size {size}")
        self.group, self.sequence_parallel = group, sequence_parallel
        self.in_features, self.out_features = full.in_features // size, full.out_features
        self.weight = _shard_param(full.weight, 1, rank, size)
        self.bias = full.bias
        if self.bias is not None and sequence_parallel:
            self.bias.tp_partial_grad = True
        self.mx = mx_matmul_like(full, self.in_features, self.out_features, False,
                                 "RowParallelLinear")

    def forward(self, x: Tensor) -> Tensor:
        y = apply_mx_matmul(self.mx, x, self.weight) if self.mx is not None \
            else hot.linear(x, self.weight)
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
