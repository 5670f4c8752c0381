"""The pretraining loop: data -> model -> AdamW, with Megatron-style logging and metrics.jsonl."""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from typing import Dict, Optional, Sequence

import numpy as np
import mindspore as ms
from mindspore import Tensor

from ms_llm.checkpoint.native import dcp
from ms_llm.checkpoint import run_identity
from ms_llm.checkpoint.verify import guard_save_dir
from ms_llm.compat import manual_seed, setup_device
from ms_llm.compat.environment import configure
from ms_llm.config import ConfigError, RunConfig, check_launch
from ms_llm.models import GPTModel
from ms_llm.checkpoint import from_pretrained
from ms_llm.lora import base as lora_base
from ms_llm.lora.modules import is_frozen_base, lora_module_names
from ms_llm.ops import resolve_paths
from ms_llm.optim import build_optimizer, param_groups
from ms_llm.parallel import comm
from ms_llm.parallel.distributed_optimizer import bytes_per_rank
from ms_llm.parallel.parallelize import parallelize_model
from ms_llm.parallel.placement import Mesh
from ms_llm.parallel.runtime import DistInfo, init_distributed
from ms_llm.parallel.state import expert_sizes, initialize_model_parallel
from . import grad as gradlib
from . import mixed_precision
from . import checkpointing as ckpt
from . import megatron_checkpoint
from . import rng_state
from .callbacks import CallbackList, TrainerCallback
from .qk_clip import QKClip
from .data_setup import build_data
from .dpo import DPOObjective, dpo_pieces, reference_for
from .evaluate import Evaluator
from .executors import PipelineStepExecutor, PlainExecutor, StepExecutor, build_pipeline
from .fault_hooks import FaultInjection, RankStatus, appends_metrics
from .lr_schedule import check_lr_schedule, lr_schedule, restore_scheduler, \
    scheduler_from_config
from .metrics import MetricsLogger, current_rss_gb, reset_peak_rss, step_extras
from .moe_step import ExpertBiasUpdate
from .nonfinite import guard_for, names_of
from .objectives import LMObjective, ModelInputs, MTPTerm, objective_unit_scale
from .observability import Observability, apply_deterministic

log = logging.getLogger("ms_llm.train")


def build_model(cfg: RunConfig) -> GPTModel:
    """A fresh model of ``cfg.model``, or the weights of ``checkpoint.load``. ``cfg.model`` is
    then the folder's own architecture (``build_data`` adopted it, user keys checked) plus the
    training-only keys (dtype, dropout, expert layout), so it is passed to the loader."""
    if cfg.checkpoint.load:
        try:   # a truncated, unsupported (pytorch_model.bin) or foreign folder: one line
            return from_pretrained(cfg.checkpoint.load, config=cfg.model)
        except (ValueError, KeyError, OSError) as e:
            why = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
            raise ConfigError(f"checkpoint.load {why}") from None
    return GPTModel(cfg.model)


