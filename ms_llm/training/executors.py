"""How a step's micro-batches become a loss and reduced gradients, behind one interface
(:class:`StepExecutor`): :class:`PlainExecutor` runs forward/backward per micro-batch on this
rank's whole model (data, tensor, context, expert parallel and FSDP), :class:`PipelineStepExecutor`
runs the pipeline schedule over this rank's stages. Either returns the step's summed loss (a
Tensor, this rank's part), the gradients after the data-parallel reduction (matching the
optimizer's parameters) and, when the compiled step computed it, the gradients' sum of squares.
"""
from __future__ import annotations

import contextlib
from typing import Optional, Protocol, Sequence, Tuple

import mindspore as ms
from mindspore import Tensor

from ms_llm.compat import F, to_ms_dtype
from ms_llm.parallel import comm
from ms_llm.parallel.pipeline.executor import PipelineExecutor
from ms_llm.parallel.pipeline.schedules import schedule_of
from . import grad as gradlib
from . import mixed_precision
from .callbacks import TrainerCallback
from .objectives import ModelInputs

StepResult = Tuple[Tensor, list, Optional[Tensor]]


class StepExecutor(Protocol):
    def run(self, batches: Sequence[dict], inv: Tensor, step: int) -> StepResult: ...


class PlainExecutor:
    """Forward and backward of each micro-batch (PyNative, or one compiled graph with
    ``training.jit`` for objectives without auxiliary outputs), gradients accumulated or handed
    to the overlapping gradient sync."""

    def __init__(self, objective, params: Sequence, grad_sync, model, fsdp: bool,
                 grad_dtype, jit_cfg=None, callbacks: Optional[TrainerCallback] = None,
                 sync_timer=None):
        self.objective, self.grad_sync, self.model, self.fsdp = objective, grad_sync, model, fsdp
        # the gradient reduction's Megatron timer (observability.timers; none: not timed)
        self.sync_timer = sync_timer or contextlib.nullcontext()
        self.grad_dtype = grad_dtype
        self.callbacks = callbacks if callbacks is not None else TrainerCallback()
        self.grad_fn = ms.value_and_grad(objective.loss, grad_position=None, weights=params,
                                         has_aux=objective.has_aux)
        self.fwd_bwd = None if jit_cfg is None else self._fwd_bwd_jit(jit_cfg)

    def _fwd_bwd_jit(self, cfg):
        """One compiled graph for forward, backward and the gradients' sum of squares (the
        global norm inside the graph saves a per-tensor PyNative dispatch for each gradient)."""
        grad_fn = self.grad_fn
        to_fp32 = mixed_precision.grads_to_fp32 if cfg.training.bf16 \
            and not mixed_precision.reduces_in_bf16(cfg) else mixed_precision.same

        def fwd_bwd(tokens, labels, loss_mask, inv_tokens, attention_mask=None,
                    position_ids=None):
            loss, grads = grad_fn(tokens, labels, loss_mask, inv_tokens, attention_mask,
                                  position_ids)
            grads = to_fp32(grads)   # training.bf16: fp32 gradients leave the graph
            return loss, grads, gradlib.sum_of_squares(grads)
        return ms.jit(fwd_bwd)

    def run(self, batches: Sequence[dict], inv: Tensor, step: int) -> StepResult:
        total_loss, grads, sumsq = None, None, None
        last = len(batches) - 1
        for i, b in enumerate(batches):
            args = self.objective.micro_batch_args(b, inv)
            self.grad_sync.begin_micro_batch(is_last=i == last)
            if self.fsdp:   # reduce-scatter only on the last micro-batch of the step
                self.model.set_requires_gradient_sync(i == last)
            if self.fwd_bwd is not None:
                out, g, sumsq = self.fwd_bwd(*args)
            else:
                out, g = self.grad_fn(*args)
            loss = self.objective.micro_batch_loss(out, args)
            total_loss = loss if total_loss is None else total_loss + loss
            self.callbacks.on_micro_batch_end(step, i)
            if not self.grad_sync.overlap:
                grads = gradlib.accumulate(grads, g, self.grad_dtype)
        with self.sync_timer:
            grads = self.grad_sync.finish() if self.grad_sync.overlap \
                else self.grad_sync.reduce(grads)
        return total_loss, grads, sumsq if len(batches) == 1 else None


class PipelineStepExecutor:
    """All micro-batches through this rank's pipeline stages (``parallel.pipeline``); the loss
    is summed on the last stage and shared over the pipeline group for logging."""

    def __init__(self, pipeline: PipelineExecutor, objective, inputs: ModelInputs, grad_sync,
                 pp_group, sync_timer=None):
        self.pipeline, self.objective, self.inputs = pipeline, objective, inputs
        self.grad_sync, self.pp_group = grad_sync, pp_group
        self.sync_timer = sync_timer or contextlib.nullcontext()

    def run(self, batches: Sequence[dict], inv: Tensor, step: int) -> StepResult:
        def loss_of(per_token, b):
            return self.objective.pipeline_loss(per_token, b, inv)
        loss, grads = self.pipeline.run([self.inputs(b) for b in batches], loss_of)
        loss = F.clone(loss)
        comm.all_reduce(loss, group=self.pp_group)
        with self.sync_timer:
            grads = self.grad_sync.reduce(grads)
        return loss, grads, None


def build_pipeline(chunks, cfg, pstate, accum_steps: int, model_config) -> PipelineExecutor:
    """The pipeline schedule and executor of this rank's model chunks. Raises ValueError for
    a schedule the layout cannot run (the caller names the config keys)."""
    p = cfg.parallel
    vpp = p.virtual_pipeline_model_parallel_size
    spec = schedule_of(p)
    schedule = spec.build(pstate.sizes.pp, accum_steps, vpp)
    tp = pstate.group("tp").size
    seq = cfg.data.seq_length // (tp if p.sequence_parallel else 1)
    seq //= pstate.sizes.cp    # context parallel: each rank's stages carry its chunks
    for chunk in chunks:    # the aux loss weight per micro-batch and replica (under cp each
        # rank's aux loss is its share of the micro-batch's: over dp only)
        chunk.aux_loss_scale = 1.0 / (accum_steps * pstate.group("dp").size)
    c = model_config        # a loaded checkpoint's architecture, not the YAML's
    return PipelineExecutor(chunks, pstate, spec, schedule, vpp,
                            (cfg.training.micro_batch_size, seq, c.hidden_size),
                            to_ms_dtype(c.params_dtype), mixed_precision.grad_dtype(cfg))
