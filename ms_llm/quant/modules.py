"""MXFP8 modules built from existing ones, reusing their weight and bias Parameter objects.

Reusing the Parameters (not copying them) keeps optimizer state, checkpoints, tied references and
state-dict keys unchanged: replacing ``decoder.layers.0.mlp.linear_fc1`` by an ``MXFP8Linear``
leaves ``decoder.layers.0.mlp.linear_fc1.weight`` the same object under the same key.

Tensor parallel: quantization runs before sharding, and ``ColumnParallelLinear`` /
``RowParallelLinear`` ask the module they shard for its ``local_matmul``; ``MXFP8Linear`` answers
with its MXFP8 recipe, so the shard runs the same ``mx_linear`` on its rows or columns.
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence

from mindspore import Parameter, Tensor, mint

from ms_llm.compat import nn
from .mx import BLOCK_SIZE, check_scale_mode, elem_format
from .mx_linear import make_function


class UnalignedDims(ValueError):
    """A module's dims are not multiples of MXFP8's block (``quant.mx_unaligned`` decides)."""


def _check_dims(name: str, **dims: int) -> None:
    bad = {k: v for k, v in dims.items() if v % BLOCK_SIZE}
    if bad:
        raise UnalignedDims(f"quant: module '{name}' has " +
                         ", ".join(f"{k}={v}" for k, v in dims.items()) +
                         f"; MXFP8 needs every one to be a multiple of {BLOCK_SIZE} "
                         f"(add it to quant.ignored_modules)")


class _MXFP8Weights(nn.Module):
    """The MXFP8 recipe over existing ``weight`` / ``bias`` Parameters (reused, not copied)."""

    def _adopt(self, weight: Parameter, bias: Optional[Parameter], scale_mode: str,
               elem_dtype: str, name: str) -> None:
        _check_dims(name or type(self).__name__, in_features=self.in_features,
                    out_features=self.out_features)
        self.weight = weight
        self.bias = bias
        self.scale_mode = check_scale_mode(scale_mode)
        self.elem_dtype = elem_format(elem_dtype).name
        self.mx_fn = make_function(self.elem_dtype, self.scale_mode, bias is not None)

    @classmethod
    def from_float(cls, module: nn.Cell, *, scale_mode: str = "floor",
                   elem_dtype: str = "float8_e4m3fn", name: str = ""):
        """Wrap ``module``'s own ``weight`` and ``bias`` Parameters."""
        return cls(module.weight, getattr(module, "bias", None), scale_mode=scale_mode,
                   elem_dtype=elem_dtype, name=name)


