"""The trainer's side of Megatron training checkpoints: Megatron-Core's ``torch_dist`` and the
legacy ``torch`` format (``checkpoint.format: torch_dist | torch``, ``--ckpt-format torch_dist``;
``checkpoint.resume_from``, ``--load``).

Resume: rank 0 rewrites the Megatron checkpoint as a one-piece ms-llm checkpoint in a staging
folder (``ms_llm.checkpoint.torch_dist.train``) and every rank then loads it through the
trainer's ordinary, layout-free load, so a checkpoint saved at one tp / dp resumes at another.
Save: every rank writes the ordinary ms-llm checkpoint into the staging folder, then rank 0
rewrites it as ``save_dir/iter_<step>`` in the Megatron format and updates Megatron's tracker
(older iterations are kept: ``checkpoint.keep_last`` prunes ms-llm's own format only).
"""
from __future__ import annotations

import os
import shutil
from typing import Callable, Optional

from ms_llm.checkpoint.formats import checkpoint_format, megatron_problem, tracker_problem
from ms_llm.checkpoint.megatron.train import export_legacy, import_legacy, \
    latest_legacy_training
from ms_llm.checkpoint.native.format import TRACKER, DCPError, list_iters
from ms_llm.checkpoint.torch_dist.io import is_torch_dist_dir
from ms_llm.checkpoint.torch_dist.train import export_torch_dist, import_torch_dist
from ms_llm.checkpoint.verify import quarantine
from ms_llm.config import ConfigError
from ms_llm.models.mixers import mixers_used

STAGING = ".ms_llm_staging"
_FAILED = "FAILED"


def is_torch_dist(cfg) -> bool:
    """Whether ``save_dir`` holds Megatron's format (torch_dist or legacy torch)."""
    return cfg.checkpoint.format in ("torch_dist", "torch")


def _latest(folder: str, say: Callable[[str], None]) -> Optional[str]:
    """The newest Megatron training checkpoint of ``folder`` that verifies (zip CRC-32 /
    ``.metadata`` checks, ``checkpoint.formats``), the way the native format falls back: newer
    ones that do not verify are skipped and said (``quarantine_newer`` then moves them aside);
    a tracker naming no iteration is said and the newest intact ``iter_*`` used. None when the
    folder holds no Megatron checkpoint; ``DCPError`` when it holds only broken ones (a fresh
    start would write over them)."""
    why = tracker_problem(folder)
    if why:
        say(f"resume: {why}; using the newest iter_* that verifies")
        tracked = None
    else:   # Megatron's tracker is written after a save: newer folders are not finished
        tracked = _tracked_step(folder)
    skipped = []
    for step, path in reversed(list_iters(folder)):
        if checkpoint_format(path) == "native" or (tracked is not None and step > tracked):
            continue
        why = megatron_problem(path)
        if why is None:
            if skipped:
                say(f"resume: skipping checkpoint(s) that do not verify: {'; '.join(skipped)}; "
                    f"falling back to {path}")
            if checkpoint_format(path) == "torch" and latest_legacy_training(path) is None:
                return None   # converted weights, not a training state: not resumed from
            return path
        skipped.append(why)
    if skipped:
        raise DCPError(f"{folder}: holds checkpoint(s) that do not verify and none to resume "
                       f"from ({skipped[0]}); move them away, or pick another save_dir")
    return None


def _tracked_step(folder: str) -> Optional[int]:
    """The iteration ``folder``'s tracker names (checked by ``tracker_problem``), or None."""
    path = os.path.join(folder, TRACKER)
    if not os.path.isfile(path):
        return None
    text = open(path, encoding="utf-8").read().strip()
    return int(text) if text.isdigit() else None


def quarantine_newer(cfg, source: str, rank: int, say: Callable[[str], None]) -> None:
    """After resuming from ``source`` in ``save_dir`` (every rank past ``stage_resume``'s
    barrier): rank 0 renames the newer Megatron ``iter_*`` folders, which ``_latest`` skipped
    because they do not verify, to ``.unverified_iter_*`` (kept, never loaded, never written
    over) and points the tracker at ``source``, as ``verify.guard_save_dir`` does for ms-llm's
    own format."""
    save_dir = cfg.checkpoint.save_dir
    if rank != 0 or not save_dir or os.path.dirname(os.path.abspath(source)) != \
            os.path.abspath(save_dir):
        return
    step = int(os.path.basename(os.path.normpath(source)).split("_")[-1])
    newer = [(s, p) for s, p in list_iters(save_dir)
             if s > step and checkpoint_format(p) != "native"]
    quarantine(save_dir, newer, step, say)


