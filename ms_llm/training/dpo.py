"""Direct Preference Optimization (``training.stage: dpo``), as TRL's ``DPOTrainer`` and
MindSpeed-LLM's DPO stage compute it.

Per pair, with ``pi_*`` / ``ref_*`` the summed log-probabilities of the reply tokens (the SFT
loss mask) under the policy / the frozen reference, and ``logits = (pi_c - pi_r) - (ref_c - ref_r)``:

* ``sigmoid``: ``-logsigmoid(beta*logits)*(1-ls) - logsigmoid(-beta*logits)*ls``
* ``hinge``:   ``relu(1 - beta*logits)``
* ``ipo``:     ``(logits - 1/(2*beta))**2``; as in TRL, the log-probabilities are averaged over
  the reply tokens for ipo (TRL's ``concatenated_forward`` divides by the mask's length when
  ``loss_type == "ipo"``), for the policy and the reference alike.

Under context parallel each rank holds two chunks of every row (split as a training batch):
the per-row sums add the cp ranks' pieces, the policy's with gradient, before the loss
(``CPRows`` in ``ms_llm.parallel.context_parallel.sequence_sums``).

Rewards (logged, not differentiated): ``beta * (pi - ref)`` per side; accuracy is the share of
pairs whose chosen reward exceeds the rejected one, margin the mean difference.

The reference. A frozen reference must give the starting weights' log-probs. Here the trainer's
own model computes them under ``no_grad`` with the starting weights swapped in for the forward
(``FrozenReference``): one copy of this rank's parameter shards, not a second model. A second
GPTModel would need its own parallelize pass (tensor-parallel splits, FSDP units and their
communication) for the same memory; swapping reuses the policy's layout as is, at the price of
three parameter-sized copies per micro-batch (small next to a forward). Precomputing every
reference log-prob before training would need a pass over all the samples the run will read. The snapshot is taken before a
resume loads the checkpoint, so a resumed run keeps the weights the run started from (they are
rebuilt from ``checkpoint.load`` / the seed, as at the start). With LoRA the reference is the
base model with the adapters off, no copy: ``reference_for`` is the one place that plugs it in.
"""
from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Dict, List, Optional, Sequence

import numpy as np
from mindspore import Tensor, mint

from ms_llm.compat import F, no_grad
from ms_llm.data.pairwise import pair_rows
from ms_llm.parallel import comm

LOSS_TYPES = ("sigmoid", "hinge", "ipo")
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracy", "rewards/margin")


class WholeRows:
    """Every row's tokens are on this rank: the model inputs are the rows as they are and a
    row's sums need no communication. ``ms_llm.parallel.context_parallel.sequence_sums.CPRows``
    is the context-parallel counterpart (each rank holds pieces of every row)."""

    share = 1.0     # this rank's share of the (replicated) pair losses

    @staticmethod
    def model_inputs(rows: Dict[str, np.ndarray]) -> Dict[str, object]:
        return {k: Tensor(v) for k, v in rows.items() if k != "position_ids"}

    @staticmethod
    def sum_logps(x: Tensor) -> Tensor:
        return x

    @staticmethod
    def sum_counts(x: Tensor) -> Tensor:
        return x


def dpo_pieces(context_parallel) -> dict:
    """``DPOObjective``'s keyword for the run's layout: under context parallel its rows are
    split over the cp ranks (``CPRows``); otherwise nothing (``WholeRows``)."""
    if context_parallel is None:
        return {}
    from ms_llm.parallel.context_parallel.sequence_sums import CPRows
    return {"pieces": CPRows(context_parallel)}


def sequence_logps(per_token_nll: Tensor, loss_mask: Tensor, average: bool,
                   pieces=WholeRows) -> Tensor:
    """Rows' reply log-probabilities ``[rows]`` from the model's per-token cross entropy
    (``pieces`` adds up the pieces of rows spread over ranks)."""
    logp = pieces.sum_logps(-(per_token_nll * loss_mask).sum(-1))
    if average:   # ipo (TRL): per-token mean; an empty reply counts as one token
        logp = logp / mint.clamp(pieces.sum_counts(loss_mask.sum(-1)), min=1.0)
    return logp