class Trainer:
    """A training run of ``cfg`` composed of parts: the loss objective (``objectives``), the
    step executor (plain or pipeline, ``executors``), the optimizer, and callbacks around the
    step (``callbacks``: fault injection, watchdog bookkeeping, MoE expert bias, and whatever
    is appended to ``self.callbacks``)."""

    def __init__(self, cfg: RunConfig, dist: Optional[DistInfo] = None,
                 callbacks: Sequence[TrainerCallback] = ()):
        self.cfg = cfg
        configure(cfg.explicit_settings())   # runtime.* keys for the packages below the config
        self.dist = dist or DistInfo()
        check_launch(cfg, self.dist.world_size)   # the mesh, global batch, pipeline schedule
        check_output_folders(cfg)   # before any model is built, not at the first save
        t = cfg.training
        p = cfg.parallel
        self.callbacks = CallbackList()
        if self.dist.world_size > 1:
            comm.set_collective_timeout(p.collective_timeout_s)
            self.callbacks.append(RankStatus(t.output_dir))   # the watchdog's time-out report
        ep, etp = expert_sizes(p)
        self.pstate = initialize_model_parallel(tp=p.tensor_model_parallel_size,
                                                pp=p.pipeline_model_parallel_size,
                                                cp=p.context_parallel_size, ep=ep, etp=etp)
        self.tp_group, self.dp_group = self.pstate.group("tp"), self.pstate.group("dp")
        self.accum_steps = t.global_batch_size // (t.micro_batch_size * self.dp_group.size)
        # TensorBoard, timers, profiler (a callback); deterministic mode before the model exists
        self.observe = Observability(cfg, self.dist.rank, self.dist.world_size, self._say)
        self.timers = self.observe.timers
        manual_seed(t.seed)
        np.random.seed(t.seed)
        self.data = build_data(cfg, self.pstate.dp_rank, self.dp_group.size)
        # The config this run trains with, derived (the loaded one stays as it was): the data's
        # model config (the tokenizer's padded vocabulary) and training.bf16's dtypes.
        self.cfg = cfg = mixed_precision.resolved(cfg.replace(model=self.data.model_config))
        reset_peak_rss()   # the logged peak is training's, not the data set-up's transients
        self.rss_before_model_gb = current_rss_gb()   # the baseline `ms-llm plan` predicts above
        self.model = build_model(cfg)
        try:
            par = parallelize_model(self.model, cfg, self.pstate)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        for note in par.notes:
            self._say(note)
        self.fsdp, self.params = par.fsdp, par.params
        self.named_params = par.named_params
        self.context_parallel = par.context_parallel
        # gradients, loss and router counts of replicas sum over dp x cp (cp=1: the dp group)
        self.dp_cp_group = self.pstate.group("dp_cp")
        self.mesh = Mesh.of(self.pstate)
        self.pipeline = None
        if par.chunks is not None:
            self.pipeline = build_pipeline(par.chunks, cfg, self.pstate, self.accum_steps,
                                           self.model.config)
        named = [(n, q) for n, q in self.named_params if q.requires_grad]
        self.optimizer = build_optimizer(named, cfg, self.pstate, jit=par.jit,
                                         gather_timer=self.timers("params-all-gather"))
        # The distributed optimizer reduce-scatters instead of all-reducing (its own grad sync).
        grad_sync = self.optimizer.grad_sync or par.grad_sync
        for line in param_groups.describe(self.optimizer.groups):
            self._say(line)
        self._sync_timer = self.timers("grads-reduce-scatter" if self.fsdp or
                                       p.use_distributed_optimizer else "grads-all-reduce")
        self.optimizer_bytes = bytes_per_rank(sum(self.optimizer.state_bytes().values()))
        self._say(f"optimizer state per rank (moments + fp32 main-param shards): "
                  f"{', '.join(f'{b / 2 ** 20:.2f}' for b in self.optimizer_bytes)} MiB "
                  f"({type(self.optimizer).__name__})")
        # DPO snapshots the starting weights (its reference) here, before a resume loads others.
        self.objective = self._objective()
        resolve_paths()  # pick every op's kernel now, outside any graph capture
        self.executor = self._executor(par, grad_sync)
        self.step = 0
        self.scheduler = scheduler_from_config(t)   # Megatron's, counted in samples
        self._lora_state = None
        self.guard = guard_for(cfg, self.dist)
        self._opt_names = names_of(self.optimizer.params, self.named_params)
        self.callbacks.append(FaultInjection(self._opt_names, self.dist.rank))
        if cfg.model.mlp_type == "moe":
            self.callbacks.append(ExpertBiasUpdate(self.model, self._sum_over_routers,
                                                   collect=self.pipeline is None))
        self.callbacks.append(self.observe)
        if cfg.model.qk_clip or cfg.model.log_max_attention_logit:   # MuonClip (qk_clip.py)
            self.callbacks.append(QKClip(self.model, self.optimizer, self.pstate,
                                         self.dp_cp_group, cfg.model.qk_clip_threshold,
                                         cfg.model.qk_clip_alpha, cfg.model.qk_clip,
                                         self.pstate.group("pp")))
        for callback in callbacks:
            self.callbacks.append(callback)
        self._maybe_resume()
        self.evaluator = None if self.data.valid is None else \
            Evaluator(self, self.data.valid, self.step)

    def _objective(self):
        """The loss this run differentiates: DPO (``training.stage dpo``) or the LM loss with
        the MoE auxiliary loss and the MTP term the model has."""
        aux_scale = objective_unit_scale(self.accum_steps, self.dp_group.size) \
            if self.cfg.model.mlp_type == "moe" else None
        if self.cfg.training.stage == "dpo":
            params = [q for _, q in self.named_params]
            return DPOObjective(self.cfg.dpo, self.model, params, self.dp_group, aux_scale,
                                reference_for(self.model, params, lora=self.cfg.lora.r > 0),
                                **dpo_pieces(self.context_parallel))
        mtp = None if self.model.mtp is None else MTPTerm(
            self.model, self.dp_cp_group,
            self.pstate.group("pp") if self.pipeline is not None else None)
        return LMObjective(self.model, self.model_inputs, aux_scale, mtp)

    def _executor(self, par, grad_sync) -> StepExecutor:
        if self.pipeline is not None:
            return PipelineStepExecutor(self.pipeline, self.objective, self.model_inputs,
                                        grad_sync, self.pstate.group("pp"), self._sync_timer)
        jit = par.jit and not self.objective.has_aux
        if par.jit and not jit:
            self._say("training.jit ignored: training.stage dpo runs in PyNative")
        return PlainExecutor(self.objective, self.params, grad_sync, self.model, self.fsdp,
                             mixed_precision.grad_dtype(self.cfg), self.cfg if jit else None,
                             self.callbacks, self._sync_timer)

    @property
    def model_inputs(self) -> ModelInputs:
        """A loader batch as this rank's model inputs (under context parallel its chunks)."""
        return ModelInputs(self.context_parallel, self.cfg.data.reset_position_ids)

    def evaluate_batch(self, b: dict) -> np.ndarray:
        """The objective's evaluation sums of one validation micro-batch (forward only; the
        caller holds ``no_grad`` and eval mode). Under pipeline parallel the micro-batch runs
        forward through the stages and only the rank holding the last one has sums (None on
        the others; ``Evaluator`` shares them over the pipeline group)."""
        if self.pipeline is None:
            return self.objective.eval_sums(b)
        mb = self.model_inputs(b)
        return self.pipeline.forward_only(
            mb, lambda per_token: self.objective.pipeline_eval_sums(per_token, mb))

    def _say(self, msg: str) -> None:
        if self.dist.rank == 0:
            print(f"ms-llm: {msg}", flush=True)

    def _maybe_resume(self) -> None:
        ck = self.cfg.checkpoint
        auto = self.cfg.training.resume == "auto"
        megatron = megatron_checkpoint.resume_source(self.cfg, self._say)   # Megatron format
        if megatron is not None:
            latest = megatron_checkpoint.stage_resume(
                megatron, self.cfg, {"rng": rng_state.capture(),
                                     "model_config": dataclasses.asdict(self.cfg.model)},
                self.dist.rank, comm.barrier, self._say)
            megatron_checkpoint.quarantine_newer(self.cfg, megatron, self.dist.rank, self._say)
        else:
            latest = dcp.resolve_resume("auto", ck.save_dir, report=self._say) if auto else None
        if not megatron_checkpoint.is_torch_dist(self.cfg):
            guard_save_dir(ck.save_dir, latest, dataclasses.asdict(self.cfg.model), self._say,
                           self.dist.rank)   # never write over checkpoints that do not verify
        if megatron is None and (not auto or latest is None):
            # resumes nothing: a save_dir holding another run's checkpoints is refused
            self.run_id = run_identity.run_id_for(ck.save_dir, None, {})
            if auto:
                self._say(f"resume=auto: no complete checkpoint in {ck.save_dir}, "
                          f"starting fresh")
            return
        state = ckpt.load(latest, self._checkpointed(), self.optimizer, self.pstate)
        self.run_id = run_identity.run_id_for(ck.save_dir, megatron or latest, state)
        if self.cfg.lora.r:   # the adapters only fit the base they were trained on
            try:
                lora_base.check_base(state.get(lora_base.STATE_KEY), self.cfg.checkpoint.load,
                                     latest)
            except ValueError as e:
                raise ConfigError(f"training.resume=auto: {e}") from None
        self.step = state["step"]
        self.data.loader.load_state_dict(state["data"])
        rng_state.restore(state.get("rng") or {"numpy": state["numpy_rng"]})
        check_lr_schedule(state, self.cfg, self._say)
        restore_scheduler(self.scheduler, state, self.cfg)
        self.guard.skipped = int(state.get("skipped_steps", 0))
        self._say(f"resumed from {latest} at step {self.step}")

    def _checkpointed(self) -> list:
        """Every parameter this rank holds (trainable ones with their AdamW state, plus buffers
        such as the routers' expert_bias)."""
        return [(n, q) for n, q in self.named_params if not is_frozen_base(q)]

    def save(self) -> str:
        """Collective: every rank writes its rows; rank 0 publishes the checkpoint."""
        rng = rng_state.capture()
        state = {"step": self.step, "data": self.data.loader.state_dict(),
                 "numpy_rng": rng["numpy"], "rng": rng,
                 "lr_schedule": lr_schedule(self.cfg),
                 "opt_param_scheduler": self.scheduler.state_dict(),
                 "skipped_steps": self.guard.skipped,
                 "model_config": dataclasses.asdict(self.cfg.model)}
        state[run_identity.STATE_KEY] = self.run_id
        if self.dist.rank == 0 and self.cfg.checkpoint.save_dir:   # the folder is this run's
            run_identity.claim(self.cfg.checkpoint.save_dir, self.run_id)
        if self.cfg.lora.r:   # adapters only: record the base they belong to (rank 0 writes)
            if self._lora_state is None and self.dist.rank == 0:
                self._lora_state = lora_base.lora_state(
                    self.cfg.lora, self.cfg.checkpoint.load,
                    lora_module_names(self.model))
            state[lora_base.STATE_KEY] = self._lora_state
        path = ckpt.save(megatron_checkpoint.native_save_dir(self.cfg), self.step,
                         self._checkpointed(), self.optimizer,
                         self.pstate, state, barrier=comm.barrier, rank=self.dist.rank,
                         all_finite=ckpt.all_ranks_finite(self.dist.world_size),
                         world=self.dist.world_size, keep_last=self.cfg.checkpoint.keep_last)
        return megatron_checkpoint.publish(self.cfg, path, self.dist.rank, comm.barrier)

    def train_step(self) -> Dict[str, float]:
        """One optimizer step over ``accum_steps`` micro-batches per data-parallel rank."""
        t, step = self.cfg.training, self.step + 1
        self.callbacks.on_step_begin(step)
        with self.timers("batch-generator"):   # Megatron's timers (observability.timers)
            batches = [next(self.data.loader) for _ in range(self.accum_steps)]
        fwd_bwd_timer = self.timers("forward-backward")
        fwd_bwd_timer.start()
        n_local = Tensor(np.array([self.objective.units(batches)], np.float32))
        comm.all_reduce(n_local, group=self.dp_group)   # loss tokens (DPO: pairs) of the batch
        inv = Tensor(np.float32(1.0 / max(float(n_local.asnumpy()[0]), 1.0)))
        total_loss, grads, sumsq = self.executor.run(batches, inv, step)
        # The optimizer's params match the gradients (shards under the distributed optimizer).
        grads = gradlib.reduce_partial_grads(self.optimizer.params, grads, self.pstate.group)
        # bf16-reduced: fp32 for norm, clip, AdamW; a list: clip_ replaces its tensors one by one
        grads = list(mixed_precision.grads_to_fp32(grads))
        fwd_bwd_timer.stop()
        opt_timer = self.timers("optimizer")
        opt_timer.start()
        hooked = self.callbacks.on_grads(step, grads)
        sumsq, grads = (sumsq if hooked is grads else None), hooked
        comm.all_reduce(total_loss, group=self.dp_cp_group)
        total_loss = float(total_loss.asnumpy())
        if sumsq is not None and self.dist.world_size == 1:
            norm = math.sqrt(float(sumsq.asnumpy()))
        else:
            norm = gradlib.global_norm(grads, self.optimizer.params, self.pstate.group,
                                       self.mesh)
        self.callbacks.on_before_update(step)
        skip = self.guard.check(step, total_loss, norm, self._opt_names, grads)
        grads = gradlib.clip_(grads, t.clip_grad, norm)
        self.step = step
        lr = self.scheduler.get_lr()   # applied: the lr of the samples consumed before this step
        if not skip:   # training.nan_policy skip: no update, and the schedule does not advance
            self.optimizer.step(grads, lr)
            self.scheduler.step(t.global_batch_size)
        self.callbacks.on_update(step, skip)
        opt_timer.stop()
        tokens = sum(int(v.size) for b in batches for k, v in b.items() if k.endswith("tokens"))
        # logged: the lr after the scheduler's advance, as Megatron's log line prints it
        out = {"loss": total_loss, "grad_norm": norm, "lr": self.scheduler.get_lr(),
               "skipped": skip,
               "tokens": tokens * self.dp_group.size, "metrics": self.objective.step_metrics()}
        self.callbacks.on_step_end(step, out)
        return out

    def _mfu_args(self, is_main: bool) -> dict:
        """Model FLOPs per token and the peak (``training.peak_tflops`` or the cached CPU GEMM
        probe, rank 0 only: only it logs) for the TFLOP/s and MFU columns."""
        if not is_main:
            return {}
        from ms_llm.planning.flops import flops_per_token
        from ms_llm.planning.peak import resolve_peak_tflops
        return {"flops_per_token": flops_per_token(self.model.config, self.cfg.data.seq_length),
                "peak_tflops": resolve_peak_tflops(self.cfg.training.peak_tflops,
                                                   ms.get_context("device_target"), self._say),
                "num_devices": self.dist.world_size}

    def _sum_over_routers(self, counts: np.ndarray) -> np.ndarray:
        """Routed-token counts summed over the replicas of the routers that route distinct
        tokens: data (x context) parallel, and tensor parallel, whose ranks route their own
        piece of the sequence (``parallel.moe_tensor_parallel``)."""
        for group in (self.dp_cp_group, self.tp_group):
            if group.size > 1:
                t = Tensor(counts.astype(np.float32))
                comm.all_reduce(t, group=group)
                counts = t.asnumpy().astype(np.float64)
        return counts

    def fit(self) -> list:
        t, ck = self.cfg.training, self.cfg.checkpoint
        is_main = self.dist.rank == 0
        if is_main:
            os.makedirs(t.output_dir, exist_ok=True)
            with open(os.path.join(t.output_dir, "config.json"), "w", encoding="utf-8") as f:
                json.dump(self.cfg.to_dict(), f, indent=2)
            print(f"ms-llm: {self.model.num_parameters() / 1e6:.2f} M parameters, "
                  f"{self.data.num_tokens} corpus tokens, {self.accum_steps} micro-batch(es) per "
                  f"step, device {ms.get_context('device_target')}, output {t.output_dir}",
                  flush=True)
        logger = MetricsLogger(t.output_dir, t.max_steps, enabled=is_main,
                               progress_bar=t.progress_bar, start_step=self.step,
                               rss_before_model_gb=self.rss_before_model_gb,
                               append=appends_metrics(),
                               **self._mfu_args(is_main))
        records = []
        self.callbacks.on_train_begin(self)
        try:
            while self.step < t.max_steps:
                t0 = time.time()
                out = self.train_step()
                dt = time.time() - t0
                if self.step % t.log_interval == 0 or self.step == t.max_steps:
                    out["metrics"] = {**out["metrics"], **step_extras(
                        self.guard, out["skipped"], dt, self.dist.world_size),
                        **self.observe.log_extras()}   # timers over ranks: collective
                    records.append(logger.log(
                        self.step, loss=out["loss"], grad_norm=out["grad_norm"], lr=out["lr"],
                        tokens=out["tokens"], step_time=dt,
                        consumed_samples=self.data.loader.consumed_samples,
                        global_batch_size=t.global_batch_size, extra={**out["metrics"], **(
                            {} if records else
                            {"optimizer_state_bytes_per_rank": self.optimizer_bytes})}))
                    self.callbacks.on_log(self.step, records[-1])
                if self.evaluator is not None and \
                        self.evaluator.due(self.step, final=self.step == t.max_steps):
                    values = self.evaluator.run(self.step)
                    records.append(logger.log_eval(self.step, values))
                    self.callbacks.on_eval(self.step, values)
                if ck.save_dir and ((ck.save_interval and self.step % ck.save_interval == 0)
                                    or self.step == t.max_steps):
                    path = self.save()
                    self._say(f"saved checkpoint {path}")
                    self.callbacks.on_save(self.step, path)
        finally:
            logger.close()
            self.callbacks.on_train_end()
        if is_main and records:
            from .plot import plot_loss
            print(f"ms-llm: loss curve {plot_loss(t.output_dir)}", flush=True)
        return records


def check_output_folders(cfg: RunConfig) -> None:
    """``training.output_dir`` and ``checkpoint.save_dir`` can be written (one line naming the
    key otherwise)."""
    from ms_llm.validation import writable_folder_problem
    for key, path in (("training.output_dir", cfg.training.output_dir),
                      ("checkpoint.save_dir", cfg.checkpoint.save_dir)):
        why = path and writable_folder_problem(path)
        if why:
            raise ConfigError(f"{key} {why}")


def run(cfg: RunConfig) -> list:
    configure(cfg.explicit_settings())   # before the device and the kernels are set up
    # The device must be chosen before mindspore.communication.init().
    setup_device(None if cfg.training.device == "auto" else cfg.training.device)
    apply_deterministic(cfg.training.deterministic)   # before communication.init (MindSpore)
    dist = init_distributed()
    return Trainer(cfg, dist).fit()
