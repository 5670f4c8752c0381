"""Distributed, reshardable training checkpoints: every rank writes only its own rows.

Why this layout: with FSDP a rank never holds a whole tensor, and the next run may use a
different world size (fsdp=3 -> fsdp=2, fsdp=1, tp=2). So each rank writes its *pieces* and the
metadata records, per tensor, the global shape and where every piece sits; a loader asks for any
hyper-rectangle and gets it assembled from whatever pieces overlap it.

Layout (Megatron's tracker and folder names, so existing tooling finds the newest iteration)::

    <save_dir>/latest_checkpointed_iteration.txt     "10", written atomically after a complete save
    <save_dir>/iter_0000010/rank_00000.safetensors   rank 0's real rows (no padding/empty pieces)
    <save_dir>/iter_0000010/rank_00000.json          rank 0's chunk list + file size + crc32
    <save_dir>/iter_0000010/metadata.json            written LAST: its presence marks completeness

Protocol (the only collective is a ``barrier()`` callable): all ranks ``write_rank_files`` into
``<save_dir>/.tmp_iter_0000010``; ``barrier()``; rank 0 ``finalize``s (validates every rank's
files, checks the chunks tile each tensor exactly, writes ``metadata.json``, fsyncs, renames the
folder to ``iter_0000010``, updates the tracker, prunes to ``keep_last``); ``barrier()``; every
rank then checks the outcome, so a failed finalisation raises on all ranks instead of hanging.

Loading (``load_checkpoint``) never touches a checkpoint whose metadata is missing or whose files
do not have their recorded sizes; ``find_latest_complete`` falls back past such checkpoints and
says so. Tensors are read slice by slice (``safe_open(...).get_slice``), so a rank reads only the
rows it wants. Export to Hugging Face / Megatron folders lives in ``export``.

This module is the public face; the code lives in ``format`` (names, pieces, helpers shared by
all the others), ``save``, ``discovery``, ``load`` and ``export``. The export
functions are imported on first use: they pull in the converter, which saving and loading do not
need.
"""
from __future__ import annotations

from typing import Any

from .discovery import check_complete, find_latest_complete, read_state, resolve_resume
from .format import (FAILED, FORMAT, METADATA, TRACKER, VERSION, DCPError, LocalChunk,
                     WantedChunk, block_chunk, dim0_chunk)
from .load import DCPReader, load_checkpoint
from .save import finalize, save_checkpoint, write_rank_files

__all__ = ["LocalChunk", "WantedChunk", "DCPError", "save_checkpoint", "write_rank_files",
           "finalize", "load_checkpoint", "DCPReader", "find_latest_complete", "check_complete",
           "resolve_resume", "read_state", "dim0_chunk", "block_chunk", "export_hf",
           "export_megatron"]


def __getattr__(name: str) -> Any:
    if name in ("export_hf", "export_megatron"):
        from . import export as dcp_export
        return getattr(dcp_export, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
