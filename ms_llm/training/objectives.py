"""The loss objectives a training step differentiates, behind one small interface
(:class:`Objective`), so the step and the executors never ask which stage is running.

* :class:`LMObjective` -- next-token cross entropy (pretraining and SFT), plus the MoE
  auxiliary loss and the multi-token-prediction term (:class:`MTPTerm`) when the model has them.
* ``ms_llm.training.dpo.DPOObjective`` -- Direct Preference Optimization (``training.stage: dpo``).

Every objective pre-divides its micro-batch loss by the global batch's unit count (loss tokens,
or pairs for DPO), so summed micro-batch gradients are the gradient of the global mean.
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Protocol, Sequence, Tuple

import numpy as np
from mindspore import Tensor

from ms_llm.compat.autograd import is_recomputing
from ms_llm.parallel import comm


class Objective(Protocol):
    """What a training step needs from a loss.

    ``loss(*micro_batch_args(b, inv))`` is the differentiated function; with ``has_aux`` it
    returns ``(loss, aux)`` and ``micro_batch_loss`` turns the output into the scalar loss (after
    recording what the step metrics need). ``eval_group`` names the process group the
    evaluation sums run over (``"dp"`` or ``"dp_cp"``)."""

    has_aux: bool
    eval_group: str

    def units(self, batches: Sequence[dict]) -> float: ...

    def micro_batch_args(self, b: dict, inv: Tensor) -> tuple: ...

    def loss(self, *args): ...

    def micro_batch_loss(self, out, args: tuple) -> Tensor: ...

    def pipeline_loss(self, per_token: Tensor, b: dict, inv: Tensor) -> Tensor: ...

    def step_metrics(self) -> Dict[str, float]: ...

    def eval_sums(self, b: dict) -> np.ndarray: ...

    def eval_values(self, sums: np.ndarray) -> Dict[str, float]: ...


class ModelInputs:
    """A loader batch as the model's inputs. Packed documents add their masks
    (``data.reset_attention_mask``) and restarting positions (``data.reset_position_ids``); plain
    position_ids are 0..s-1, the model's default, so they are not passed. Under context parallel
    the rank's chunks of the sequence."""

    def __init__(self, context_parallel=None, reset_position_ids: bool = False):
        self.context_parallel, self.reset_position_ids = context_parallel, reset_position_ids

    def __call__(self, b: dict) -> Dict[str, Tensor]:
        if self.context_parallel is not None:
            return self.context_parallel.micro_batch(b, self.reset_position_ids)
        mb = {k: Tensor(b[k]) for k in ("tokens", "labels", "loss_mask")}
        if "attention_mask" in b:
            mb["attention_mask"] = Tensor(b["attention_mask"])
        if self.reset_position_ids and "position_ids" in b:
            mb["position_ids"] = Tensor(b["position_ids"])
        return mb


class MTPTerm:
    """Multi-token prediction (``model.mtp_num_layers``): the MTP block's loss added to the main
    one, and each depth's mean loss logged (Megatron's ``mtp_{k} loss``)."""

    def __init__(self, model, dp_cp_group, pp_group=None):
        self.model, self.dp_cp_group, self.pp_group = model, dp_cp_group, pp_group
        self.log: list = []       # per micro-batch: each depth's mean loss

    def __call__(self, loss_mask: Tensor, inv: Tensor) -> Optional[Tensor]:
        mtp = self.model.mtp_loss(loss_mask)
        if mtp is None:
            return None
        if not is_recomputing():     # a recomputed forward (pipeline backward): log it once
            self.log.append([float(m.asnumpy()) for m in mtp[1]])   # PyNative only
        return mtp[0] * inv

    def metrics(self) -> Dict[str, float]:
        """Each depth's per-token mean, averaged over the step's micro-batches and the
        data-parallel replicas; the step's ``loss`` includes them times
        ``mtp_loss_scaling_factor / mtp_num_layers``."""
        d = self.model.config.mtp_num_layers
        means = np.mean(np.array(self.log, np.float64), axis=0) if self.log else np.zeros(d)
        self.log = []
        if self.pp_group is not None:     # only the last stage ran the MTP block: share it
            means = _summed(means, self.pp_group)
        if self.dp_cp_group.size > 1:
            means = _summed(means, self.dp_cp_group) / self.dp_cp_group.size
        return {f"mtp_{k + 1}_loss": float(v) for k, v in enumerate(means)}


