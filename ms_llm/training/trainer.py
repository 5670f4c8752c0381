"""The pretraining loop: data -> model -> AdamW, with Megatron-style logging and metrics.jsonl."""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from typing import Dict, Optional

import numpy as np
import mindspore as ms
from mindspore import Tensor

from ms_llm.checkpoint import dcp
from ms_llm.compat import manual_seed, setup_device
from ms_llm.compat.autograd import is_recomputing
from ms_llm.config import ConfigError, RunConfig
from ms_llm.models import GPTModel, from_pretrained
from ms_llm.models.moe import collect_router_counts, update_expert_bias
from ms_llm.lora import base as lora_base
from ms_llm.lora.modules import is_frozen_base, lora_module_names
from ms_llm.ops._dispatch import resolve_paths
from ms_llm.optim import build_optimizer, param_groups
from ms_llm.parallel import comm
from ms_llm.parallel.distributed_optimizer import bytes_per_rank
from ms_llm.compat import F, to_ms_dtype
from ms_llm.parallel.parallelize import parallelize_model
from ms_llm.parallel.pipeline.executor import PipelineExecutor
from ms_llm.parallel.pipeline.schedules import build_schedule
from ms_llm.parallel.placement import Mesh
from ms_llm.parallel.runtime import DistInfo, init_distributed
from ms_llm.parallel.state import initialize_model_parallel
from . import grad as gradlib
from . import mixed_precision
from . import checkpointing as ckpt
from . import faults, resilience, rng_state
from .data_setup import build_data
from .dpo import DPOObjective, dpo_pieces, reference_for
from .evaluate import Evaluator
from .lr_schedule import lr_at
from .metrics import MetricsLogger, current_rss_gb, reset_peak_rss

log = logging.getLogger("ms_llm.train")


def build_model(cfg: RunConfig) -> GPTModel:
    """A fresh model of ``cfg.model``, or the weights of ``checkpoint.load``. ``cfg.model`` is
    then the folder's own architecture (``build_data`` adopted it, user keys checked) plus the
    training-only keys (dtype, dropout, expert layout), so it is passed to the loader."""
    if cfg.checkpoint.load:
        return from_pretrained(cfg.checkpoint.load, config=cfg.model)
    return GPTModel(cfg.model)