class MXFP8Linear(_MXFP8Weights):
    """``y = x W^T + b`` with MXFP8 GEMMs in forward and backward (``mx_linear``)."""

    def __init__(self, weight: Parameter, bias: Optional[Parameter] = None, *,
                 scale_mode: str = "floor", elem_dtype: str = "float8_e4m3fn", name: str = "",
                 plain_matmul=None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self._adopt(weight, bias, scale_mode, elem_dtype, name)
        self.module_name = name
        # quant.mx_unaligned keep: the source module's own ``local_matmul`` (high precision),
        # used for a tensor-parallel shard whose dims are not multiples of 32
        self.plain_matmul = plain_matmul
        self.kept = None                  # apply_quantization's KeptModules: shards kept listed

    def forward(self, x: Tensor) -> Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        y = self.mx_fn(x2, self.weight, self.bias) if self.bias is not None \
            else self.mx_fn(x2, self.weight)
        return y.reshape(*lead, self.out_features)

    def local_matmul(self, in_features: int, out_features: int, has_bias: bool):
        """The MXFP8 ``(x, weight, bias=None) -> y`` for a tensor-parallel shard
        ``[out_features, in_features]`` of this layer (quantization runs before sharding, so the
        shard keeps the recipe); the local dims must stay multiples of 32, else (with
        ``quant.mx_unaligned: keep``) the shard runs the source module's own matmul."""
        try:
            _check_dims(f"{self.module_name or type(self).__name__} (tensor-parallel shard)",
                        in_features=in_features, out_features=out_features)
        except UnalignedDims:
            if self.plain_matmul is None:
                raise
            if self.kept is not None:
                self.kept.names.append(f"{self.module_name} (tensor-parallel shard "
                                       f"{in_features}x{out_features})")
            return self.plain_matmul(in_features, out_features, has_bias)
        return functools.partial(apply_mx_matmul,
                                 make_function(self.elem_dtype, self.scale_mode, has_bias))

    def extend_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"bias={self.bias is not None}, {self.elem_dtype}, scale_mode={self.scale_mode}"


class MXFP8GroupedLinear(_MXFP8Weights):
    """MoE experts as one grouped MXFP8 GEMM: ``weight [E, out, in]``; ``forward(x, sizes)``
    takes tokens sorted by expert and ``tokens_per_expert`` (Python ints: static shapes).

    Each expert's slice goes through ``mx_linear``'s recipe on its own tokens (blocks never span
    two experts, as in CANN's grouped MX quantization). The source module contract (a grouped
    expert linear of an MoE layer): a ``weight`` Parameter of shape ``[E, out, in]``, optional
    ``bias`` ``[E, out]``, and ``forward(x, tokens_per_expert)``.
    """

    def __init__(self, weight: Parameter, bias: Optional[Parameter] = None, *,
                 scale_mode: str = "floor", elem_dtype: str = "float8_e4m3fn", name: str = ""):
        super().__init__()
        if weight.ndim != 3:
            raise ValueError(f"quant: module '{name}': grouped experts need a weight of shape "
                             f"[experts, out, in], got {tuple(weight.shape)}")
        self.num_experts, self.out_features, self.in_features = weight.shape
        self._adopt(weight, bias, scale_mode, elem_dtype, name)

    def forward(self, x: Tensor, tokens_per_expert: Sequence[int]) -> Tensor:
        sizes = [int(s) for s in tokens_per_expert]
        if len(sizes) != self.num_experts or sum(sizes) != x.shape[0]:
            raise ValueError(f"MXFP8GroupedLinear: tokens_per_expert {sizes} does not match "
                             f"{self.num_experts} experts and {x.shape[0]} tokens")
        outs, start = [], 0
        for e, n in enumerate(sizes):
            if n == 0:
                continue
            xe = mint.narrow(x, 0, start, n)
            start += n
            if self.bias is not None:
                outs.append(self.mx_fn(xe, self.weight[e], self.bias[e]))
            else:
                outs.append(self.mx_fn(xe, self.weight[e]))
        if not outs:
            return mint.zeros((0, self.out_features), dtype=x.dtype)
        return mint.cat(outs, 0)


def apply_mx_matmul(fn, x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    y = fn(x2, weight, bias) if bias is not None else fn(x2, weight)
    return y.reshape(*lead, weight.shape[0])


class MXFP8GroupedMLP(nn.Module):
    """Megatron's ``GroupedMLP`` (``weight1 [H, E*2F]`` viewed ``[E, H, 2F]``, ``weight2
    [E*F, H]`` viewed ``[E, F, H]``) with each expert's two GEMMs through ``mx_linear``'s MXFP8
    recipe: 32-blocks along each GEMM's K, never spanning two experts. The Parameters are the
    original ones (names, optimizer state and checkpoint layout unchanged)."""

    def __init__(self, weight1: Parameter, weight2: Parameter, num_local_experts: int, *,
                 scale_mode: str = "floor", elem_dtype: str = "float8_e4m3fn", name: str = ""):
        super().__init__()
        e = num_local_experts
        hidden, ffn = weight1.shape[0], weight2.shape[0] // e
        _check_dims(name or type(self).__name__, hidden_size=hidden, moe_ffn_hidden_size=ffn)
        self.weight1, self.weight2 = weight1, weight2
        self.num_local_experts = e
        self.scale_mode = check_scale_mode(scale_mode)
        self.elem_dtype = elem_format(elem_dtype).name
        self.mx_fn = make_function(self.elem_dtype, self.scale_mode, False)

    @classmethod
    def from_float(cls, module: nn.Cell, *, scale_mode: str = "floor",
                   elem_dtype: str = "float8_e4m3fn", name: str = "") -> "MXFP8GroupedMLP":
        return cls(module.weight1, module.weight2, module.num_local_experts,
                   scale_mode=scale_mode, elem_dtype=elem_dtype, name=name)

    def plain_linears(self) -> bool:
        """Quantized: fused pipelines that run raw-weight GEMMs (MegaMoE) must refuse it."""
        return False

    def forward(self, x: Tensor, tokens_per_expert: Sequence[int]) -> Tensor:
        from ms_llm import ops as hot
        from ms_llm.compat import F
        e, hidden = self.num_local_experts, self.weight1.shape[0]
        sizes = [int(s) for s in tokens_per_expert]
        if len(sizes) != e or sum(sizes) != x.shape[0]:
            raise ValueError(f"MXFP8GroupedMLP: tokens_per_expert {sizes} does not match {e} "
                             f"experts and {x.shape[0]} tokens")
        w1 = self.weight1.reshape(e, hidden, -1)      # expert i: [H, 2F] = (in, out)
        w2 = self.weight2.reshape(e, -1, hidden)      # expert i: [F, H]
        outs = []
        for i, (xe, n) in enumerate(zip(F.split(x, sizes, 0), sizes)):
            if n == 0:
                continue
            h = self.mx_fn(xe, w1[i].swapaxes(0, 1).contiguous())      # mx_fn wants [out, in]
            outs.append(self.mx_fn(hot.swiglu(h), w2[i].swapaxes(0, 1).contiguous()))
        if not outs:
            return mint.zeros((0, hidden), dtype=x.dtype)
        return outs[0] if len(outs) == 1 else mint.cat(outs, 0)
