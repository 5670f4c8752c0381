"""Training checkpoints on the distributed checkpoint format (``ms_llm.checkpoint.native.dcp``).

Every rank writes the real rows it owns of each parameter and optimizer-state tensor (asked of
the optimizer through the ``ms_llm.optim.Optimizer`` protocol), described as a region of the
*global* (unsharded) tensor, so a checkpoint saved under one layout (fsdp=3, tp=2, dp
replicas...) loads under another. The regions, names and the writing replica all come
from each parameter's ``Placement`` (``ms_llm.parallel.placement``): e.g. a fused gated
``linear_fc1`` is stored as ``<name>:gate`` and ``<name>:up`` because a tensor-parallel rank holds
``[gate_r; up_r]``, rows that are one rectangle of each half but not of ``[gate; up]``.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional

import numpy as np
from mindspore import Tensor

from ms_llm.checkpoint.native import dcp
from ms_llm.compat import bfloat16, float32
from .nonfinite import NonFiniteError
from ms_llm.parallel.placement import (Mesh, checkpoint_regions, placement_of, stored_view,
                                       writes_checkpoint)

log = logging.getLogger("ms_llm.train")


def _pieces(named_params, optimizer, pstate):
    """Per model tensor and per optimizer-state tensor held here: its regions (from its
    ``Placement``), whether this rank writes them. Buffers such as ``expert_bias`` have no moments; the
    distributed optimizer's moments carry the ``dp``/``edp`` cut in their placement."""
    mesh = Mesh.of(pstate)
    for name, p in named_params:
        # bf16 training: the fp32 main parameter (or this rank's shard of it) is what is stored
        src = optimizer.checkpoint_tensor(p)
        if src is not None:
            pl = placement_of(src)
            yield (pl, "", src, checkpoint_regions(name, tuple(src.shape), pl, mesh),
                   writes_checkpoint(pl, mesh))
        for prefix, tensor, spl in optimizer.state_tensors(p):
            yield (spl, prefix, tensor, checkpoint_regions(name, tuple(tensor.shape), spl, mesh),
                   writes_checkpoint(spl, mesh))


def save(save_dir: str, step: int, model_named, optimizer, pstate, state: dict, barrier,
         rank: int, world: int, keep_last: Optional[int] = None, all_finite=None) -> str:
    """Write this rank's pieces. A checkpoint with a NaN/inf is never written: every tensor is
    checked first and ``all_finite(first bad name or None)`` (collective, from
    ``all_ranks_finite``) makes every rank refuse together."""
    local = {}
    for pl, prefix, tensor, regions, write in _pieces(model_named, optimizer, pstate):
        # bf16 state (O2's Adam moments) is stored as fp32, exactly, as Megatron's distributed
        # optimizer checkpoint holds it; loading rounds it back without loss.
        host = tensor.astype(float32) if tensor.dtype == bfloat16 else tensor
        data = stored_view(host.asnumpy(), pl)
        for r in regions:
            piece = data[r.lstart:r.lstart + r.length] if data.ndim else data
            local[prefix + r.name] = dcp.LocalChunk(piece, r.gshape, r.offsets, write=write)
    bad = next((n for n, c in local.items()
                if c.data.dtype.kind == "f" and not np.isfinite(c.data).all()), None)
    bad = all_finite(bad) if all_finite is not None else bad
    if bad is not None:
        raise NonFiniteError(f"checkpoint step {step} not written: {bad} holds a non-finite "
                             f"value (the last checkpoint in {save_dir} stays the newest)")
    state = dict(state, optimizer_step=optimizer.step_count)
    return dcp.save_checkpoint(save_dir, step, local, state, rank=rank, world_size=world,
                               barrier=barrier, keep_last=keep_last,
                               mesh={"tp": pstate.sizes.tp, "dp": pstate.sizes.dp,
                                     "ep": pstate.sizes.ep})


def _requested_by_every_rank(wanted) -> Optional[set]:
    """The union of the names all ranks load (None in one process): a pipeline stage or an
    expert-parallel rank wants part of the model, so the "nothing stored is left unread" check
    needs every rank's list."""
    from ms_llm.parallel import comm
    world = comm.get_world_size()
    if world == 1:
        return None
    names = [None] * world
    comm.all_gather_object(names, sorted(wanted))
    return {n for lst in names for n in lst}


def load(path: str, model_named, optimizer, pstate) -> dict:
    wanted, plan = {}, []
    for _, prefix, tensor, regions, _ in _pieces(model_named, optimizer, pstate):
        for r in regions:
            wanted[prefix + r.name] = dcp.WantedChunk(r.gshape, r.offsets, r.sizes, np.float32)
        plan.append((tensor, [prefix + r.name for r in regions]))
    arrays, state = dcp.load_checkpoint(path, wanted,
                                        requested_anywhere=_requested_by_every_rank(wanted))
    for tensor, names in plan:
        data = np.concatenate([arrays[n] for n in names], 0) if len(names) > 1 else arrays[names[0]]
        tensor.set_data(Tensor(np.ascontiguousarray(data).reshape(tensor.shape))
                        .astype(tensor.dtype))
    optimizer.step_count = int(state["optimizer_step"])
    optimizer.load_finished()
    return state


def all_ranks_finite(world: int) -> Callable[[Optional[str]], Optional[str]]:
    """For ``checkpointing.save``: given this rank's first non-finite tensor (or None), the
    description of a non-finite tensor on any rank (or None); one 1-element all-reduce when
    there are several workers, so every rank refuses the save together."""
    def agree(bad: Optional[str]) -> Optional[str]:
        if world == 1:
            return bad
        from ms_llm.parallel import comm
        flag = Tensor(np.array([0.0 if bad is None else 1.0], np.float32))
        comm.all_reduce(flag, group=comm.world_group())
        if bad is None and float(flag.asnumpy()[0]) > 0:
            return "a tensor on another rank (its log names it)"
        return bad
    return agree
