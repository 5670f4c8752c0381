"""Validation during training: ``training.eval_interval`` / ``training.eval_iters`` over the
``data.split`` validation part, with Megatron's semantics.

* Every ``eval_interval`` steps, and once more at the end (unless the last step was just
  evaluated), ``eval_iters`` global batches of validation samples run forward only: no
  gradient, dropout off, no optimizer or data-loader state touched.
* The validation stream continues from one evaluation to the next (Megatron's valid iterator),
  so each evaluation sees new samples; evaluation ``k`` starts at sample
  ``k * eval_iters * global_batch_size``, which is also where a resumed run picks it up.
* ``eval_loss`` is the token-weighted mean loss over all of an evaluation's micro-batches and
  data-parallel ranks (Megatron sums the loss and the token count, then divides); under context
  parallel each batch is split over the cp ranks exactly as in training and both sums also run
  over cp;
  ``eval_ppl = exp(min(20, eval_loss))`` as Megatron prints it. A DPO run logs the mean DPO loss
  over the pairs and the reward metrics instead (``eval_rewards/accuracy``...).
* Under pipeline parallel each micro-batch runs forward-only through the stages (Megatron's
  ``forward_backward_func(forward_only=True)``); the last stage's rank computes the sums and
  shares them with the pipeline group, so every rank reports the same values.
"""
from __future__ import annotations

from typing import Dict, Optional

import numpy as np
from mindspore import Tensor

from ms_llm.compat import no_grad
from ms_llm.data import BatchIterator
from ms_llm.parallel import comm


class Evaluator:
    def __init__(self, trainer, valid, start_step: int = 0):
        t = trainer.cfg.training
        self.trainer, self.interval, self.iters = trainer, t.eval_interval, t.eval_iters
        self.loader = BatchIterator(valid, t.micro_batch_size, t.seed,
                                    dp_rank=trainer.pstate.dp_rank,
                                    dp_size=trainer.dp_group.size, shuffle=False)
        self.done = start_step // self.interval   # evaluations before a resumed run's start
        self.last_step: Optional[int] = None

    def due(self, step: int, final: bool) -> bool:
        if step == self.last_step:
            return False
        return step % self.interval == 0 or final

    def run(self, step: int) -> Dict[str, float]:
        """One evaluation (collective over the data-parallel group)."""
        tr = self.trainer
        gbs = tr.cfg.training.global_batch_size
        self.loader.load_state_dict({"consumed_samples": self.done * self.iters * gbs})
        model = tr.model
        was_training = model.training
        model.set_train(False)
        try:
            with no_grad():
                parts = [tr.evaluate_batch(next(self.loader))
                         for _ in range(self.iters * tr.accum_steps)]
        finally:
            model.set_train(was_training)
        sums = None if parts[0] is None else sum(parts)
        if tr.pipeline is not None:     # the last stage's sums, to every pipeline rank
            shared = [None] * tr.pstate.group("pp").size
            comm.all_gather_object(shared, sums, group=tr.pstate.group("pp"))
            sums = next(s for s in shared if s is not None)
        # The objective names the group its sums add over: LM sums are this rank's tokens
        # (under cp its pieces of the sequences): dp x cp; DPO sums are whole pairs: dp.
        group = tr.pstate.group(tr.objective.eval_group)
        if group.size > 1:
            t = Tensor(np.asarray(sums, np.float32))
            comm.all_reduce(t, group=group)
            sums = t.asnumpy().astype(np.float64)
        self.done += 1
        self.last_step = step
        return self._values(sums)

    def _values(self, sums: np.ndarray) -> Dict[str, float]:
        return self.trainer.objective.eval_values(sums)