def dpo_loss(pi_c: Tensor, pi_r: Tensor, ref_c: Tensor, ref_r: Tensor, beta: float,
             loss_type: str, label_smoothing: float = 0.0) -> Tensor:
    """Per-pair DPO losses ``[pairs]`` (formulas in the module docstring)."""
    logits = (pi_c - pi_r) - (ref_c - ref_r)
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * logits) * (1.0 - label_smoothing) \
            - F.logsigmoid(-beta * logits) * label_smoothing
    if loss_type == "hinge":
        return mint.nn.functional.relu(1.0 - beta * logits)
    if loss_type == "ipo":
        return (logits - 1.0 / (2.0 * beta)) ** 2
    raise ValueError(f"dpo.loss_type must be one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")


class FrozenReference:
    """The starting values of ``params``; ``with ref.active():`` runs code on them and puts the
    current values back afterwards. Values are copied in place (not rebound with ``set_data``),
    so whatever holds a parameter's storage (optimizer kernels, hooks) keeps seeing it."""

    def __init__(self, params: Sequence):
        self.params = list(params)
        self.initial = [F.clone(p) for p in self.params]

    @contextlib.contextmanager
    def active(self):
        current = [F.clone(p) for p in self.params]
        for p, v in zip(self.params, self.initial):
            F.copy_(p, v)
        try:
            yield
        finally:
            for p, v in zip(self.params, current):
                F.copy_(p, v)


def reference_for(model, params: Sequence, lora: bool = False) -> Callable[[], ContextManager]:
    """A factory of contexts under which ``model`` computes the reference.

    Full fine-tuning: the starting weights swapped in (``FrozenReference``). LoRA: the base
    weights are frozen, so the base with the adapters off (``ms_llm.lora.adapters_disabled``)
    is the reference, and nothing is copied."""
    if lora:
        from ms_llm.lora import adapters_disabled
        return lambda: adapters_disabled(model)
    return FrozenReference(params).active


