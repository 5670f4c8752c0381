"""Is a distributed checkpoint intact, and may a run write into its folder?

Why a module of its own: a checkpoint is trusted only after its ``metadata.json`` has the
expected structure (a hand-edited or garbage file must give a reason, not a ``KeyError``) and
every file it lists has its recorded size and crc32 (the crc is computed while the file is
written, ``native.save._write_safetensors``, so verifying costs one sequential read). Discovery
(``native.discovery``) uses this to fall back past broken checkpoints; ``guard_save_dir`` keeps a
run from writing into a folder whose checkpoints it cannot vouch for; ``ms-llm checkpoint
verify DIR`` (``ms_llm.cli.checkpoint``) reports the verdict of every checkpoint in a folder
(``checkpoints_in``, ``verify_any``).
"""
from __future__ import annotations

import os
import time
from typing import Callable, Dict, List, Optional, Tuple

from .formats import checkpoint_format, megatron_problem
from .native.format import FORMAT, METADATA, TRACKER, DCPError, file_crc32, list_iters, read_json

__all__ = ["metadata_problem", "verify_checkpoint", "verify_file", "guard_save_dir",
           "quarantine", "SHAPE_KEYS", "checkpoints_in", "verify_any"]

# TransformerConfig fields that fix a tensor's shape: a checkpoint recording other values
# belongs to another model (the state's ``model_config``).
SHAPE_KEYS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
              "num_query_groups", "kv_channels", "vocab_size", "padded_vocab_size",
              "num_moe_experts", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
              "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
              "mtp_num_layers")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def metadata_problem(meta: dict, mpath: str) -> Optional[str]:
    """Why ``meta`` (a parsed ``metadata.json``) is not a usable checkpoint description, or None.

    Checks the structure the loader relies on: ``files`` maps names to ``{size, crc32}``
    (non-negative ints), every tensor has a dtype, an int global shape and chunks inside it that
    live in a listed file, and ``state`` is an object with an int ``step``."""
    if meta.get("format") != FORMAT:
        return f"{mpath}: not an {FORMAT} checkpoint (format {meta.get('format')!r})"
    files, tensors, state = meta.get("files"), meta.get("tensors"), meta.get("state")
    if not isinstance(files, dict) or not isinstance(tensors, dict) or not isinstance(state, dict):
        return f"{mpath}: 'files', 'tensors' and 'state' must be JSON objects"
    if not _is_int(meta.get("step")) or meta["step"] < 0:
        return f"{mpath}: 'step' must be a non-negative integer, got {meta.get('step')!r}"
    why = _state_problem(state)
    if why:
        return f"{mpath}: {why}"
    for name, f in files.items():
        if os.path.basename(name) != name or name in ("", ".", ".."):
            return f"{mpath}: file name {name!r} is not a plain file name"
        if not isinstance(f, dict) or not all(_is_int(f.get(k)) and f[k] >= 0
                                               for k in ("size", "crc32")):
            return f"{mpath}: files[{name!r}] needs integer 'size' and 'crc32'"
    for name, t in tensors.items():
        if not isinstance(t, dict) or not isinstance(t.get("dtype"), str):
            return f"{mpath}: tensor {name!r} has no dtype"
        g = t.get("global_shape")
        if not isinstance(g, list) or not all(_is_int(s) and s >= 0 for s in g):
            return f"{mpath}: tensor {name!r}: global_shape {g!r} is not a list of sizes"
        chunks = t.get("chunks")
        if not isinstance(chunks, list):
            return f"{mpath}: tensor {name!r} has no chunk list"
        for c in chunks:
            if not isinstance(c, dict) or c.get("file") not in files \
                    or not isinstance(c.get("key"), str):
                return f"{mpath}: tensor {name!r}: a chunk names no listed file"
            off, sz = c.get("offsets"), c.get("sizes")
            if not (isinstance(off, list) and isinstance(sz, list) and len(off) == len(g)
                    == len(sz) and all(_is_int(o) and _is_int(s) and 0 <= o and 0 <= s
                                       and o + s <= n for o, s, n in zip(off, sz, g))):
                return (f"{mpath}: tensor {name!r}: chunk offsets {off!r} sizes {sz!r} lie "
                        f"outside its global shape {g}")
    return None


# state keys the trainer resumes from: counts, so non-negative integers when present
_STATE_COUNTS = (("step",), ("optimizer_step",), ("skipped_steps",),
                 ("data", "consumed_samples"))


def _state_problem(state: dict) -> Optional[str]:
    """Why the saved ``state`` would resume wrongly (a hand-edited count), or None."""
    for path in _STATE_COUNTS:
        value, where = state, state
        for k in path:
            where = value
            value = value.get(k) if isinstance(value, dict) else None
        if isinstance(where, dict) and path[-1] in where and \
                not (_is_int(value) and value >= 0):
            return f"state.{'.'.join(path)} must be a non-negative integer, got {value!r}"
    if "data" in state and not isinstance(state["data"], dict):
        return f"state.data must be an object, got {state['data']!r:.40}"
    return None


def verify_file(path: str, entry: dict, crc: bool = True) -> Optional[str]:
    """Why the file at ``path`` is not the one ``entry`` (``{size, crc32}``) records, or None."""
    if not os.path.isfile(path):
        return f"{path} is missing"
    have = os.path.getsize(path)
    if have != entry["size"]:
        return f"{path} has {have} bytes, metadata records {entry['size']} (truncated?)"
    if crc and file_crc32(path) != entry["crc32"]:
        return f"{path}: crc32 differs from the metadata (corrupt)"
    return None


