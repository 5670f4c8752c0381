"""The split backward of zero-bubble schedules: ``B`` gives the input gradient now, ``W`` the weight
gradient later (Megatron's zero-bubble ``WeightGradStore`` idea, written afresh).

Only the linear layers split, as in the paper: their weight gradient ``dW = dy^T x`` is the half of
a linear's backward that nobody downstream waits for. ``split_weight_grads`` swaps each plain
``Linear`` of a pipeline chunk's transformer layers and its output layer for
:class:`SplitWeightGradLinear` (same ``weight``/``bias`` Parameters, so names, placements and
checkpoints do not change). Its backward returns ``dx`` and, while a :class:`WeightGradStore` is
collecting for a micro-batch, records ``(weight, x, dy)`` instead of computing ``dW``; ``W`` pops
the records and computes them. Norms, embeddings, biases and tensor-parallel or expert linears keep
their weight gradient in B.
"""
from __future__ import annotations

import contextlib
from typing import Dict, Hashable, List, Optional, Tuple

from mindspore import Tensor

from ms_llm.compat import nn
from ms_llm.compat.autograd import Function
from ms_llm.ops.linear import Linear, bmm, linear

Record = Tuple[object, Tensor, Tensor]     # (weight Parameter, x [M, K], dy [M, N])


class WeightGradStore:
    """Deferred ``(weight, x, dy)`` triples per micro-batch key, from B until W."""

    def __init__(self) -> None:
        self.key: Optional[Hashable] = None
        self.records: Dict[Hashable, List[Record]] = {}

    @contextlib.contextmanager
    def collecting(self, key: Hashable):
        """Within: split linears record their weight gradient under ``key`` (the B of a
        micro-batch) instead of computing it."""
        before, self.key = self.key, key
        try:
            yield
        finally:
            self.key = before

    def record(self, weight, x: Tensor, dy: Tensor) -> None:
        self.records.setdefault(self.key, []).append((weight, x, dy))

    def pop(self, key: Hashable) -> List[Record]:
        return self.records.pop(key, [])

    @staticmethod
    def weight_grad(x: Tensor, dy: Tensor) -> Tensor:
        """``dW = dy^T x`` (the BLAS kernel reads dy transposed in place)."""
        return bmm(dy, x, transpose_a=True)


class _SplitLinear(Function):
    """``y = x W^T`` whose backward defers ``dW`` while its store collects."""

    @staticmethod
    def forward(ctx, store, x, weight):
        ctx.store, ctx.weight = store, weight
        ctx.save_for_backward(x)
        return linear(x, weight)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        w = ctx.weight
        x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
        dx = bmm(dy2, w).reshape(x.shape)
        if ctx.store.key is None:         # not inside a split B: the whole backward now
            return None, dx, WeightGradStore.weight_grad(x2, dy2)
        ctx.store.record(w, x2, dy2)
        return None, dx, None


class SplitWeightGradLinear(nn.Module):
    """A ``Linear`` (same parameters) whose weight gradient a zero-bubble W computes."""

    def __init__(self, base, store: WeightGradStore):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        self._store = [store]          # a list: not a sub-cell

    def forward(self, x: Tensor) -> Tensor:
        y = _SplitLinear.apply(self._store[0], x, self.weight)
        return y if self.bias is None else y + self.bias


def _swap(parent, attr: str, cell, store: WeightGradStore) -> None:
    params = [p for p in (cell.weight, cell.bias) if p is not None]
    names = [p.name for p in params]
    setattr(parent, attr, SplitWeightGradLinear(cell, store))
    for p, full in zip(params, names):   # attaching re-prefixes: keep the model's names
        p.name = full


def _splits(cell) -> bool:
    """Exactly ``Linear`` in fp32: tensor-parallel, LoRA or quantized linears keep their own
    backward."""
    from ms_llm.compat import float32
    return type(cell) is Linear and cell.weight.dtype == float32


def split_weight_grads(chunk, store: WeightGradStore) -> int:
    """Swap the plain fp32 ``Linear`` layers of ``chunk``'s transformer layers, and its output
    layer (on the last stage, the largest weight gradient of all: hidden x vocabulary), for
    :class:`SplitWeightGradLinear`; returns how many."""
    swapped = 0
    for layer in chunk.decoder.layers:
        for name, cell in list(layer.cells_and_names()):
            if not _splits(cell):
                continue
            parent_name, _, attr = name.rpartition(".")
            parent = layer if not parent_name else dict(layer.cells_and_names())[parent_name]
            _swap(parent, attr, cell, store)
            swapped += 1
    if getattr(chunk, "output_layer", None) is not None and _splits(chunk.output_layer):
        _swap(chunk, "output_layer", chunk.output_layer, store)
        swapped += 1
    return swapped