class DPOObjective:
    """What the trainer needs for a DPO step: the micro-batch arguments (with the reference
    log-probs), the differentiated loss (which returns the policy log-probs as auxiliary output)
    and the reward metrics of the step (an ``ms_llm.training.objectives.Objective``)."""

    has_aux = True       # the loss returns the policy log-probs too
    eval_group = "dp"    # DPO sums are whole pairs, alike on the cp ranks

    def __init__(self, cfg, model, params: Sequence, dp_group, moe_aux_scale: Optional[float],
                 reference: Optional[Callable[[], ContextManager]] = None, pieces=WholeRows):
        self.beta, self.loss_type = float(cfg.beta), cfg.loss_type
        self.label_smoothing = float(cfg.label_smoothing)
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"dpo.loss_type must be one of {', '.join(LOSS_TYPES)}")
        self.model, self.dp_group = model, dp_group
        self.moe_aux_scale = moe_aux_scale
        self.reference = reference or reference_for(model, params)
        self._sums: List[np.ndarray] = []
        # Under context parallel each rank holds pieces of every row: per-row log-prob sums
        # are summed over the cp ranks (with gradient) before the loss, which every cp rank
        # then computes alike and weights by its share.
        self.pieces = pieces

    # ------------------------------------------------------------------ per micro-batch
    @staticmethod
    def pairs(batches: Sequence[dict]) -> int:
        return sum(len(b["chosen_tokens"]) for b in batches)

    def units(self, batches: Sequence[dict]) -> int:
        return self.pairs(batches)

    def micro_batch_loss(self, out, args: tuple) -> Tensor:
        """The loss of ``loss(*args)``'s output; records the micro-batch's rewards (``args[3]``
        holds the reference log-probs)."""
        loss, logps = out
        self.record(logps, args[3])
        return loss

    @staticmethod
    def pipeline_loss(per_token: Tensor, b: dict, inv: Tensor) -> Tensor:
        raise NotImplementedError("training.stage dpo under pipeline parallel is not built yet")

    def rows(self, b: dict) -> Dict[str, object]:
        """The ``2B`` rows as this rank's model inputs (tokens, labels, loss_mask, and under
        context parallel its pieces' positions and block mask)."""
        return self.pieces.model_inputs(pair_rows(b))

    def _nll(self, rows: Dict[str, object]) -> Tensor:
        return self.model(rows["tokens"], labels=rows["labels"],
                          attention_mask=rows.get("attention_mask"),
                          position_ids=rows.get("position_ids"))

    def _logps(self, nll: Tensor, loss_mask: Tensor) -> Tensor:
        return sequence_logps(nll, loss_mask, self.loss_type == "ipo", self.pieces)

    def reference_logps(self, rows: Dict[str, object]) -> Tensor:
        """Reference log-probs of the ``2B`` rows: no gradient, reference weights."""
        with no_grad(), self.reference():
            return F.clone(self._logps(self._nll(rows), rows["loss_mask"]))

    def micro_batch_args(self, b: dict, inv_pairs: Tensor) -> tuple:
        rows = self.rows(b)
        args = (rows["tokens"], rows["labels"], rows["loss_mask"],
                self.reference_logps(rows), inv_pairs)
        if "attention_mask" in rows:     # context parallel: the pieces' mask and positions
            args += (rows["attention_mask"], rows["position_ids"])
        return args

    def loss(self, tokens: Tensor, labels: Tensor, loss_mask: Tensor, ref_logps: Tensor,
             inv_pairs: Tensor, attention_mask=None, position_ids=None):
        """(sum of the pairs' losses x ``inv_pairs``, policy log-probs): summed over micro-batches
        and data-parallel ranks, the gradients are those of the global batch's mean loss."""
        nll = self._nll({"tokens": tokens, "labels": labels, "attention_mask": attention_mask,
                         "position_ids": position_ids})
        logps = self._logps(nll, loss_mask)
        n = logps.shape[0] // 2
        losses = dpo_loss(logps[:n], logps[n:], ref_logps[:n], ref_logps[n:], self.beta,
                          self.loss_type, self.label_smoothing)
        loss = losses.sum() * inv_pairs
        if self.pieces.share != 1.0:
            loss = loss * self.pieces.share
        if self.moe_aux_scale is not None:
            aux = self.model.aux_loss()
            if aux is not None:
                loss = loss + aux * self.moe_aux_scale
        return loss, logps

    # ------------------------------------------------------------------ evaluation
    def eval_sums(self, b: dict) -> np.ndarray:
        """(loss sum, chosen, rejected, correct, margin sums, pairs) of one validation
        micro-batch; the caller holds no_grad."""
        rows = self.rows(b)
        ref = self.reference_logps(rows)
        pi = self._logps(self._nll(rows), rows["loss_mask"])
        n = pi.shape[0] // 2
        losses = dpo_loss(pi[:n], pi[n:], ref[:n], ref[n:], self.beta, self.loss_type,
                          self.label_smoothing)
        return np.concatenate([[float(losses.sum().asnumpy())], self._reward_sums(pi, ref)])

    @staticmethod
    def eval_values(sums: np.ndarray) -> Dict[str, float]:
        n = max(sums[5], 1.0)
        return {"eval_loss": float(sums[0] / n),
                **{f"eval_{k}": float(sums[1 + i] / n) for i, k in enumerate(METRICS)}}

    # ------------------------------------------------------------------ metrics
    def _reward_sums(self, policy_logps: Tensor, ref_logps: Tensor) -> np.ndarray:
        pi, ref = policy_logps.asnumpy().astype(np.float64), ref_logps.asnumpy().astype(np.float64)
        n = len(pi) // 2
        chosen, rejected = self.beta * (pi[:n] - ref[:n]), self.beta * (pi[n:] - ref[n:])
        return np.array([chosen.sum(), rejected.sum(), (chosen > rejected).sum(),
                         (chosen - rejected).sum(), n])

    def record(self, policy_logps: Tensor, ref_logps: Tensor) -> None:
        """Accumulate the micro-batch's reward sums (chosen, rejected, correct, margin, pairs)."""
        self._sums.append(self._reward_sums(policy_logps, ref_logps))

    def step_metrics(self) -> Dict[str, float]:
        """The recorded micro-batches' means over the data-parallel group; resets the sums."""
        total = np.sum(self._sums, axis=0) if self._sums else np.zeros(5)
        self._sums = []
        if self.dp_group.size > 1:
            t = Tensor(total.astype(np.float32))
            comm.all_reduce(t, group=self.dp_group)
            total = t.asnumpy().astype(np.float64)
        n = max(total[4], 1.0)
        return dict(zip(METRICS, (float(total[i] / n) for i in range(4))))
