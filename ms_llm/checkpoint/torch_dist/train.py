"""ms-llm's own training checkpoint (``ms_llm.checkpoint.native.dcp``) <-> a Megatron-Core
``torch_dist`` training checkpoint (``--ckpt-format torch_dist``), so a job moves between the
PyTorch lane and ms-llm mid-training in either direction.

Why a conversion between two complete folders (and not a second loader in the trainer): ms-llm's
own format already reshards to any layout (tp / pp / dp / FSDP), so a torch_dist checkpoint
turned into a one-piece ms-llm checkpoint resumes at whatever layout the new run has, and a save
goes through the trainer's one collective save path before rank 0 rewrites it for Megatron.

What maps (Megatron-Core's ``FP32Optimizer`` layout, the non-distributed optimizer):
  weights                  <-> model tensors (``linear_fc1`` ``[gate; up]`` <-> ``:gate`` / ``:up``)
  ``exp_avg``/``exp_avg_sq`` <-> ``optimizer.exp_avg.*`` / ``optimizer.exp_avg_sq.*``
  ``common_step``          <-> the optimizer's step count (Adam's bias correction)
  ``iteration``            <-> ``step``
  ``opt_param_scheduler``  <-> the scheduler's sample count (Megatron's own dict)
  ``args.consumed_train_samples`` <-> the data position (``iteration * global batch`` without args)
What cannot: Megatron's ``rng_state`` holds torch / CUDA generator states, which MindSpore's
generators cannot take (the resumed run keeps its ``training.seed`` generators; exact only
without dropout). The distributed optimizer's layouts (``--use-distributed-optimizer``) are read
by ``distopt``; the export writes the non-distributed layout (see there).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shutil
from typing import Dict, Iterator, Optional, Tuple

import numpy as np

from ..native import dcp
from ..native.format import LocalChunk, TRACKER
from .io import TorchDistReader, TorchDistWriter, is_torch_dist_dir
from .distopt import read_distributed, sharding_type
from .model import MOMENTS, read_state, read_training_state, write_training_state

OPT = "optimizer."
_GATED = ("linear_fc1.weight", "linear_fc1.bias")


def latest_torch_dist(folder: str) -> Optional[Tuple[str, int]]:
    """``(iter folder, iteration)`` named by ``folder``'s Megatron tracker when it is a
    torch_dist checkpoint; None when ``folder`` holds no tracker or another format."""
    tracker = os.path.join(folder, TRACKER)
    if not os.path.isfile(tracker):
        return None
    text = open(tracker, encoding="utf-8").read().strip()
    if not text.isdigit():
        return None
    path = os.path.join(folder, f"iter_{int(text):07d}")
    return (path, int(text)) if is_torch_dist_dir(path) else None


def _check_supported(names, path: str) -> None:
    distributed = next((n for n in names if n.startswith("optimizer.distributed.")), None)
    if distributed is not None:
        raise ValueError(f"{path}: holds the distributed optimizer's flat buffers "
                         f"({distributed}) but common.pt records no "
                         f"optimizer.param_state_sharding_type to read them by")
    moe = next((n for n in names if ".experts." in n or ".router." in n), None)
    if moe is not None:
        raise ValueError(f"{path}: MoE tensor {moe}: torch_dist training checkpoints of MoE "
                         f"models are not built (dense models only)")


def import_torch_dist(path: str, save_dir: str, state: dict, gated: bool,
                      global_batch_size: int) -> Tuple[str, dict]:
    """Write the torch_dist training checkpoint ``path`` as a one-rank ms-llm checkpoint in
    ``save_dir`` (``ckpt.load`` then reshards it to the run's layout): ``(its path, the state
    it records)``. ``state`` supplies what torch_dist cannot hold (the RNG, the model config)."""
    reader = TorchDistReader(path)
    distributed = sharding_type(reader) is not None
    _check_supported([] if distributed else reader.tensors, path)
    got = read_training_state(reader)
    if distributed:   # --use-distributed-optimizer: fp32 params and moments in its layout
        got["model"], got["optimizer"] = read_distributed(reader, got["model"])
    if not any(k.startswith(MOMENTS[0] + ".") for k in got["optimizer"]):
        raise ValueError(f"{path}: holds no Adam moments (optimizer.state.exp_avg.*): a "
                         f"weights-only checkpoint, not a training state to resume")
    main = "optimizer.state.fp32_param."
    if any(k.startswith(main) for k in reader.tensors):   # bf16 runs: the fp32 main params
        got["model"] = {k[len(main):]: v for k, v in read_state(reader, (main,)).items()}
    args = reader.common.get("args")
    return write_training_dcp(
        save_dir, got["model"], got["optimizer"], int(got["iteration"] or 0),
        got["opt_param_scheduler"], getattr(args, "consumed_train_samples", None), state,
        gated, global_batch_size, path)


def write_training_dcp(save_dir: str, model: Dict[str, np.ndarray],
                       optimizer: Dict[str, np.ndarray], iteration: int,
                       scheduler: Optional[dict], consumed: Optional[int], state: dict,
                       gated: bool, global_batch_size: int, source: str) -> Tuple[str, dict]:
    """A Megatron training state (global tensors under the per-layer Megatron names, moments as
    ``exp_avg.<name>``, ``step``) as a one-rank ms-llm checkpoint at ``iteration``."""
    for key, value in (("iteration", iteration), ("args.consumed_train_samples", consumed)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 0):
            raise ValueError(f"{source}: {key} must be a non-negative integer, got "
                             f"{value!r:.40} (tampered or corrupt)")
    local: Dict[str, LocalChunk] = {}

    def add(name: str, value: np.ndarray) -> None:
        value = np.ascontiguousarray(value, np.float32)
        if gated and name.endswith(_GATED):
            half = value.shape[0] // 2
            for part, rows in (("gate", value[:half]), ("up", value[half:])):
                local[f"{name}:{part}"] = LocalChunk(rows, rows.shape)
        else:
            local[name] = LocalChunk(value, value.shape)

    for name, value in model.items():
        add(name, value)
        for m in MOMENTS:
            key = f"{m}.{name}"
            if key not in optimizer:
                raise ValueError(f"{source}: no {m} for {name}")
            add(f"{OPT}{key}", optimizer[key])
    out = dict(state, step=iteration,
               optimizer_step=int(np.asarray(optimizer.get("step", iteration)).reshape(-1)[0]),
               data={"consumed_samples": int(consumed if consumed is not None
                                             else iteration * global_batch_size)},
               skipped_steps=0, imported_from=os.path.abspath(source))
    if scheduler is not None:
        out["opt_param_scheduler"] = {k: v for k, v in scheduler.items()
                                      if isinstance(v, (int, float, str))}
    out.pop("lr_schedule", None)   # Megatron's own schedule values are checked by the scheduler
    saved = dcp.save_checkpoint(save_dir, iteration, local, out, rank=0, world_size=1,
                                barrier=lambda: None)
    return saved, out


def read_training_dcp(dcp_path: str) -> Tuple[Dict[str, np.ndarray], Dict[str, np.ndarray],
                                              dict, int]:
    """``(model, optimizer, state, step)`` of a complete ms-llm checkpoint: global fp32
    tensors under Megatron's names (``:gate``/``:up`` joined), moments as ``exp_avg.<name>``."""
    with dcp.DCPReader(dcp_path) as r:
        state = r.state
        step = int(r.step)
        whole: Dict[str, dict] = {}
        for name in r.names():
            base, _, part = name.partition(":")
            if part not in ("", "gate", "up"):
                raise ValueError(f"{dcp_path}: tensor {name}: no Megatron name for its "
                                 f"part {part!r}")
            whole.setdefault(base, {})[part] = r.read(name, dtype=np.float32)
    _check_supported(whole, dcp_path)
    merged = {k: (v[""] if "" in v else np.concatenate([v["gate"], v["up"]], 0))
              for k, v in whole.items()}
    model = {k: v for k, v in merged.items() if not k.startswith(OPT)}
    optim: Dict[str, np.ndarray] = {k[len(OPT):]: v for k, v in merged.items()
                                    if k.startswith(OPT)}
    optim["step"] = np.int64(state.get("optimizer_step", step))
    return model, optim, state, step


