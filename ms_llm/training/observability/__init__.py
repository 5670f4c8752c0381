"""Seeing a run: TensorBoard event files, Megatron's timers, MindSpore Profiler traces and the
deterministic mode (issue #29). The trainer holds one ``Observability`` and calls its hooks
around each step; each capability lives in its own module:

* ``tensorboard``: ``training.tensorboard_dir`` / ``log_timers_to_tensorboard``;
* ``timers``: ``training.timing_log_level`` 0 | 1 | 2 (Megatron's names and semantics);
* ``profiling``: ``training.profile`` with ``profile_step_start`` / ``profile_step_end`` /
  ``profile_ranks`` / ``profile_dir``;
* ``determinism``: ``training.deterministic``.
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable, Dict, List, Optional

import numpy as np

from ..callbacks import TrainerCallback
from .determinism import apply_deterministic
from .profiling import StepProfiler
from .tensorboard import TensorBoardWriter
from .timers import Timers, format_block, min_max_over_ranks

__all__ = ["Observability", "apply_deterministic", "Timers", "TensorBoardWriter",
           "StepProfiler"]


class Observability(TrainerCallback):
    """The run's observers, one trainer callback, plus two things the trainer calls itself:
    ``timers`` inside the step, and ``log_extras`` on a logged step after its iteration time
    was taken (as Megatron gathers its timers in ``training_log``, outside the iteration), which
    adds ``timers_ms`` (and ``moe_aux_loss``) to the step's metrics; collective with timers on
    (every rank logs the same steps)."""

    def __init__(self, cfg, rank: int = 0, world_size: int = 1,
                 say: Callable[[str], None] = print):
        t = cfg.training
        self.cfg, self.rank, self.world_size, self.say = cfg, rank, world_size, say
        apply_deterministic(t.deterministic)
        self.timers = Timers(t.timing_log_level)
        self.tb: Optional[TensorBoardWriter] = None
        self.profiler = None
        if t.profile:
            from ms_llm.compat import is_ascend
            profile_dir = t.profile_dir or os.path.join(t.output_dir, "profile")
            self.profiler = StepProfiler(t.profile_step_start, t.profile_step_end,
                                         t.profile_ranks, profile_dir, rank,
                                         say=lambda m: print(f"ms-llm: rank {rank} {m}",
                                                             flush=True),
                                         ascend=is_ascend())
        self._steps_since_log = 0
        self._hooks: List[Any] = []
        self._pipeline = None
        self._fwd_t0: Optional[float] = None
        self._moe_layers: list = []
        self._trainer = None
        self._aux: List[float] = []
        self.local_ms: Dict[str, float] = {}   # this rank's timers of the last logged step

    # ------------------------------------------------------------------ run boundaries
    def on_train_begin(self, trainer) -> None:
        t = self.cfg.training
        self._trainer = trainer
        if t.tensorboard_dir and self.rank == 0:
            self.tb = TensorBoardWriter(t.tensorboard_dir, start_step=trainer.step,
                                        start_samples=trainer.data.loader.consumed_samples)
            self.tb.log_config(self.cfg.to_dict())
            self.say(f"TensorBoard event files in {t.tensorboard_dir} "
                     f"(tensorboard --logdir {t.tensorboard_dir})")
            if self.cfg.model.mlp_type == "moe":
                from ms_llm.models.moe import moe_layers
                self._moe_layers = moe_layers(trainer.model)
        if self.timers.log_level >= 2:
            self._attach_compute_timers(trainer)

    def on_train_end(self) -> None:
        if self.profiler is not None:
            self.profiler.on_train_end()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self.tb is not None:
            self.tb.close()
            self.tb = None

    # ------------------------------------------------------------------ per step
    def on_step_begin(self, step: int) -> None:
        if self.profiler is not None:
            self.profiler.on_step_begin(step)

    def on_step_end(self, step: int, out: Dict[str, Any]) -> None:
        self._steps_since_log += 1
        if self.tb is not None and self._moe_layers:   # the step's loss already synchronised
            losses = [float(l.router.aux_loss.asnumpy()) for l in self._moe_layers
                      if l.router.aux_loss is not None]
            if losses:
                self._aux.append(sum(losses))
        if self._pipeline is not None:   # level 2 under pp: the executor's timed spans
            spans = {"F": "forward-compute", "B": "backward-compute",
                     "comm": "pipeline-send-recv"}
            for kind, _, _, t0, t1 in self._pipeline.events:
                if kind in spans:
                    self.timers(spans[kind]).add(t1 - t0)
        if self.profiler is not None:
            self.profiler.on_step_end(step)

    def log_extras(self) -> Dict[str, Any]:
        """Extra metrics.jsonl keys of a logged step: ``timers_ms`` = ``{name: {min, max}}``
        per step over all ranks. Collective (an all_gather over the world) when timers are on:
        every rank calls it on the same steps."""
        if not self.timers.enabled:
            self._steps_since_log = 0
            return self._moe_extras()
        names = self.timers.names()
        mine = self.timers.read_ms(self._steps_since_log)
        self.local_ms = {n: float(v) for n, v in zip(names, mine) if v > 0}   # this rank's
        rows = self._all_gather(mine) if self.world_size > 1 else mine[None, :]
        stats = min_max_over_ranks(names, rows)
        self._steps_since_log = 0
        return {"timers_ms": stats, **self._moe_extras()}

    def _moe_extras(self) -> Dict[str, float]:
        """``moe_aux_loss``: the routers' auxiliary losses (load balancing, plus the z-loss when
        its coefficient is set) of the last micro-batch, summed over this rank's MoE layers and
        averaged over the steps since the last log (rank 0's view; TensorBoard only)."""
        if not self._aux:
            return {}
        value, self._aux = float(np.mean(self._aux)), []
        return {"moe_aux_loss": value}

    def on_log(self, step: int, record: Dict[str, Any]) -> None:
        if self.rank != 0:
            return
        if "timers_ms" in record:
            print(format_block(record["timers_ms"]), flush=True)
        if self.tb is not None:
            self.tb.log_record(record, batch_size=self.cfg.training.global_batch_size)
            if self.cfg.training.log_timers_to_tensorboard and "timers_ms" in record:
                self.tb.log_timers(step, record["timers_ms"])
            self.tb.flush()

    def on_eval(self, step: int, values: Dict[str, float]) -> None:
        if self.tb is not None:
            self.tb.log_eval(step, values, self._trainer.data.loader.consumed_samples)
            self.tb.flush()

    # ------------------------------------------------------------------ helpers
    def _all_gather(self, mine: np.ndarray) -> np.ndarray:
        from mindspore import Tensor
        from ms_llm.parallel import comm
        parts = [Tensor(np.zeros(mine.shape, np.float32)) for _ in range(self.world_size)]
        comm.all_gather(parts, Tensor(mine.astype(np.float32)))
        return np.stack([p.asnumpy() for p in parts]).astype(np.float64)

    def _attach_compute_timers(self, trainer) -> None:
        """Level 2: ``forward-compute`` from the model's forward hooks (PyNative; a compiled
        step runs no Python hooks), or the pipeline executor's per-action spans under pp."""
        if trainer.pipeline is not None:
            trainer.pipeline.timed = True
            self._pipeline = trainer.pipeline
            return
        if getattr(trainer.executor, "fwd_bwd", None) is not None:   # training.jit
            return
        from .timers import device_sync
        fwd = self.timers("forward-compute")

        def pre(cell, inputs):
            if self._fwd_t0 is None and cell.training:    # not evaluation's forwards
                device_sync()
                self._fwd_t0 = time.perf_counter()

        def post(cell, inputs, output):
            if self._fwd_t0 is not None:
                device_sync()
                fwd.add(time.perf_counter() - self._fwd_t0)
                self._fwd_t0 = None
        self._hooks = [trainer.model.register_forward_pre_hook(pre),
                       trainer.model.register_forward_hook(post)]
