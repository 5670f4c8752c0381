"""The distributed optimizer's legacy file (``--ckpt-format torch --use-distributed-optimizer``):
``iter_N/mp_rank_*/distrib_optim.pt`` beside ``model_optim_rng.pt``, read for resume.

Megatron-Core's ``DistributedOptimizer.save_parameter_state`` (0.16) writes, per model-parallel
rank, ``{"buckets_coalesced": True, gbuf_idx: {dtype: {"param", "exp_avg", "exp_avg_sq":
flat fp32, "numel_unpadded": n}}}``: each grad buffer's state gathered over data parallel, the
padding at bucket ends dropped, the padding before each parameter kept. Nothing in the file
says where a parameter lies, so the layout is rebuilt as ``_ParamAndGradBuffer`` builds it:
parameters in reverse ``named_parameters`` order, each start padded to 64 elements from its
bucket's start, a bucket closing once it holds ``bucket_size`` elements (Megatron-LM's
``--ddp-bucket-size``, default ``max(40M, 1M * dp)``, only under ``--overlap-grad-reduce``;
read from the checkpoint's ``args``). The rebuilt layout must end exactly at ``numel_unpadded``,
else the file is refused in one line. Adam's step is in ``model_optim_rng.pt``'s optimizer
param groups. The older per-bucket format (no ``buckets_coalesced``), several grad buffers
(expert parameters) and several chained optimizers are refused.
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Tuple

import numpy as np

from ..torch_dist.distopt import _LOCAL, _TE, STATES, named_order
from ..torch_dist.model import MOMENTS
from ..torch_pickle.reader import load as load_torch_file

DISTRIB = "distrib_optim.pt"


def bucket_size(args) -> Optional[int]:
    """The grad buffer's bucket size Megatron-LM used (None: one bucket per buffer)."""
    if args is None or not getattr(args, "overlap_grad_reduce", False):
        return None
    size = getattr(args, "ddp_bucket_size", None)
    return int(size) if size else max(40_000_000, 1_000_000 *
                                      int(getattr(args, "data_parallel_size", 1) or 1))


def flat_layout(names: List[str], numels: Dict[str, int], bucket: Optional[int]
                ) -> Tuple[Dict[str, int], int]:
    """``({name: start}, total)`` of ``names`` (buffer order) in the coalesced flat state."""
    starts, pos, bucket_start = {}, 0, 0
    for name in names:
        start = bucket_start + -(-(pos - bucket_start) // 64) * 64
        starts[name] = start
        pos = start + numels[name]
        if bucket is not None and pos - bucket_start >= bucket:
            bucket_start = pos           # its end padding is not in the file
    return starts, pos


def read_distrib_optim(folder: str, model: Dict[str, np.ndarray], args, optimizer: dict
                       ) -> Tuple[Dict[str, np.ndarray], Dict[str, dict], np.ndarray]:
    """One rank's ``(fp32 params, {moment: {name: array}}, step)`` from ``folder``'s
    ``distrib_optim.pt``; ``model`` is that rank's ``model`` entry (names and shapes),
    ``optimizer`` its ``model_optim_rng.pt`` optimizer entry (the step)."""
    path = os.path.join(folder, DISTRIB)
    sd = load_torch_file(path)
    if isinstance(sd, list):
        raise ValueError(f"{path}: the states of {len(sd)} chained optimizers (expert or "
                         f"decoupled parameters) are not built")
    if not isinstance(sd, dict) or not sd.get("buckets_coalesced"):
        raise ValueError(f"{path}: the per-bucket distrib_optim.pt of megatron-core before "
                         f"0.10 (no buckets_coalesced) is not built")
    buffers = [v for k, v in sd.items() if k != "buckets_coalesced"]
    if len(buffers) != 1 or len(buffers[0]) != 1:
        raise ValueError(f"{path}: {len(buffers)} grad buffers: only one (dense models, one "
                         f"parameter dtype) is built")
    flat = next(iter(buffers[0].values()))
    missing = [k for k in (*STATES, "numel_unpadded") if k not in flat]
    if missing:
        raise ValueError(f"{path}: no {missing[0]} in the grad buffer's state")
    total = int(flat["numel_unpadded"])
    numels = {k: int(v.size) for k, v in model.items()}
    starts = None
    for layer_order in (_LOCAL, _TE):
        got, end = flat_layout(named_order(model, layer_order)[::-1], numels, bucket_size(args))
        if end == total:
            starts = got
            break
    if starts is None:
        raise ValueError(f"{path}: holds {total} elements per state; megatron-core's buffer "
                         f"layout of this rank's parameters (bucket size "
                         f"{bucket_size(args)}) does not end there")
    params = {n: np.asarray(flat["param"][s:s + numels[n]], np.float32).reshape(model[n].shape)
              for n, s in starts.items()}
    moments = {m: {n: np.asarray(flat[m][s:s + numels[n]], np.float32).reshape(model[n].shape)
                   for n, s in starts.items()} for m in MOMENTS}
    inner = optimizer.get("optimizer", optimizer) if isinstance(optimizer, dict) else {}
    steps = {float(g["step"]) for g in inner.get("param_groups", []) if "step" in g}
    if len(steps) != 1:
        raise ValueError(f"{os.path.join(folder, 'model_optim_rng.pt')}: the distributed "
                         f"optimizer's param groups hold steps {sorted(steps)}, want one")
    return params, moments, np.array(steps.pop(), np.float32)