def resume_source(cfg, say: Callable[[str], None] = lambda _m: None) -> Optional[str]:
    """The Megatron ``iter_*`` folder this run resumes from, or None (ms-llm's own resume):
    under ``training.resume auto`` the run's own newest save in ``save_dir`` first (a relaunch
    continues its own saves, in either format), else ``checkpoint.resume_from`` (a folder with
    a tracker, or an ``iter_*`` folder)."""
    ck = cfg.checkpoint
    if (is_torch_dist(cfg) or ck.resume_from) and (cfg.lora.r or cfg.model.mlp_type == "moe"):
        raise ConfigError(f"checkpoint.format {ck.format} / checkpoint.resume_from: Megatron "
                          f"training checkpoints of LoRA or MoE runs are not built (dense "
                          f"full-parameter training only)")
    unbuilt = [k.title for k in mixers_used(cfg.model) if not k.megatron_training_checkpoints]
    if (is_torch_dist(cfg) or ck.resume_from) and unbuilt:
        raise ConfigError(f"checkpoint.format {ck.format} / checkpoint.resume_from: Megatron "
                          f"training checkpoints of {', '.join(unbuilt)} layers "
                          f"(model.layer_types) are not built (refused here, not at the first "
                          f"save)")
    if cfg.training.resume == "auto" and ck.save_dir:
        if is_torch_dist(cfg):
            found = _latest(ck.save_dir, say)
            if found is not None:
                return found
        elif _has_own_checkpoint(ck.save_dir):   # a relaunch continues its own ms-llm saves
            return None
    if not ck.resume_from:
        return None
    if is_torch_dist_dir(ck.resume_from) or _is_legacy_iter(ck.resume_from):
        return ck.resume_from
    found = _latest(ck.resume_from, say)
    if found is None:
        raise ConfigError(f"checkpoint.resume_from {ck.resume_from}: not a Megatron training "
                          f"checkpoint (no latest_checkpointed_iteration.txt naming an iter_* "
                          f"folder in torch_dist, or in torch format with an optimizer entry)")
    return found


def _has_own_checkpoint(save_dir: str) -> bool:
    from ms_llm.checkpoint.native import dcp
    return dcp.find_latest_complete(save_dir, "size", report=lambda _m: None) is not None


def _is_legacy_iter(path: str) -> bool:
    return os.path.isdir(path) and any(d.startswith("mp_rank_") for d in os.listdir(path))


def staging_dir(cfg) -> str:
    """Shared by every rank (the save folder, or the output folder when there is none)."""
    return os.path.join(cfg.checkpoint.save_dir or cfg.training.output_dir, STAGING)


def _rank0(work: Callable[[], object], where: str, rank: int, barrier) -> None:
    """Run ``work`` on rank 0; a failure there raises on every rank (no rank waits forever)."""
    flag = os.path.join(where, _FAILED)
    if rank == 0:
        try:
            if os.path.exists(flag):
                os.remove(flag)
            work()
        except Exception as e:
            os.makedirs(where, exist_ok=True)
            with open(flag, "w", encoding="utf-8") as f:
                f.write(" ".join(f"{type(e).__name__}: {e}".split()))
            barrier()
            raise
    barrier()
    if rank != 0 and os.path.isfile(flag):
        with open(flag, encoding="utf-8") as f:
            raise RuntimeError(f"rank 0 failed on {where}: {f.read().strip()}")


