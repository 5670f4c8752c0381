"""Training checkpoints on the distributed checkpoint format (``ms_llm.checkpoint.dcp``).

Every rank writes the real rows it owns of each parameter and AdamW moment, described as a
region of the *global* (unsharded) tensor, so a checkpoint saved under one layout (fsdp=3,
tp=2, dp replicas...) loads under another. A fused gated ``linear_fc1`` is stored as two tensors,
``<name>:gate`` and ``<name>:up``, because a tensor-parallel rank holds ``[gate_r; up_r]``: rows
that are not one rectangle of ``[gate; up]`` but are one rectangle of each half.
"""
from __future__ import annotations

import logging
from typing import Dict, List, Optional, Tuple

import numpy as np
from mindspore import Tensor

from ms_llm.checkpoint import dcp

log = logging.getLogger("ms_llm.train")


def _regions(name: str, p, tp_rank: int, tp_size: int) -> List[Tuple[str, tuple, tuple,
                                                                    tuple, int, int]]:
    """(ckpt name, global shape, offsets, sizes, local row start, local row count) per piece of
    this rank's local tensor."""
    local_shape = tuple(p.shape)
    start, length, full_rows = getattr(p, "fsdp_rows", (0, local_shape[0] if local_shape else 0,
                                                        local_shape[0] if local_shape else 0))
    width = getattr(p, "dcp_row_width", None)
    if width:   # stored as rows of ``width``: dim-0 shards stay row blocks of that view
        per_row = int(np.prod(local_shape[1:])) // width
        start, length, full_rows = start * per_row, length * per_row, full_rows * per_row
        local_shape = (int(np.prod(local_shape)) // width, width)
    tp_local = (full_rows,) + local_shape[1:] if local_shape else ()
    tp_dim = getattr(p, "tp_dim", None) if getattr(p, "tensor_model_parallel", False) else None
    if not tp_local:
        return [(name, (), (), (), 0, 0)]
    if tp_dim is None or not getattr(p, "tp_glu", False):
        gshape = list(tp_local)
        off = [0] * len(gshape)
        if tp_dim is not None:
            gshape[tp_dim] *= tp_size
            off[tp_dim] = tp_rank * tp_local[tp_dim]
        off[0] += start
        sizes = [length] + list(tp_local[1:])
        if hasattr(p, "expert_shard"):     # grouped expert weights: one block of rows per ep rank
            ep_rank, ep_size = p.expert_shard
            gshape[0] *= ep_size
            off[0] += ep_rank * tp_local[0]
        return [(name, tuple(gshape), tuple(off), tuple(sizes), 0, length)]
    # Gated fc1 under tp: local rows [0, h) are gate_r, [h, 2h) are up_r.
    half = full_rows // 2
    out = []
    for i, part in enumerate(("gate", "up")):
        lo, hi = max(start, i * half), min(start + length, (i + 1) * half)
        n = max(0, hi - lo)
        gshape = (half * tp_size,) + tuple(tp_local[1:])
        off = (tp_rank * half + (lo - i * half if n else 0),) + (0,) * (len(gshape) - 1)
        out.append((f"{name}:{part}", gshape, off, (n,) + tuple(tp_local[1:]),
                    lo - start if n else 0, n))
    return out


def _glu_split_always(named_params) -> Dict[str, bool]:
    """Gated fc1 tensors are always stored split, also without tp, so layouts interchange."""
    return {n: n.endswith("mlp.linear_fc1.weight") or n.endswith("mlp.linear_fc1.bias")
            for n, _ in named_params}


def _global_name(name: str, p) -> str:
    """Checkpoint name of a parameter: an expert kept under expert parallel is stored under its
    global expert index (``local_experts.{global}``), whatever this rank calls it."""
    if not hasattr(p, "expert_index"):
        return name
    local, glob = p.expert_index
    key = f"local_experts.{local}."
    if key not in name:
        raise ValueError(f"checkpoint: expert parameter {name} has no '{key}' component")
    return name.replace(key, f"local_experts.{glob}.", 1)


def _pieces(named_params, optimizer, pstate, glu: Dict[str, bool]):
    """Per model tensor: its regions, and the AdamW moments of the trainable ones (buffers such
    as the routers' ``expert_bias`` have none)."""
    tp_rank, tp_size = pstate.tp_rank, pstate.sizes.tp
    slot = {id(p): i for i, p in enumerate(optimizer.params)}
    for idx, (name, p) in enumerate(named_params):
        regions = _regions(_global_name(name, p), p, tp_rank, tp_size)
        if glu[name] and len(regions) == 1:          # tp = 1: split [gate; up] too
            n, gshape, off, sizes, _, length = regions[0]
            half = gshape[0] // 2
            regions = []
            for i, part in enumerate(("gate", "up")):
                lo, hi = max(off[0], i * half), min(off[0] + sizes[0], (i + 1) * half)
                k = max(0, hi - lo)
                regions.append((f"{name}:{part}", (half,) + gshape[1:],
                                ((lo - i * half) if k else 0,) + off[1:], (k,) + sizes[1:],
                                (lo - off[0]) if k else 0, k))
        sharded = getattr(p, "fsdp_sharded", False)
        tp_sharded = getattr(p, "tensor_model_parallel", False)
        # Experts differ across the ep ranks and repeat across expert-data-parallel replicas.
        expert = getattr(p, "expert_parallel", False) and pstate.dp_rank < pstate.sizes.ep
        write = (sharded or pstate.dp_rank == 0 or expert) and (tp_sharded or tp_rank == 0) \
            and pstate.cp_rank == 0
        tensors = [("", p)]
        if id(p) in slot:
            tensors += [("optimizer.exp_avg.", optimizer.exp_avg[slot[id(p)]]),
                        ("optimizer.exp_avg_sq.", optimizer.exp_avg_sq[slot[id(p)]])]
        for prefix, tensor in tensors:
            yield idx, prefix, tensor, regions, write


def save(save_dir: str, step: int, model_named, optimizer, pstate, state: dict, barrier,
         rank: int, world: int, keep_last: Optional[int] = None) -> str:
    glu = _glu_split_always(model_named)
    local = {}
    for idx, prefix, tensor, regions, write in _pieces(model_named, optimizer, pstate, glu):
        data = tensor.asnumpy()
        width = getattr(model_named[idx][1], "dcp_row_width", None)
        if width:
            data = data.reshape(-1, width)
        for cname, gshape, off, sizes, lstart, length in regions:
            piece = data[lstart:lstart + length] if data.ndim else data
            local[prefix + cname] = dcp.LocalChunk(piece, gshape, off, write=write)
    state = dict(state, optimizer_step=optimizer.step_count)
    return dcp.save_checkpoint(save_dir, step, local, state, rank=rank, world_size=world,
                               barrier=barrier, keep_last=keep_last,
                               mesh={"tp": pstate.sizes.tp, "dp": pstate.sizes.dp,
                                     "ep": pstate.sizes.ep})


def load(path: str, model_named, optimizer, pstate) -> dict:
    glu = _glu_split_always(model_named)
    wanted, plan = {}, []
    for idx, prefix, tensor, regions, _ in _pieces(model_named, optimizer, pstate, glu):
        for cname, gshape, off, sizes, _, _ in regions:
            wanted[prefix + cname] = dcp.WantedChunk(gshape, off, sizes, np.float32)
        plan.append((tensor, [prefix + r[0] for r in regions]))
    arrays, state = dcp.load_checkpoint(path, wanted)
    for tensor, names in plan:
        data = np.concatenate([arrays[n] for n in names], 0) if len(names) > 1 else arrays[names[0]]
        tensor.set_data(Tensor(np.ascontiguousarray(data).reshape(tensor.shape))
                        .astype(tensor.dtype))
    optimizer.step_count = int(state["optimizer_step"])
    return state
