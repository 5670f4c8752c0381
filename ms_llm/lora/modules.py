"""LoRA adapters around existing linears, and their tensor-parallel shards.

``LoRALinear`` adopts the base module's ``weight`` / ``bias`` Parameters (the same objects, so
state-dict keys, tied references and the loaded values are unchanged; nothing is copied) and
runs the base module's own kernel (``local_matmul``: the fast fp32 GEMM, or MXFP8's recipe when
quantization ran first), then adds the adapter in the adapters' dtype (float32):

    y = base(x) + dropout(x) A^T B^T * alpha / r        A: [r, in], B: [out, r]

As in PEFT, A is kaiming-uniform (a = sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in))) and B is zero,
so a fresh adapter changes nothing. The adapters live in child modules ``lora_A`` / ``lora_B``
with a ``weight`` each: keys ``<linear>.lora_A.weight``, PEFT's own module names.

Tensor parallel asks the module it shards for its parallel version (``column_parallel`` /
``row_parallel``), so the split follows the base weight's:

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

import contextlib
from typing import Iterator, Optional

import numpy as np
from mindspore import Parameter, Tensor

from ms_llm import ops as hot
from ms_llm.compat import F, nn
from ms_llm.parallel import autograd as pa
from ms_llm.parallel.placement import add_partial, placement_of, update_placement
from ms_llm.parallel.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                             _shard_param)

_FROZEN = "lora_frozen_base"


def mark_frozen_base(param: Parameter) -> None:
    """A base weight under an adapter: not trained, not saved in training checkpoints."""
    param.requires_grad = False
    setattr(param, _FROZEN, True)


def is_frozen_base(param) -> bool:
    return bool(getattr(param, _FROZEN, False))


class LoRAWeight(nn.Module):
    """One adapter matrix as a module (``lora_A.weight`` / ``lora_B.weight``, PEFT's names)."""

    def __init__(self, weight: Parameter):
        super().__init__()
        self.weight = weight


def kaiming_uniform_a(r: int, in_features: int, rng: np.random.Generator) -> np.ndarray:
    """PEFT's A init: ``kaiming_uniform_(a=sqrt(5))`` = U(-1/sqrt(in), 1/sqrt(in))."""
    bound = 1.0 / np.sqrt(in_features)
    return rng.uniform(-bound, bound, size=(r, in_features)).astype(np.float32)


class _LoRABranch:
    """The adapter computation shared by the whole-layer and the sharded modules."""

    lora_enabled = True

    def _init_branch(self, lora_A: LoRAWeight, lora_B: LoRAWeight, scaling: float,
                     dropout: float) -> None:
        self.lora_A, self.lora_B = lora_A, lora_B
        self.scaling, self.lora_dropout = scaling, dropout

    def lora_delta(self, x: Tensor) -> Tensor:
        a = self.lora_A.weight
        h = F.dropout(x.astype(a.dtype), self.lora_dropout, self.training)
        return hot.linear(hot.linear(h, a), self.lora_B.weight) * self.scaling

    def add_delta(self, y: Tensor, x: Tensor) -> Tensor:
        if not self.lora_enabled:
            return y
        return y + self.lora_delta(x).astype(y.dtype)


class LoRALinear(_LoRABranch, nn.Module):
    """A base linear (its Parameters and kernel) plus a trainable low-rank adapter."""

    def __init__(self, base: nn.Module, r: int, alpha: float, dropout: float,
                 rng: np.random.Generator):
        super().__init__()
        if getattr(base, "local_matmul", None) is None:
            raise ValueError(f"lora: {type(base).__name__} does not describe its matmul "
                             f"(no local_matmul); only linears can carry an adapter")
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = getattr(base, "bias", None)
        self.base_type = type(base).__name__
        self._base_local_matmul = base.local_matmul
        self.matmul = base.local_matmul(self.in_features, self.out_features,
                                        self.bias is not None)
        a = Parameter(Tensor(kaiming_uniform_a(r, self.in_features, rng)), requires_grad=True)
        b = Parameter(Tensor(np.zeros((self.out_features, r), np.float32)), requires_grad=True)
        if placement_of(self.weight).layout == "glu_halves":   # B's rows are [gate; up] too
            update_placement(b, layout="glu_halves")
        self._init_branch(LoRAWeight(a), LoRAWeight(b), alpha / r, dropout)
        self.r, self.alpha = r, alpha

    def forward(self, x: Tensor) -> Tensor:
        y = self.matmul(x, self.weight, self.bias) if self.bias is not None \
            else self.matmul(x, self.weight)
        return self.add_delta(y, x)

    def local_matmul(self, in_features: int, out_features: int, has_bias: bool):
        """The base kernel of a shard (the adapter is added by the parallel versions)."""
        return self._base_local_matmul(in_features, out_features, has_bias)

    def column_parallel(self, group, **kwargs) -> "LoRAColumnParallelLinear":
        return LoRAColumnParallelLinear(self, group, **kwargs)

    def row_parallel(self, group, **kwargs) -> "LoRARowParallelLinear":
        return LoRARowParallelLinear(self, group, **kwargs)

    def extend_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"r={self.r}, alpha={self.alpha}, base={self.base_type}"


class LoRAColumnParallelLinear(_LoRABranch, ColumnParallelLinear):
    """Column-parallel base; B split on its rows like W, A replicated (gradient partial)."""

    def __init__(self, full: LoRALinear, group, *, sequence_parallel: bool = False,
                 gather_output: bool = False, rows: Optional[np.ndarray] = None):
        super().__init__(full, group, sequence_parallel=sequence_parallel,
                         gather_output=gather_output, rows=rows)
        b = _shard_param(full.lora_B.weight, 0, group.rank, group.size, rows)
        add_partial(full.lora_A.weight, "tp")
        self._init_branch(full.lora_A, LoRAWeight(b), full.scaling, full.lora_dropout)

    def forward(self, x: Tensor) -> Tensor:
        if self.sequence_parallel:
            x = pa.gather_from_sequence_parallel(x, self.group, 1)
        else:
            x = pa.copy_to_group(x, self.group)
        y = self.add_delta(self.matmul(x, self.weight, self.bias), x)
        return pa.gather_from_group(y, self.group, -1) if self.gather_output else y


class LoRARowParallelLinear(_LoRABranch, RowParallelLinear):
    """Row-parallel base; A split on its columns like W, B replicated (gradient partial); the
    adapter's partial output joins the base's before the one reduction."""

    def __init__(self, full: LoRALinear, group, *, sequence_parallel: bool = False):
        super().__init__(full, group, sequence_parallel=sequence_parallel)
        a = _shard_param(full.lora_A.weight, 1, group.rank, group.size)
        add_partial(full.lora_B.weight, "tp")
        self._init_branch(LoRAWeight(a), full.lora_B, full.scaling, full.lora_dropout)

    def forward(self, x: Tensor) -> Tensor:
        y = self.add_delta(self.matmul(x, self.weight), x)
        if self.sequence_parallel:
            y = pa.reduce_scatter_to_sequence_parallel(y, self.group, 1)
        else:
            y = pa.reduce_from_group(y, self.group)
        return y if self.bias is None else y + self.bias


def lora_modules(model) -> Iterator[_LoRABranch]:
    for _, cell in model.cells_and_names():
        if isinstance(cell, _LoRABranch):
            yield cell


def lora_module_names(model) -> list:
    return [n for n, cell in model.cells_and_names() if isinstance(cell, _LoRABranch)]


@contextlib.contextmanager
def adapters_disabled(model):
    """Inside the block the model computes its base output only (every adapter skipped), with
    the same weights and no copy: DPO's reference model under LoRA. PyNative only: a compiled
    (``mindspore.jit``) graph keeps the branch it was traced with."""
    mods = list(lora_modules(model))
    before = [m.lora_enabled for m in mods]
    for m in mods:
        m.lora_enabled = False
    try:
        yield model
    finally:
        for m, was in zip(mods, before):
            m.lora_enabled = was


__all__ = ["LoRALinear", "LoRAColumnParallelLinear", "LoRARowParallelLinear", "LoRAWeight",
           "adapters_disabled", "is_frozen_base", "lora_modules", "lora_module_names",
           "mark_frozen_base"]
