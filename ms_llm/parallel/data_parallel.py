"""Data-parallel gradient synchronisation in buckets, overlapped with backward (Megatron DDP).

Parameters are grouped into buckets of ~``bucket_mb`` in reverse registration order (roughly the
order backward produces their gradients). In PyNative, a gradient hook on every parameter adds the
micro-batch gradient into that parameter's accumulator; on the last micro-batch of a step, when a
bucket's last gradient arrives, the bucket is flattened and its all-reduce starts asynchronously
while backward continues. ``finish()`` waits and hands back the reduced gradients. Under
``mindspore.jit`` hooks do not run, so ``reduce(grads)`` does the same bucketed all-reduce after
backward. The loss is pre-divided by the global token count, so the reduction is a sum.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np
from mindspore import Parameter, Tensor, mint

from ms_llm.compat import bfloat16, float32
from . import comm


def grad_reduce_dtype(cfg):
    """The dtype gradients are accumulated and reduced in: bf16 under ``training.bf16`` with
    ``parallel.grad_reduce_in_fp32: false``, fp32 otherwise (Megatron's ``grad_reduce_in_fp32``).
    The rule of the gradient reduction, so ``parallel`` owns it (it imports no ``training``)."""
    return bfloat16 if cfg.training.bf16 and not cfg.parallel.grad_reduce_in_fp32 else float32


class GradBuckets:
    def __init__(self, params: Sequence[Parameter], group: comm.ProcessGroup,
                 bucket_mb: float = 25.0, overlap: bool = True, enabled: bool = True,
                 grad_dtype=float32):
        self.params = list(params)
        # fp32, or bf16 (training.bf16 with parallel.grad_reduce_in_fp32 false): the dtype of
        # the micro-batch sums and of the all-reduce
        self.grad_dtype = grad_dtype
        self.group = group
        self.enabled = enabled and group.size > 1
        self.overlap = overlap and self.enabled
        cap = max(1, int(bucket_mb * 2 ** 20 / 4))
        self.buckets: List[List[int]] = []
        current, size = [], 0
        for i in reversed(range(len(self.params))):
            current.append(i)
            size += int(np.prod(self.params[i].shape))
            if size >= cap:
                self.buckets.append(current)
                current, size = [], 0
        if current:
            self.buckets.append(current)
        self.bucket_of = {i: b for b, idx in enumerate(self.buckets) for i in idx}
        self._acc: List[Optional[Tensor]] = [None] * len(self.params)
        self._pending = [0] * len(self.buckets)
        self._works: list = []
        self._last = False
        self._active = False
        if self.overlap:
            for i, p in enumerate(self.params):
                p.register_hook(self._hook(i))

    # --------------------------------------------------------------- overlapped (PyNative)
    def begin_micro_batch(self, is_last: bool) -> None:
        """Call before each micro-batch's forward/backward of a step."""
        self._active, self._last = self.overlap, is_last
        if is_last:
            self._pending = [len(b) for b in self.buckets]

    def _hook(self, i: int):
        def hook(grad):
            if not self._active:
                return grad
            g = grad if grad.dtype == self.grad_dtype else grad.astype(self.grad_dtype)
            self._acc[i] = g if self._acc[i] is None else self._acc[i] + g
            if self._last:
                b = self.bucket_of[i]
                self._pending[b] -= 1
                if self._pending[b] == 0:
                    self._launch(b)
            return grad
        return hook

    def _launch(self, b: int) -> None:
        idx = self.buckets[b]
        flat = mint.cat([self._acc[i].astype(self.grad_dtype).reshape(-1) for i in idx])
        self._works.append((b, flat, comm.all_reduce(flat, group=self.group, async_op=True)))

    def finish(self) -> List[Tensor]:
        """Wait for every bucket and return the reduced, accumulated gradients (param order)."""
        if not self._works or len(self._works) != len(self.buckets):
            raise RuntimeError("data parallel: not every gradient bucket was reduced; was "
                               "begin_micro_batch(is_last=True) called before the last backward?")
        out: List[Optional[Tensor]] = [None] * len(self.params)
        for b, flat, work in self._works:
            work.wait()
            self._unflatten(b, flat, out)
        self._works, self._acc, self._active = [], [None] * len(self.params), False
        return out

    # --------------------------------------------------------------- after backward (jit)
    def reduce(self, grads: Sequence[Tensor]) -> List[Tensor]:
        if not self.enabled:
            return list(grads)
        out: List[Optional[Tensor]] = [None] * len(self.params)
        works = []
        for b, idx in enumerate(self.buckets):
            flat = mint.cat([grads[i].astype(self.grad_dtype).reshape(-1) for i in idx])
            works.append((b, flat, comm.all_reduce(flat, group=self.group, async_op=True)))
        for b, flat, work in works:
            work.wait()
            self._unflatten(b, flat, out)
        return out

    def _unflatten(self, b: int, flat: Tensor, out: list) -> None:
        offset = 0
        for i in self.buckets[b]:
            p = self.params[i]
            n = int(np.prod(p.shape))
            out[i] = mint.narrow(flat, 0, offset, n).reshape(p.shape)   # in grad_dtype
            offset += n


class PartitionedGradSync:
    """Several ``GradBuckets`` over disjoint parameter sets, each reduced over its own group
    (dense parameters over data parallel, expert parameters over expert-data parallel), behind
    the ``GradBuckets`` interface in the trainer's parameter order. Overlap with backward only
    when every part has peers to reduce with (a one-rank part has no hooks that would
    accumulate its gradients); otherwise every part reduces after backward."""

    def __init__(self, parts: Sequence[tuple], overlap: bool = True, buckets=None, **kwargs):
        """``parts``: ``(param indices, params, group, enabled)``; ``kwargs`` go to every
        ``GradBuckets`` (or ``buckets``, a subclass: the distributed optimizer's
        reduce-scatter)."""
        buckets = buckets or GradBuckets
        parts = [p for p in parts if p[0]]
        overlap = overlap and all(on and group.size > 1 for _, _, group, on in parts)
        self.parts = [(list(idx), buckets(params, group, overlap=overlap, enabled=on,
                                          **kwargs))
                      for idx, params, group, on in parts]
        self.n = sum(len(idx) for idx, _ in self.parts)
        self.overlap = overlap

    def begin_micro_batch(self, is_last: bool) -> None:
        for _, b in self.parts:
            b.begin_micro_batch(is_last)

    def _stitch(self, per_part) -> List[Tensor]:
        out: List[Optional[Tensor]] = [None] * self.n
        for (idx, _), grads in zip(self.parts, per_part):
            for i, g in zip(idx, grads):
                out[i] = g
        return out

    def finish(self) -> List[Tensor]:
        return self._stitch([b.finish() for _, b in self.parts])

    def reduce(self, grads: Sequence[Tensor]) -> List[Tensor]:
        return self._stitch([b.reduce([grads[i] for i in idx]) for idx, b in self.parts])