@contextlib.contextmanager
def staged_iter(save_dir: str, step: int) -> Iterator[str]:
    """A temporary ``.tmp_iter_<step>`` folder to write a Megatron-format save into, renamed to
    ``iter_<step>`` only once it is whole (removed if the write fails), so an interrupted save
    never leaves a folder that looks like a checkpoint."""
    out = os.path.join(save_dir, f"iter_{step:07d}")
    tmp = os.path.join(save_dir, f".tmp_iter_{step:07d}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.isdir(out):   # the same step saved again (a resumed run): the new one wins
        shutil.rmtree(out)
    os.rename(tmp, out)


def write_tracker(save_dir: str, step: int) -> None:
    tmp = os.path.join(save_dir, TRACKER + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(str(step))
    os.replace(tmp, os.path.join(save_dir, TRACKER))


def export_torch_dist(dcp_path: str, save_dir: str, *, lr: float, betas, eps: float,
                      weight_decay: float, global_batch_size: int,
                      megatron_args: Optional[dict] = None, distributed: bool = False) -> str:
    """Rewrite the complete ms-llm checkpoint ``dcp_path`` as ``save_dir/iter_<step>`` in
    torch_dist (model, Adam moments, common_step, iteration, opt_param_scheduler, ``args`` with
    the consumed samples) and point ``save_dir``'s tracker at it; returns the folder.
    ``distributed``: the DistributedOptimizer's ``fully_reshardable`` layout, for a PyTorch-lane
    run with ``--use-distributed-optimizer`` (which cannot load the other)."""
    model, optim, state, step = read_training_dcp(dcp_path)
    consumed = int((state.get("data") or {}).get("consumed_samples", step * global_batch_size))
    args = argparse.Namespace(**{**(megatron_args or {}), "iteration": step,
                                 "consumed_train_samples": consumed,
                                 "consumed_valid_samples": 0, "ckpt_format": "torch_dist"})
    with staged_iter(save_dir, step) as tmp:
        write_training_state(TorchDistWriter(tmp), model, optim, iteration=step,
                             scheduler=state.get("opt_param_scheduler"), lr=lr, betas=betas,
                             eps=eps, weight_decay=weight_decay,
                             extra_common={"args": args, "checkpoint_version": 3.0},
                             distributed=distributed)
    write_tracker(save_dir, step)
    return os.path.join(save_dir, f"iter_{step:07d}")
