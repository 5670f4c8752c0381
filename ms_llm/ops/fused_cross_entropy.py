"""The output layer and the cross entropy in one op, over chunks of tokens
(``model.cross_entropy_loss_fusion``).

The plain head materialises the logits ``[tokens, vocab]`` in fp32 (268 MB for 2048 tokens at
vocab 32000), their log-softmax and, in backward, a gradient of the same size, and the autograd
graph keeps the logits alive from forward to backward. Here (the idea of Liger-Kernel's fused
linear cross entropy and of Megatron's fused cross entropy, written for this code base):

* forward: for each chunk of ``c`` tokens, ``logits_c = h_c W^T`` (fp32), then the per-token loss
  and ``logsumexp`` (the AOT cross-entropy kernel); only ``loss`` and ``lse`` (``[tokens]`` each)
  are kept;
* backward (a custom ``bprop``, so autograd keeps nothing else): per chunk the logits are
  recomputed, ``dlogits_c = (softmax - onehot) * dloss_c`` comes from the saved ``lse`` in one
  pass (the kernel's backward), and ``dh_c = dlogits_c W``, ``dW += dlogits_c^T h_c`` (the
  linear's backward kernel).

So at most one chunk's logits and their gradient exist at a time: peak memory drops by about
``3 x tokens x vocab x 4`` bytes minus one chunk's. The price is one more output-layer GEMM per
step (the recomputed logits; Liger avoids it by taking the loss reduction inside the op, which a
per-token loss, needed by the trainer's loss mask, DPO and MTP, does not allow).

Numerics: the GEMMs run in fp32 (bf16 parameters and hidden states are widened once per op), the
softmax statistics too, and ``dW`` is accumulated over chunks in fp32, then cast to the weight's
dtype. Ignored labels (``-100``) give loss 0 and no gradient, as ``ops.cross_entropy`` does.

Works in PyNative and under ``mindspore.jit`` (``Cell.bprop``); tensor parallel (the
vocabulary-parallel cross entropy) is not built for it: config checks refuse it.
"""
from __future__ import annotations

from typing import Optional

import mindspore as ms
from mindspore import Tensor, mint, nn, ops
from mindspore.ops import constexpr

from . import cpu_kernels
from ._dispatch import path_for
from .cross_entropy import IGNORE_INDEX
from .linear import linear

# One chunk's fp32 logits take about this many bytes (and as much again for their gradient):
# small enough to stay near the last-level cache scale, large enough for efficient GEMMs.
CHUNK_BYTES = 32 * 2 ** 20


def chunk_tokens_for(vocab: int, chunk_bytes: Optional[int] = None) -> int:
    """Tokens per chunk: ``chunk_bytes`` (default ``CHUNK_BYTES``) of fp32 logits, a multiple of
    16, at least 16."""
    return max(16, ((chunk_bytes or CHUNK_BYTES) // (4 * vocab)) // 16 * 16)


@constexpr
def _bounds(n: int, chunk: int) -> tuple:
    """``((start, end), ...)`` of the chunks of ``n`` rows (a compile-time constant under jit)."""
    return tuple((s, min(s + chunk, n)) for s in range(0, n, chunk))


def _f32(t: Tensor) -> Tensor:
    return t if t.dtype == ms.float32 else t.astype(ms.float32)


# The backward calls functions of its own (not the forward's ``linear``, ``min``...): under
# mindspore.jit a Cell.bprop that calls a function graph its construct also calls fails with
# "The func graph is empty" (MindSpore 2.10).
def _logits_bwd(x: Tensor, w: Tensor) -> Tensor:
    if path_for("linear") == "aot":
        return cpu_kernels.linear_fp32(x, w)
    return mint.matmul(x, w.swapaxes(0, 1))


def _linear_grad(x: Tensor, w: Tensor, dy: Tensor):
    if path_for("linear") == "aot":
        return cpu_kernels.linear_grad(x, w, dy)
    return mint.matmul(dy, w), mint.matmul(dy.swapaxes(0, 1), x)


class ChunkedLinearCrossEntropy(nn.Cell):
    """``(loss [N], lse [N]) = cell(h [N, H], weight [V, H], labels [N] int32)``: the per-token
    cross entropy of ``h @ weight.T`` in chunks of ``chunk`` tokens, gradients for ``h`` and
    ``weight`` (module docstring)."""

    def __init__(self, chunk: int, ignore_index: int = IGNORE_INDEX):
        super().__init__()
        self.chunk, self.ignore_index = int(chunk), int(ignore_index)

    def construct(self, h, weight, labels):
        n = h.shape[0]
        w = _f32(weight)
        if n <= self.chunk:
            return cpu_kernels.cross_entropy_lse(linear(_f32(h), w), labels, self.ignore_index)
        losses, lses = [], []
        for s, e in _bounds(n, self.chunk):
            loss, lse = cpu_kernels.cross_entropy_lse(linear(_f32(h[s:e]), w), labels[s:e],
                                                      self.ignore_index)
            losses.append(loss)
            lses.append(lse)
        return mint.cat(losses), mint.cat(lses)

    def bprop(self, h, weight, labels, out, dout):
        n = h.shape[0]
        w = _f32(weight)
        lse, dloss = out[1], dout[0]
        dhs = []
        dw = None
        for s, e in _bounds(n, self.chunk):
            hc = _f32(h[s:e]) if n > self.chunk else _f32(h)
            logits = _logits_bwd(hc, w)
            dlogits = cpu_kernels.cross_entropy_grad(logits, labels[s:e], lse[s:e], dloss[s:e],
                                                     self.ignore_index)
            dh, dwc = _linear_grad(hc, w, dlogits)
            dhs.append(dh)
            dw = dwc if dw is None else dw + dwc
        dh = dhs[0] if len(dhs) == 1 else mint.cat(dhs)
        return dh.astype(h.dtype), dw.astype(weight.dtype), ops.zeros_like(labels)


_CELLS: dict = {}


def _cell(chunk: int, ignore_index: int) -> ChunkedLinearCrossEntropy:
    key = (chunk, ignore_index)
    if key not in _CELLS:
        _CELLS[key] = ChunkedLinearCrossEntropy(chunk, ignore_index)
    return _CELLS[key]


def fused_linear_cross_entropy(h: Tensor, weight: Tensor, labels: Tensor,
                               ignore_index: int = IGNORE_INDEX,
                               chunk_tokens: Optional[int] = None) -> Tensor:
    """Per-token cross entropy ``labels.shape`` (fp32) of the logits ``h @ weight.T``
    (h [..., H], weight [V, H], labels [...]) without materialising them: equal to
    ``cross_entropy(linear(h, weight), labels)`` up to fp32 summation order."""
    shape = labels.shape
    h2 = h.reshape(-1, h.shape[-1])
    lab = labels.reshape(-1)
    if lab.dtype != ms.int32:
        lab = lab.astype(ms.int32)
    chunk = chunk_tokens or chunk_tokens_for(weight.shape[0])
    loss = _cell(chunk, ignore_index)(h2, weight, lab)[0]
    return loss.reshape(shape)