class Trainer:
    def __init__(self, cfg: RunConfig, dist: Optional[DistInfo] = None):
        self.cfg = cfg
        self.dist = dist or DistInfo()
        t = cfg.training
        p = cfg.parallel
        if self.dist.world_size > 1:
            comm.set_collective_timeout(p.collective_timeout_s)
            resilience.publish_rank_status(t.output_dir)   # for the watchdog's time-out report
        try:
            self.pstate = initialize_model_parallel(tp=p.tensor_model_parallel_size,
                                                    pp=p.pipeline_model_parallel_size,
                                                    cp=p.context_parallel_size,
                                                    ep=p.expert_model_parallel_size)
        except ValueError as e:
            raise ConfigError(f"launch with {self.dist.world_size} worker(s): {e}") from None
        self.tp_group, self.dp_group = self.pstate.group("tp"), self.pstate.group("dp")
        mb_total = t.micro_batch_size * self.dp_group.size
        if t.global_batch_size % mb_total:
            raise ConfigError(f"training.global_batch_size ({t.global_batch_size}) must be a "
                              f"multiple of micro_batch_size x data-parallel size ({mb_total})")
        self.accum_steps = t.global_batch_size // mb_total
        manual_seed(t.seed)
        np.random.seed(t.seed)
        self.data = build_data(cfg, self.pstate.dp_rank, self.dp_group.size)
        cfg.model = self.data.model_config
        reset_peak_rss()   # the logged peak is training's, not the data set-up's transients
        self.rss_before_model_gb = current_rss_gb()   # the baseline `ms-llm plan` predicts above
        mixed_precision.apply_to_config(cfg)   # training.bf16: bf16 params, FSDP gathers
        self.model = build_model(cfg)
        self.moe = cfg.model.mlp_type == "moe"
        try:
            par = parallelize_model(self.model, cfg, self.pstate)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        for note in par.notes:
            self._say(note)
        self.fsdp, self.params, self.grad_sync = par.fsdp, par.params, par.grad_sync
        self.grad_dtype = mixed_precision.grad_dtype(cfg)
        self.named_params = par.named_params
        self.context_parallel = par.context_parallel
        # gradients, loss and router counts of replicas sum over dp x cp (cp=1: the dp group)
        self.dp_cp_group = self.pstate.group("dp_cp")
        self.mesh = Mesh.of(self.pstate)
        self.pipeline = None if par.chunks is None else self._pipeline_executor(par.chunks)
        named = [(n, q) for n, q in self.named_params if q.requires_grad]
        self.optimizer = build_optimizer(named, cfg, self.pstate, jit=par.jit)
        # The distributed optimizer reduce-scatters instead of all-reducing (its own grad sync).
        self.grad_sync = self.optimizer.grad_sync or self.grad_sync
        for line in param_groups.describe(self.optimizer.groups):
            self._say(line)
        self.optimizer_bytes = bytes_per_rank(sum(self.optimizer.state_bytes().values()))
        self._say(f"optimizer state per rank (moments + fp32 main-param shards): "
                  f"{', '.join(f'{b / 2 ** 20:.2f}' for b in self.optimizer_bytes)} MiB "
                  f"({type(self.optimizer).__name__})")
        # DPO snapshots the starting weights (its reference) here, before a resume loads others.
        self.dpo = self._dpo_objective() if t.stage == "dpo" else None
        self.grad_fn = ms.value_and_grad(self._loss if self.dpo is None else self.dpo.loss,
                                         grad_position=None, weights=self.params,
                                         has_aux=self.dpo is not None)
        resolve_paths()  # pick every op's kernel now, outside any graph capture
        if par.jit and self.dpo is not None:
            self._say("training.jit ignored: training.stage dpo runs in PyNative")
        self.fwd_bwd = self._fwd_bwd_jit() if par.jit and self.dpo is None else None
        self.step = 0
        self.mtp_log = []       # per micro-batch: each MTP depth's mean loss (for logging)
        self._lora_state = None
        self.guard = resilience.guard_for(cfg, self.dist)
        self._opt_names = resilience.names_of(self.optimizer.params, self.named_params)
        self._maybe_resume()
        self.evaluator = None if self.data.valid is None else \
            Evaluator(self, self.data.valid, self.step)

    # The loss of one micro-batch, pre-divided by the global batch's loss-token count so summed
    # micro-batch gradients equal the gradient of the global per-token mean.
    def _loss(self, tokens: Tensor, labels: Tensor, loss_mask: Tensor, inv_tokens: Tensor,
              attention_mask: Optional[Tensor] = None, position_ids: Optional[Tensor] = None):
        per_token = self.model(tokens, labels=labels, attention_mask=attention_mask,
                               position_ids=position_ids)
        loss = (per_token * loss_mask).sum() * inv_tokens
        aux = self.model.aux_loss() if self.moe else None
        if aux is not None:
            # Each rank's MoE auxiliary loss covers its own micro-batch (under cp: its share of
            # it, the shares sum over cp) while gradients are summed over micro-batches and
            # data-parallel ranks: average it accordingly.
            loss = loss + aux / (self.accum_steps * self.dp_group.size)
        mtp = self.model.mtp_loss(loss_mask)     # multi-token prediction (ms_llm.models.mtp)
        if mtp is not None:
            loss = loss + mtp[0] * inv_tokens
            self.mtp_log.append([float(m.asnumpy()) for m in mtp[1]])   # PyNative only
        return loss

    def _dpo_objective(self) -> DPOObjective:
        if self.model.mtp is not None:
            raise ConfigError("training.stage dpo with model.mtp_num_layers is not built yet "
                              "(the DPO loss has no MTP term); set model.mtp_num_layers 0")
        scale = 1.0 / (self.accum_steps * self.dp_group.size) if self.moe else None
        params = [q for _, q in self.named_params]
        return DPOObjective(self.cfg.dpo, self.model, params, self.dp_group, scale,
                            reference_for(self.model, params, lora=self.cfg.lora.r > 0),
                            **dpo_pieces(self.context_parallel))

    def _step_args(self, b: dict, inv: Tensor) -> tuple:
        """The differentiated loss function's arguments for one loader batch."""
        if self.dpo is not None:
            return self.dpo.micro_batch_args(b, inv)
        mb = self._micro_batch(b)
        args = (mb["tokens"], mb["labels"], mb["loss_mask"], inv)
        mask, pos = mb.get("attention_mask"), mb.get("position_ids")
        if mask is not None or pos is not None:
            args += (mask,) + ((pos,) if pos is not None else ())
        return args

    def _pipeline_executor(self, chunks) -> PipelineExecutor:
        t, p = self.cfg.training, self.cfg.parallel
        vpp = p.virtual_pipeline_model_parallel_size
        try:
            schedule = build_schedule(self.pstate.sizes.pp, self.accum_steps, vpp)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        seq = self.cfg.data.seq_length // (self.tp_group.size if p.sequence_parallel else 1)
        seq //= self.pstate.sizes.cp    # context parallel: each rank's stages carry its chunks
        for chunk in chunks:    # the aux loss weight _loss uses, per micro-batch and replica
            # (under cp each rank's aux loss is its share of the micro-batch's: over dp only)
            chunk.aux_loss_scale = 1.0 / (self.accum_steps * self.dp_group.size)
        c = self.model.config        # a loaded checkpoint's architecture, not the YAML's
        return PipelineExecutor(chunks, self.pstate, schedule, vpp,
                                (t.micro_batch_size, seq, c.hidden_size),
                                to_ms_dtype(c.params_dtype), mixed_precision.grad_dtype(self.cfg))

    def _micro_batch(self, b: dict) -> Dict[str, Tensor]:
        """A loader batch as the model's inputs. Packed documents add their masks
        (data.reset_attention_mask) and restarting positions (data.reset_position_ids); plain
        position_ids are 0..s-1, the model's default, so they are not passed."""
        if self.context_parallel is not None:   # this rank's chunks of the sequence
            return self.context_parallel.micro_batch(b, self.cfg.data.reset_position_ids)
        mb = {k: Tensor(b[k]) for k in ("tokens", "labels", "loss_mask")}
        if "attention_mask" in b:
            mb["attention_mask"] = Tensor(b["attention_mask"])
        if self.cfg.data.reset_position_ids and "position_ids" in b:
            mb["position_ids"] = Tensor(b["position_ids"])
        return mb

    def _pipeline_fwd_bwd(self, batches, inv: Tensor):
        """All micro-batches through this rank's stages; the loss is summed on the last stage
        and shared over the pipeline group for logging."""
        def loss_of(per_token, b):
            loss = (per_token * b["loss_mask"]).sum() * inv
            mtp = self.model.mtp_loss(b["loss_mask"])   # the last stage's MTP block
            if mtp is None:
                return loss
            if not is_recomputing():     # the backward re-runs this forward: log it once
                self.mtp_log.append([float(m.asnumpy()) for m in mtp[1]])
            return loss + mtp[0] * inv
        loss, grads = self.pipeline.run([self._micro_batch(b) for b in batches], loss_of)
        loss = F.clone(loss)
        comm.all_reduce(loss, group=self.pstate.group("pp"))
        return loss, self.grad_sync.reduce(grads)

    def _fwd_bwd_jit(self):
        """One compiled graph for forward, backward and the gradients' sum of squares (the
        global norm inside the graph saves a per-tensor PyNative dispatch for each gradient)."""
        grad_fn = self.grad_fn
        to_fp32 = mixed_precision.grads_to_fp32 if self.cfg.training.bf16 \
            and not mixed_precision.reduces_in_bf16(self.cfg) else mixed_precision.same

        def fwd_bwd(tokens, labels, loss_mask, inv_tokens, attention_mask=None,
                    position_ids=None):
            loss, grads = grad_fn(tokens, labels, loss_mask, inv_tokens, attention_mask,
                                  position_ids)
            grads = to_fp32(grads)   # training.bf16: fp32 gradients leave the graph
            return loss, grads, gradlib.sum_of_squares(grads)
        return ms.jit(fwd_bwd)

    def _say(self, msg: str) -> None:
        if self.dist.rank == 0:
            print(f"ms-llm: {msg}", flush=True)

    def _maybe_resume(self) -> None:
        ck = self.cfg.checkpoint
        if self.cfg.training.resume != "auto":
            return
        latest = dcp.resolve_resume("auto", ck.save_dir, report=self._say)
        if latest is None:
            self._say(f"resume=auto: no complete checkpoint in {ck.save_dir}, starting fresh")
            return
        state = ckpt.load(latest, self._checkpointed(), self.optimizer, self.pstate)
        if self.cfg.lora.r:   # the adapters only fit the base they were trained on
            try:
                lora_base.check_base(state.get(lora_base.STATE_KEY), self.cfg.checkpoint.load,
                                     latest)
            except ValueError as e:
                raise ConfigError(f"training.resume=auto: {e}") from None
        self.step = state["step"]
        self.data.loader.load_state_dict(state["data"])
        rng_state.restore(state.get("rng") or {"numpy": state["numpy_rng"]})
        resilience.check_lr_schedule(state, self.cfg, self._say)
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
                 "lr_schedule": resilience.lr_schedule(self.cfg),
                 "skipped_steps": self.guard.skipped,
                 "model_config": dataclasses.asdict(self.cfg.model)}
        if self.cfg.lora.r:   # adapters only: record the base they belong to (rank 0 writes)
            if self._lora_state is None and self.dist.rank == 0:
                self._lora_state = lora_base.lora_state(
                    self.cfg.lora, self.cfg.checkpoint.load,
                    lora_module_names(self.model))
            state[lora_base.STATE_KEY] = self._lora_state
        return ckpt.save(self.cfg.checkpoint.save_dir, self.step, self._checkpointed(),
                         self.optimizer,
                         self.pstate, state, barrier=comm.barrier, rank=self.dist.rank,
                         all_finite=resilience.all_ranks_finite(self.dist.world_size),
                         world=self.dist.world_size, keep_last=self.cfg.checkpoint.keep_last)

    def train_step(self) -> Dict[str, float]:
        t = self.cfg.training
        resilience.note_step(self.step + 1)
        batches = [next(self.data.loader) for _ in range(self.accum_steps)]
        units = self.dpo.pairs(batches) if self.dpo is not None else \
            sum(b["loss_mask"].sum() for b in batches)
        n_local = Tensor(np.array([units], np.float32))
        comm.all_reduce(n_local, group=self.dp_group)   # loss tokens (DPO: pairs) of the batch
        inv = Tensor(np.float32(1.0 / max(float(n_local.asnumpy()[0]), 1.0)))
        total_loss, grads, sumsq = None, None, None
        if self.pipeline is not None:
            total_loss, grads = self._pipeline_fwd_bwd(batches, inv)
        for i, b in enumerate(batches if self.pipeline is None else []):
            args = self._step_args(b, inv)
            self.grad_sync.begin_micro_batch(is_last=i == len(batches) - 1)
            if self.fsdp:   # reduce-scatter only on the last micro-batch of the step
                self.model.set_requires_gradient_sync(i == len(batches) - 1)
            if self.fwd_bwd is not None:
                loss, g, sumsq = self.fwd_bwd(*args)
            else:
                loss, g = self.grad_fn(*args)
            if self.dpo is not None:      # (loss, policy log-probs); args[3]: reference ones
                loss, logps = loss
                self.dpo.record(logps, args[3])
            total_loss = loss if total_loss is None else total_loss + loss
            if self.moe:
                collect_router_counts(self.model)
            if not self.grad_sync.overlap:
                grads = gradlib.accumulate(grads, g, self.grad_dtype)
        if self.pipeline is None:
            grads = self.grad_sync.finish() if self.grad_sync.overlap \
                else self.grad_sync.reduce(grads)
        # The optimizer's params match the gradients (shards under the distributed optimizer).
        grads = gradlib.reduce_partial_grads(self.optimizer.params, grads, self.pstate.group)
        grads = mixed_precision.grads_to_fp32(grads)   # bf16-reduced: fp32 for norm, clip, AdamW
        injected = faults.maybe_inject_nan(self.step + 1, self._opt_names, grads)
        sumsq, grads = (sumsq if injected is grads else None), injected
        comm.all_reduce(total_loss, group=self.dp_cp_group)
        total_loss = float(total_loss.asnumpy())
        if len(batches) == 1 and sumsq is not None and self.dist.world_size == 1:
            norm = math.sqrt(float(sumsq.asnumpy()))
        else:
            norm = gradlib.global_norm(grads, self.optimizer.params, self.pstate.group,
                                       self.mesh)
        faults.maybe_kill(self.step + 1, self.dist.rank)   # test hook: a worker dies mid-step
        skip = self.guard.check(self.step + 1, total_loss, norm, self._opt_names, grads)
        grads = gradlib.clip_(grads, t.clip_grad, norm)
        self.step += 1
        lr = lr_at(self.step, lr=t.lr, min_lr=t.min_lr, warmup_steps=t.lr_warmup_steps,
                   decay_steps=t.lr_decay_steps or t.max_steps, style=t.lr_decay_style)
        if skip:   # training.nan_policy skip: no update; the routed counts are dropped too
            if self.moe:
                resilience.drop_router_counts(self.model)
        else:
            self.optimizer.step(grads, lr)
            if self.moe:
                update_expert_bias(self.model, self._sum_over_dp)
        tokens = sum(int(v.size) for b in batches for k, v in b.items() if k.endswith("tokens"))
        metrics = self.dpo.step_metrics() if self.dpo is not None else {}
        if self.model.mtp is not None:
            metrics.update(self._mtp_metrics())
        return {"loss": total_loss, "grad_norm": norm, "lr": lr, "skipped": skip,
                "tokens": tokens * self.dp_group.size, "metrics": metrics}

    def _mtp_metrics(self) -> Dict[str, float]:
        """Each MTP depth's loss (Megatron's ``mtp_{k} loss``): its per-token mean, averaged
        over the step's micro-batches and the data-parallel replicas. ``loss`` includes them
        times ``mtp_loss_scaling_factor / mtp_num_layers``."""
        d = self.model.config.mtp_num_layers
        means = np.mean(np.array(self.mtp_log, np.float64), axis=0) if self.mtp_log \
            else np.zeros(d)
        self.mtp_log = []
        if self.pipeline is not None:     # only the last stage ran the MTP block: share it
            t = Tensor(means.astype(np.float32))
            comm.all_reduce(t, group=self.pstate.group("pp"))
            means = t.asnumpy().astype(np.float64)
        if self.dp_cp_group.size > 1:
            means = self._sum_over_dp(means) / self.dp_cp_group.size
        return {f"mtp_{k + 1}_loss": float(v) for k, v in enumerate(means)}

    def _mfu_args(self, is_main: bool) -> dict:
        """Model FLOPs per token and the peak (``training.peak_tflops`` or the cached CPU GEMM
        probe, rank 0 only: only it logs) for the TFLOP/s and MFU columns."""
        if not is_main:
            return {}
        from .flops import flops_per_token
        from .peak import resolve_peak_tflops
        return {"flops_per_token": flops_per_token(self.model.config, self.cfg.data.seq_length),
                "peak_tflops": resolve_peak_tflops(self.cfg.training.peak_tflops,
                                                   ms.get_context("device_target"), self._say),
                "num_devices": self.dist.world_size}

    def _sum_over_dp(self, counts: np.ndarray) -> np.ndarray:
        """Routed-token counts summed over the data-parallel replicas of the routers."""
        if self.dp_cp_group.size == 1:
            return counts
        t = Tensor(counts.astype(np.float32))
        comm.all_reduce(t, group=self.dp_cp_group)
        return t.asnumpy().astype(np.float64)

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
                               append=faults.restart_attempt() > 0,
                               **self._mfu_args(is_main))
        records = []
        try:
            while self.step < t.max_steps:
                t0 = time.time()
                out = self.train_step()
                dt = time.time() - t0
                if self.step % t.log_interval == 0 or self.step == t.max_steps:
                    out["metrics"] = {**out["metrics"], **resilience.step_extras(
                        self.guard, out["skipped"], dt, self.dist.world_size)}
                    records.append(logger.log(
                        self.step, loss=out["loss"], grad_norm=out["grad_norm"], lr=out["lr"],
                        tokens=out["tokens"], step_time=dt,
                        consumed_samples=self.data.loader.consumed_samples,
                        global_batch_size=t.global_batch_size, extra={**out["metrics"], **(
                            {} if records else
                            {"optimizer_state_bytes_per_rank": self.optimizer_bytes})}))
                if self.evaluator is not None and \
                        self.evaluator.due(self.step, final=self.step == t.max_steps):
                    records.append(logger.log_eval(self.step, self.evaluator.run(self.step)))
                if ck.save_dir and ((ck.save_interval and self.step % ck.save_interval == 0)
                                    or self.step == t.max_steps):
                    self._say(f"saved checkpoint {self.save()}")
        finally:
            logger.close()
        if is_main and records:
            from .plot import plot_loss
            print(f"ms-llm: loss curve {plot_loss(t.output_dir)}", flush=True)
        return records


def run(cfg: RunConfig) -> list:
    # The device must be chosen before mindspore.communication.init().
    setup_device(None if cfg.training.device == "auto" else cfg.training.device)
    dist = init_distributed()
    return Trainer(cfg, dist).fit()
