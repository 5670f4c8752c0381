"""Apply ``fully_shard`` to a GPTModel from the config: units chosen by glob, children first."""
from __future__ import annotations

import fnmatch
from typing import List, Optional, Sequence, Tuple

from ms_llm.models.gpt import GPTModel
from .fully_shard import FSDPModule, MixedPrecisionPolicy, fully_shard

DEFAULT_UNITS = ("decoder.layers.*", "embedding", "output_layer")


def fsdp_group(pstate, fsdp_size: int) -> Tuple[object, str]:
    """The group FSDP shards over and its mesh dim: Megatron's data-parallel-with-context-
    parallel group (``dp_cp``; ``dp`` when cp = 1). A cp rank holds the same weights as its
    peers for other tokens, so it is one more replica: sharding over dp x cp makes each shard
    1/(dp*cp) of the parameter and the reduce-scatter sums the gradient over every replica at
    once (no separate cp all-reduce). ``parallel.fsdp_size`` is the size of that group."""
    dim = "dp_cp" if pstate.sizes.cp > 1 else "dp"
    group = pstate.group(dim)
    if fsdp_size != group.size:
        raise ValueError(f"parallel.fsdp_size ({fsdp_size}) must equal data parallel x context "
                         f"parallel ({group.size} = {pstate.sizes.dp} x {pstate.sizes.cp}; "
                         f"workers / (tensor x pipeline parallel)): FSDP shards over that "
                         f"group; hybrid sharding is not supported")
    return group, dim


def _match(name: str, pattern: str) -> bool:
    """Glob per dotted component: ``decoder.layers.*`` is each layer, not their submodules."""
    a, b = name.split("."), pattern.split(".")
    return len(a) == len(b) and all(fnmatch.fnmatchcase(x, y) for x, y in zip(a, b))


def apply_fsdp(model: GPTModel, group, *, modules: Sequence[str] = DEFAULT_UNITS,
               reshard_after_forward: bool = True, prefetch: int = 1,
               ignored_params: Sequence = (),
               mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
               tied: Optional[bool] = None, strict: bool = True,
               mesh_dim: str = "dp") -> List[FSDPModule]:
    """Shard ``model`` over ``group``. Each module whose name matches a glob in ``modules``
    becomes a unit; the root holds the rest. With tied embeddings the embedding stays in the
    root, because the output head reads its weight again after the embedding's forward.
    ``ignored_params`` stay whole and local (e.g. expert weights, sharded over expert parallel
    instead and reduced over the expert-data-parallel group by the caller).

    As torchtitan does, the last unit in forward order keeps its gathered weights after forward
    (its backward comes first, so resharding would only gather it again at once), and the root
    prefetches the first units' all-gathers.

    ``model`` may be a pipeline chunk: ``tied`` says whether its output head reads the
    embedding's weight (default: a model without ``output_layer``), and ``strict=False`` lets a
    pattern match nothing in it (the chunk may hold no embedding or head). ``mesh_dim``: the
    group's name in the shards' placements (``dp``, or ``dp_cp`` under context parallel)."""
    if group.size == 1:
        return []
    tied = model.output_layer is None if tied is None else tied
    names = [n for n, _ in model.cells_and_names() if n]
    chosen = []
    for pattern in modules:
        hits = [n for n in names if _match(n, pattern)
                and not (tied and n == "embedding")]
        if strict and not hits and not (tied and pattern in ("embedding", "output_layer")):
            raise ValueError(f"parallel.fsdp_modules: pattern {pattern!r} matches no module")
        chosen += [n for n in hits if n not in chosen]
    cells = dict(model.cells_and_names())
    ordered = [n for n in names if n in chosen]            # forward order
    for n in sorted(ordered, key=lambda n: -n.count(".")):  # children before parents
        fully_shard(cells[n], group, reshard_after_forward=reshard_after_forward
                    and n != ordered[-1], mp_policy=mp_policy, ignored_params=ignored_params,
                    mesh_dim=mesh_dim)
    units = [cells[n] for n in ordered]
    for i, unit in enumerate(units):
        unit.set_modules_to_forward_prefetch(units[i + 1:i + 1 + prefetch])
        unit.set_modules_to_backward_prefetch(units[max(0, i - prefetch):i][::-1])
    fully_shard(model, group, reshard_after_forward=False, mp_policy=mp_policy,
                ignored_params=ignored_params, mesh_dim=mesh_dim)
    model.set_modules_to_forward_prefetch(units[:prefetch])
    return units