def stage_resume(source: str, cfg, state: dict, rank: int, barrier,
                 say: Callable[[str], None]) -> str:
    """Collective: the ms-llm checkpoint (in the staging folder) every rank loads instead of
    ``source``. ``state`` is what torch_dist cannot hold (this run's RNG and model config)."""
    where = os.path.join(staging_dir(cfg), "import")

    def work():
        shutil.rmtree(where, ignore_errors=True)
        try:
            kw = {"gated": bool(cfg.model.gated_linear_unit),
                  "global_batch_size": cfg.training.global_batch_size}
            if is_torch_dist_dir(source):
                import_torch_dist(source, where, state, **kw)
            else:
                import_legacy(source, where, state, model_type_hf=cfg.model_family, **kw)
        except ValueError as e:
            raise ConfigError(f"checkpoint.resume_from: {e}") from None
    _rank0(work, staging_dir(cfg), rank, barrier)
    from ms_llm.checkpoint.native import dcp
    path = dcp.find_latest_complete(where)
    say(f"resuming from the Megatron checkpoint {source} (its torch RNG state is not taken: "
        f"MindSpore's generators keep training.seed's)")
    return path


def native_save_dir(cfg) -> str:
    """Where the trainer's own save writes: ``save_dir``, or the staging folder under it."""
    return os.path.join(staging_dir(cfg), "export") if is_torch_dist(cfg) else \
        cfg.checkpoint.save_dir


def publish(cfg, native_path: str, rank: int, barrier) -> str:
    """Collective, after the trainer's save: with ``checkpoint.format torch_dist`` / ``torch``
    rank 0 rewrites ``native_path`` as ``save_dir/iter_<step>`` in it; returns the path."""
    if not is_torch_dist(cfg):
        return native_path
    t = cfg.training
    out = {}

    def work():
        kw = dict(lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps,
                  weight_decay=t.weight_decay, global_batch_size=t.global_batch_size,
                  megatron_args=megatron_args(cfg))
        if cfg.checkpoint.format == "torch_dist":   # distopt: the layout its loader takes
            out["path"] = export_torch_dist(native_path, cfg.checkpoint.save_dir, **kw,
                                            distributed=distributed_layout(cfg))
        else:
            out["path"] = export_legacy(native_path, cfg.checkpoint.save_dir, **kw)
        shutil.rmtree(native_path, ignore_errors=True)
    _rank0(work, staging_dir(cfg), rank, barrier)
    step = int(os.path.basename(native_path).split("_")[-1])
    return out.get("path", os.path.join(cfg.checkpoint.save_dir, f"iter_{step:07d}"))


def distributed_layout(cfg) -> bool:
    """Whether a torch_dist save is written in the DistributedOptimizer's layout: when this run
    uses it (``parallel.use_distributed_optimizer``, ``--use-distributed-optimizer``), as the
    PyTorch-lane run going on from the save does, whose loader cannot take the other layout."""
    return bool(cfg.parallel.use_distributed_optimizer)


def megatron_args(cfg) -> dict:
    """The ``args`` Megatron-LM's loader compares against its own (architecture, batch) and
    reads (``consumed_train_samples`` is added by the export)."""
    m, t, p = cfg.model, cfg.training, cfg.parallel
    return {"num_layers": m.num_layers, "hidden_size": m.hidden_size,
            "ffn_hidden_size": m.ffn_hidden_size, "num_attention_heads": m.num_attention_heads,
            "num_query_groups": m.num_query_groups, "kv_channels": m.kv_channels,
            "group_query_attention": m.num_query_groups != m.num_attention_heads,
            "padded_vocab_size": m.padded_vocab_size,
            "max_position_embeddings": m.max_position_embeddings, "add_position_embedding": False,
            "position_embedding_type": "rope", "normalization": m.normalization,
            "swiglu": bool(m.gated_linear_unit), "qk_layernorm": bool(m.qk_layernorm),
            "untie_embeddings_and_output_weights": bool(m.untie_embeddings_and_output_weights),
            "tensor_model_parallel_size": p.tensor_model_parallel_size,
            "pipeline_model_parallel_size": p.pipeline_model_parallel_size,
            "micro_batch_size": t.micro_batch_size, "global_batch_size": t.global_batch_size,
            "train_iters": t.max_steps, "seed": t.seed, "lr": t.lr, "min_lr": t.min_lr,
            "bf16": bool(t.bf16), "fp16": False,
            "use_distributed_optimizer": cfg.checkpoint.format == "torch_dist"
            and distributed_layout(cfg)}