def verify_checkpoint(path: str, crc: bool = True) -> Optional[str]:
    """None if ``path`` is an intact checkpoint, else the first reason it is not (metadata
    missing / unreadable / malformed, a file missing, truncated or, with ``crc``, corrupt)."""
    mpath = os.path.join(path, METADATA)
    if not os.path.isfile(mpath):
        return f"{mpath} is missing (save did not finish)"
    try:
        meta = read_json(mpath)
    except (DCPError, UnicodeDecodeError, OSError) as e:
        return str(e) if isinstance(e, DCPError) else f"{mpath}: unreadable ({e})"
    why = metadata_problem(meta, mpath)
    if why:
        return why
    for name, f in meta["files"].items():
        why = verify_file(os.path.join(path, name), f, crc)
        if why:
            return why
    return None


def _foreign(path: str, model_config: Dict) -> Optional[str]:
    """The first shape key on which the checkpoint's recorded model differs from the run's."""
    saved = read_json(os.path.join(path, METADATA))["state"].get("model_config")
    if not isinstance(saved, dict):
        return None
    for k in SHAPE_KEYS:
        if k in saved and k in model_config and saved[k] != model_config[k]:
            return f"model.{k} {saved[k]} there, {model_config[k]} in this run"
    return None


def guard_save_dir(save_dir: Optional[str], resume_path: Optional[str],
                   model_config: Optional[Dict], say: Callable[[str], None],
                   rank: int = 0) -> None:
    """Before a run writes checkpoints into ``save_dir``: refuse (``DCPError``, one line) when
    the folder holds checkpoints none of which verifies and the run is not resuming from one
    (a fresh start would overwrite shards that may still be recovered), or an intact checkpoint
    of another model shape. When resuming from an intact checkpoint, newer broken ones are
    renamed to ``.unverified_iter_*`` (kept for inspection, never loaded, never overwritten) by
    rank 0 and said once. Without a resume point the newest checkpoints are crc-verified until
    one passes (usually one read)."""
    if not save_dir or not os.path.isdir(save_dir):
        return
    found = list_iters(save_dir)
    if resume_path is None:   # newest first, until one verifies (usually one read)
        first_why = None
        for _, p in reversed(found):
            why = verify_checkpoint(p, crc=True)
            if why is None:
                diff = _foreign(p, model_config or {})
                if diff:
                    raise DCPError(f"checkpoint.save_dir {save_dir}: {p} belongs to another "
                                   f"model ({diff}); pick another save_dir")
                return
            first_why = first_why or why
        if found:
            raise DCPError(f"checkpoint.save_dir {save_dir}: holds checkpoint(s) that do not "
                           f"verify and none to resume from ({first_why}); move them away, "
                           f"or pick another save_dir")
        return
    resume_step = next((s for s, p in found
                        if os.path.realpath(p) == os.path.realpath(resume_path)), None)
    if resume_step is None:
        return   # resuming from a checkpoint outside save_dir: nothing of it is overwritten
    if rank != 0:
        return
    newer = [(s, p) for s, p in found if s > resume_step]
    newer = [(s, p) for s, p in newer if verify_checkpoint(p, crc=True) is not None]
    quarantine(save_dir, newer, resume_step, say)


def quarantine(save_dir: str, newer: List[Tuple[int, str]], resume_step: int,
               say: Callable[[str], None]) -> None:
    """Rename the checkpoints ``newer`` (``(step, path)``, found not to verify) to
    ``.unverified_iter_*`` (kept for inspection, never loaded, never written over), point the
    tracker at ``resume_step`` and say so once. Rank 0 only; any format."""
    if not newer:
        return
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    moved = []
    for s, p in newer:
        dst = os.path.join(save_dir, f".unverified_iter_{s:07d}_{stamp}")
        os.rename(p, dst)
        moved.append(dst)
    tracker = os.path.join(save_dir, TRACKER)
    tmp = tracker + f".tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(str(resume_step))
    os.replace(tmp, tracker)
    say(f"resume: kept {len(moved)} checkpoint(s) that do not verify as "
        f"{', '.join(moved)} (never loaded); the run continues from step {resume_step}")


def checkpoints_in(path: str) -> List[str]:
    """The checkpoint folders ``path`` names: itself when it is one (an ``iter_*`` folder of any
    format), else every ``iter_*`` folder of a save_dir."""
    if os.path.isfile(os.path.join(path, METADATA)) or checkpoint_format(path) != "native" or \
            os.path.basename(os.path.normpath(path)).startswith("iter_"):
        return [path]
    release = os.path.join(path, "release")   # a converted Megatron folder's tracker names it
    return [cp for _, cp in list_iters(path)] + \
        ([release] if os.path.isdir(release) and checkpoint_format(release) != "native" else [])


def verify_any(path: str, crc: bool) -> Tuple[Optional[str], str]:
    """(reason or None, the ok line) for one checkpoint folder of any format."""
    fmt = checkpoint_format(path)
    if fmt == "native":
        return verify_checkpoint(path, crc), "ok"
    what = "zip CRC-32 of every entry" if crc else "structure and sizes"
    if fmt == "torch_dist":
        what = "structure, byte ranges and every chunk's CRC-32, size and dtype" if crc \
            else "structure and byte ranges"
    return megatron_problem(path, crc), f"ok ({fmt} format: {what} checked)"