def _summed(values: np.ndarray, group) -> np.ndarray:
    t = Tensor(values.astype(np.float32))
    comm.all_reduce(t, group=group)
    return t.asnumpy().astype(np.float64)


class LMObjective:
    """Next-token cross entropy over the loss mask (pretraining, SFT), with the MoE auxiliary
    loss (``aux_scale``: each rank's aux loss covers its own micro-batch, while gradients are
    summed over micro-batches and data-parallel ranks, so it is averaged by that count) and
    the MTP term."""

    has_aux = False
    eval_group = "dp_cp"    # LM sums are this rank's tokens (under cp its pieces)

    def __init__(self, model, inputs: ModelInputs, aux_scale: Optional[float] = None,
                 mtp: Optional[MTPTerm] = None):
        self.model, self.inputs = model, inputs
        self.aux_scale, self.mtp = aux_scale, mtp

    @staticmethod
    def units(batches: Sequence[dict]) -> float:
        return sum(b["loss_mask"].sum() for b in batches)

    def micro_batch_args(self, b: dict, inv: Tensor) -> tuple:
        mb = self.inputs(b)
        args = (mb["tokens"], mb["labels"], mb["loss_mask"], inv)
        mask, pos = mb.get("attention_mask"), mb.get("position_ids")
        if mask is not None or pos is not None:
            args += (mask,) + ((pos,) if pos is not None else ())
        return args

    def loss(self, tokens: Tensor, labels: Tensor, loss_mask: Tensor, inv_tokens: Tensor,
             attention_mask: Optional[Tensor] = None, position_ids: Optional[Tensor] = None):
        per_token = self.model(tokens, labels=labels, attention_mask=attention_mask,
                               position_ids=position_ids)
        loss = (per_token * loss_mask).sum() * inv_tokens
        if self.aux_scale is not None:
            aux = self.model.aux_loss()
            if aux is not None:
                loss = loss + aux * self.aux_scale
        extra = self.mtp(loss_mask, inv_tokens) if self.mtp is not None else None
        return loss if extra is None else loss + extra

    @staticmethod
    def micro_batch_loss(out, args: tuple) -> Tensor:
        return out

    def pipeline_loss(self, per_token: Tensor, b: dict, inv: Tensor) -> Tensor:
        """The last stage's loss (its chunks add their own aux losses)."""
        loss = (per_token * b["loss_mask"]).sum() * inv
        extra = self.mtp(b["loss_mask"], inv) if self.mtp is not None else None
        return loss if extra is None else loss + extra

    def step_metrics(self) -> Dict[str, float]:
        return self.mtp.metrics() if self.mtp is not None else {}

    def eval_sums(self, b: dict) -> np.ndarray:
        """(loss sum, loss tokens) of one validation micro-batch; the caller holds no_grad."""
        mb = self.inputs(b)
        per_token = self.model(mb["tokens"], labels=mb["labels"],
                               attention_mask=mb.get("attention_mask"),
                               position_ids=mb.get("position_ids"))
        return self.pipeline_eval_sums(per_token, mb)

    @staticmethod
    def pipeline_eval_sums(per_token: Tensor, mb: dict) -> np.ndarray:
        """``eval_sums`` from the last stage's per-token loss of model inputs ``mb``."""
        loss_sum = float((per_token * mb["loss_mask"]).sum().asnumpy())
        return np.array([loss_sum, float(mb["loss_mask"].sum().asnumpy())])

    @staticmethod
    def eval_values(sums: np.ndarray) -> Dict[str, float]:
        loss = float(sums[0] / max(sums[1], 1.0))
        return {"eval_loss": loss, "eval_ppl": math.exp(min(20.0, loss))}


def objective_unit_scale(accum_steps: int, dp_size: int) -> float:
    """The weight of one rank's per-micro-batch auxiliary loss (MoE): gradients are summed over
    ``accum_steps`` micro-batches and ``dp_size`` replicas, so it is averaged by their count."""
    return 1.0 / (accum_steps * dp_size)


def check_objective(objective) -> Tuple[str, ...]:
    """The interface methods ``objective`` lacks (empty when it satisfies :class:`Objective`)."""
    names = ("units", "micro_batch_args", "loss", "micro_batch_loss", "pipeline_loss",
             "step_metrics", "eval_sums", "eval_values")
    return tuple(n for n in names if not callable(getattr(objective, n, None)))
