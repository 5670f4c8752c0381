"""LoRA adapters around existing linears, and their tensor-parallel shards.

``LoRALinear`` adopts the base module's ``weight`` / ``bias`` Parameters (the same objects, so
state-dict keys, tied references and the loaded values are unchanged; nothing is copied) and
runs the base module's own kernel (``local_matmul``: the fast fp32 GEMM, or MXFP8's recipe when
quantization ran first), then adds the adapter in the adapters' dtype (float32):

    y = base(x) + dropout(x) A^T B^T * alpha / r        A: [r, in], B: [out, r]

As in PEFT, A is kaiming-uniform (a = sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in))) and B is zero,
so a fresh adapter changes nothing. The adapters live in child modules ``lora_A`` / ``lora_B``
with a ``weight`` each: keys ``<linear>.lora_A.weight``, PEFT's own module names.

Tensor parallel shards an adapter like its base weight (``LoRAColumnParallelLinear`` /
``LoRARowParallelLinear`` in ``ms_llm.parallel.tensor_parallel``: parallel builds on the
modules below it, never the other way round).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import numpy as np
from mindspore import Parameter, Tensor

from ms_llm import ops as hot
from ms_llm.compat import F, nn

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


class LoRABranch:
    """The adapter computation shared by the whole-layer and the tensor-parallel modules."""

    lora_enabled = True

    def init_branch(self, lora_A: LoRAWeight, lora_B: LoRAWeight, scaling: float,
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


class LoRALinear(LoRABranch, nn.Module):
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
        self.init_branch(LoRAWeight(a), LoRAWeight(b), alpha / r, dropout)
        self.r, self.alpha = r, alpha

    def forward(self, x: Tensor) -> Tensor:
        y = self.matmul(x, self.weight, self.bias) if self.bias is not None \
            else self.matmul(x, self.weight)
        return self.add_delta(y, x)

    def local_matmul(self, in_features: int, out_features: int, has_bias: bool):
        """The base kernel of a shard (the adapter is added by the parallel versions)."""
        return self._base_local_matmul(in_features, out_features, has_bias)

    def extend_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"r={self.r}, alpha={self.alpha}, base={self.base_type}"


def lora_modules(model) -> Iterator[LoRABranch]:
    for _, cell in model.cells_and_names():
        if isinstance(cell, LoRABranch):
            yield cell


def lora_module_names(model) -> list:
    return [n for n, cell in model.cells_and_names() if isinstance(cell, LoRABranch)]


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


__all__ = ["LoRABranch", "LoRALinear", "LoRAWeight", "adapters_disabled", "is_frozen_base",
           "lora_modules", "lora_module_names", "mark_frozen_base"]
