"""Pipeline-parallel schedules as plain data: per-rank lists of forward/backward actions.

The orders follow Megatron-Core's ``forward_backward_pipelining_without_interleaving`` (1F1B) and
``forward_backward_pipelining_with_interleaving`` (virtual pipeline); like
``torch.distributed.pipelining`` a schedule is data, so it can be validated, simulated and printed
without devices. Point-to-point on this backend blocks, so the executor does not follow each
rank's list freely: ``plan_rounds`` replays all ranks in lockstep rounds, a rank running its next
action only once the inputs exist, and after every round all produced outputs are exchanged in one
global order (``transfers_after``). Every receive is then matched by a send of the same round, and
a schedule whose data dependencies form a cycle is rejected before any device waits forever.

Virtual stage ``vs = chunk * pp + rank`` (Megatron): chunk ``c`` of rank ``r`` feeds chunk ``c`` of
rank ``r + 1``, and the last rank's chunk ``c`` feeds rank 0's chunk ``c + 1``. DualPipe-V places
its two chunks per rank in a V instead (``v_shape``): chunk 0 of rank ``r`` is stage ``r``,
chunk 1 is stage ``2 pp - 1 - r``.
"""
from dataclasses import dataclass

from .actions import Action, check_sizes as _check_sizes
from .dualpipe import dualpipe_v
from .zero_bubble import zero_bubble_h1

Transfer = tuple[int, int, str, int, int]  # (src_rank, dst_rank, "act"|"grad", microbatch, dst_chunk)


@dataclass
class Round:
    """A lockstep round for the executor: what each rank runs, then which outputs move where."""
    index: int
    actions: list[Action | None]
    transfers: list[Transfer]


def virtual_stage(rank: int, chunk: int, pp: int, v_shape: bool = False) -> int:
    """Position of (rank, chunk) in the model's layer order: Megatron's interleaving, or with
    ``v_shape`` DualPipe-V's V (two chunks per rank)."""
    if v_shape:
        return rank if chunk == 0 else 2 * pp - 1 - rank
    return chunk * pp + rank


def stage_of(virtual_stage: int, pp: int, v_shape: bool = False) -> tuple[int, int]:
    """(rank, chunk) holding ``virtual_stage``; inverse of ``virtual_stage``."""
    if v_shape:
        return (virtual_stage, 0) if virtual_stage < pp else (2 * pp - 1 - virtual_stage, 1)
    return virtual_stage % pp, virtual_stage // pp


def v_shaped(method: str | None) -> bool:
    """Whether ``parallel.schedules_method`` places its chunks in a V (DualPipe-V)."""
    return method == "dualpipev"


def _one_f_one_b_order(forwards: list[Action], backwards: list[Action],
                       warmup: int) -> list[Action]:
    """Warmup forwards, then strictly alternating F/B, then the remaining backwards.

    Alternating caps the activations a rank holds at ``warmup + 1`` microbatches, which is
    the point of 1F1B over GPipe (all F then all B holds every microbatch)."""
    total = len(forwards)
    out = list(forwards[:warmup])
    for k in range(total - warmup):
        out += [forwards[warmup + k], backwards[k]]
    return out + backwards[total - warmup:]


def one_f_one_b(pp: int, rank: int, num_microbatches: int) -> list[Action]:
    """Megatron's non-interleaved 1F1B for ``rank``: ``min(pp - rank - 1, m)`` warmup forwards."""
    _check_sizes(pp, num_microbatches)
    warmup = min(pp - rank - 1, num_microbatches)
    fwd = [Action("F", mb) for mb in range(num_microbatches)]
    bwd = [Action("B", mb) for mb in range(num_microbatches)]
    return _one_f_one_b_order(fwd, bwd, warmup)


def _interleaved_table(pp: int, num_microbatches: int, vpp: int) -> list[tuple[int, int]]:
    """(microbatch, chunk) in forward order for ``num_microbatches % pp == 0``: each group of
    ``pp`` microbatches runs through every chunk before the next group starts. ``pp`` is the
    smallest group for which rank 0 never waits: microbatch ``g``'s chunk-``c`` output needs
    ``pp`` steps to come round the ring, exactly the time rank 0 spends on the group's chunk ``c``."""
    table = []
    for start in range(0, num_microbatches, pp):
        table += [(mb, chunk) for chunk in range(vpp) for mb in range(start, start + pp)]
    return table


def _megatron_interleaved(pp: int, rank: int, num_microbatches: int, vpp: int) -> list[Action]:
    """Megatron's order when ``pp`` divides the microbatch count. Warmup is
    ``2 * (pp - rank - 1) + (vpp - 1) * pp`` forwards (all of them when ``m == pp``): enough
    for the last rank to reach chunk ``vpp - 1`` of microbatch 0, so backwards can start.
    Backwards walk the same table with chunks reversed."""
    table = _interleaved_table(pp, num_microbatches, vpp)
    total = len(table)
    if num_microbatches == pp:
        warmup = total
    else:
        warmup = min(2 * (pp - rank - 1) + (vpp - 1) * pp, total)
    fwd = [Action("F", mb, chunk) for mb, chunk in table]
    bwd = [Action("B", mb, vpp - 1 - chunk) for mb, chunk in table]
    return _one_f_one_b_order(fwd, bwd, warmup)


def interleaved_1f1b(pp: int, rank: int, num_microbatches: int, vpp: int) -> list[Action]:
    """Megatron's interleaved (virtual pipeline) 1F1B for ``rank`` with ``vpp`` chunks per rank.

    When ``pp`` does not divide ``m``, the schedule for the next multiple of ``pp`` is built and
    the phantom microbatches' actions are dropped. Dropping actions only contracts edges of an
    acyclic dependency graph, so the result cannot deadlock; a short last group kept in the
    1F1B order (Megatron's table) can form a cycle, e.g. pp=4, m=5, vpp=3."""
    _check_sizes(pp, num_microbatches, vpp)
    if num_microbatches < pp:
        raise ValueError(
            f"interleaved pipeline schedule needs at least parallel.pipeline_model_parallel_size "
            f"({pp}) microbatches, got {num_microbatches} (training.global_batch_size / "
            f"(training.micro_batch_size x data-parallel size))")
    padded = -(-num_microbatches // pp) * pp
    return [a for a in _megatron_interleaved(pp, rank, padded, vpp)
            if a.microbatch < num_microbatches]


def gpipe(pp: int, rank: int, num_microbatches: int) -> list[Action]:
    """GPipe with backwards in reverse micro-batch order: all forwards, then all backwards,
    last micro-batch first. Its bubble equals 1F1B's ((p-1)/(m+p-1)); it holds every
    micro-batch's activations (1F1B: ``pp - rank``), and its backwards run last-in first-out,
    the only order MindSpore 2.10 can run pending backward closures in (``kept_backwards``)."""
    _check_sizes(pp, num_microbatches)
    return [Action("F", mb) for mb in range(num_microbatches)] + \
        [Action("B", mb) for mb in reversed(range(num_microbatches))]


def build_schedule(pp: int, num_microbatches: int, vpp: int = 1,
                   method: str | None = None) -> list[list[Action]]:
    """Action lists for every rank. ``method`` (``parallel.schedules_method``): None for
    Megatron's 1F1B (``vpp == 1``) or interleaved 1F1B, ``gpipe``, ``zbh1`` (zero bubble), or
    ``dualpipev`` (two chunks per rank in a V: ``vpp`` must be 2)."""
    if method not in SCHEDULE_METHODS:
        raise ValueError(f"parallel.schedules_method {method!r} is unknown; choose one of "
                         f"{', '.join(str(m) for m in SCHEDULE_METHODS)}")
    if method == "dualpipev":
        if vpp != 2:
            raise ValueError(f"parallel.schedules_method dualpipev runs two model chunks per "
                             f"rank in a V: set parallel.virtual_pipeline_model_parallel_size "
                             f"2 (got {vpp})")
        return dualpipe_v(pp, num_microbatches)
    if method is not None and vpp != 1:
        raise ValueError(f"parallel.schedules_method {method} runs one model chunk per rank: "
                         f"set parallel.virtual_pipeline_model_parallel_size 1 (got {vpp})")
    if method == "gpipe":
        return [gpipe(pp, r, num_microbatches) for r in range(pp)]
    if method == "zbh1":
        return zero_bubble_h1(pp, num_microbatches)
    if vpp == 1:
        return [one_f_one_b(pp, r, num_microbatches) for r in range(pp)]
    return [interleaved_1f1b(pp, r, num_microbatches, vpp) for r in range(pp)]


# None: Megatron's default (1F1B, interleaved with vpp > 1); the others by the names of the
# zero-bubble paper (ZB-H1), torch.distributed.pipelining (GPipe) and MindSpeed (dualpipev).
SCHEDULE_METHODS = (None, "gpipe", "zbh1", "dualpipev")


def kept_backwards(actions: list[Action]) -> set[tuple[int, int]]:
    """(microbatch, chunk) pairs whose backward closure can stay alive from F to B on one rank.

    MindSpore 2.10 PyNative holds pending ``mindspore.vjp`` closures on a stack: only the most
    recent may run ("Can not find top cell for backward" otherwise, ``tests/test_deferred_vjp``).
    So the kept F..B spans of a rank must nest (never cross); the others keep their input and
    re-run the forward for B. Spans are taken greedily from the latest F backwards, which keeps
    as many as taking them by earliest B (the same greedy in reversed time; optimal when
    backwards follow forwards' order, as in 1F1B) but leaves the re-runs to the earliest
    micro-batches: a rank's first B waits for the stages after it, and the executor re-runs
    the forward during that wait (``DeferredVJP.prepare``), while a re-run at the end of the
    step delays the step. GPipe's reversed backwards nest entirely and keep all."""
    start: dict[tuple[int, int], int] = {}
    spans = []
    for i, a in enumerate(actions):
        if a.kind == "F":
            start[(a.microbatch, a.chunk)] = i
        elif a.kind == "B":
            key = (a.microbatch, a.chunk)
            spans.append((start[key], i, key))
    kept: list[tuple[int, int]] = []
    out = set()
    for s, e, key in sorted(spans, reverse=True):     # latest F first
        if all(not (s0 < s < e0 < e or s < s0 < e < e0) for s0, e0 in kept):
            kept.append((s, e))
            out.add(key)
    return out


def validate_schedule(schedule: list[list[Action]], pp: int, vpp: int = 1) -> int:
    """Check every (microbatch, chunk) has one F then one B on each rank; return the microbatch
    count. Catches hand-edited schedules before they are simulated or run."""
    if len(schedule) != pp:
        raise ValueError(f"pipeline schedule has {len(schedule)} ranks, expected pp={pp}")
    num_mb = 1 + max((a.microbatch for acts in schedule for a in acts), default=-1)
    kinds = "FBW" if any(a.kind == "W" for acts in schedule for a in acts) else "FB"
    expected = {(k, mb, c) for k in kinds for mb in range(num_mb) for c in range(vpp)}
    for rank, actions in enumerate(schedule):
        seen: set[tuple[str, int, int]] = set()
        for a in actions:
            key = (a.kind, a.microbatch, a.chunk)
            if key not in expected or key in seen:
                raise ValueError(f"pipeline schedule rank {rank}: unexpected or repeated action {a}")
            if a.kind == "B" and ("F", a.microbatch, a.chunk) not in seen:
                raise ValueError(f"pipeline schedule rank {rank}: {a} comes before its forward")
            if a.kind == "W" and ("B", a.microbatch, a.chunk) not in seen:
                raise ValueError(f"pipeline schedule rank {rank}: {a} comes before its backward")
            seen.add(key)
        if seen != expected:
            missing = " ".join(str(Action(*k)) for k in sorted(expected - seen))
            raise ValueError(f"pipeline schedule rank {rank} is missing {missing}")
    return num_mb


def _needs(action: Action, rank: int, pp: int, nvs: int,
           v_shape: bool = False) -> list[tuple[str, int, int]]:
    """(kind, microbatch, virtual stage) that must be finished in an earlier round."""
    vs = virtual_stage(rank, action.chunk, pp, v_shape)
    mb = action.microbatch
    if action.kind == "W":      # the same rank's B of the micro-batch
        return [("B", mb, vs)]
    if action.kind == "F":
        return [("F", mb, vs - 1)] if vs > 0 else []
    need = [("F", mb, vs)]
    return need + [("B", mb, vs + 1)] if vs < nvs - 1 else need


def _check_cost(cost: dict | None) -> dict:
    """Action times: 'F' and 'B' (B is the whole backward), and 'W' for zero-bubble schedules
    (then 'B' is the input-gradient part only); default 1 each."""
    cost = {"F": 1.0, "B": 1.0, "W": 1.0} if cost is None else dict(cost)
    if not {"F", "B"} <= set(cost) <= {"F", "B", "W"} or min(cost.values()) <= 0:
        raise ValueError(f"pipeline cost must give positive 'F', 'B' (and 'W') times, got {cost}")
    cost.setdefault("W", 1.0)
    return cost


def plan_rounds(schedule: list[list[Action]], pp: int, vpp: int = 1,
                cost: dict | None = None, v_shape: bool = False) -> list[list[Action | None]]:
    """Lockstep rounds: per round, the action each rank runs (None = idle).

    A rank runs its next action as soon as its inputs were produced in an earlier round; ranks
    never reorder. Greedy is right here because waiting cannot unblock anyone else. ``cost`` only
    feeds ``bubble_fraction``; it is checked here so one dict can be passed to both."""
    _check_cost(cost)
    validate_schedule(schedule, pp, vpp)
    nvs = pp * vpp
    done: set[tuple[str, int, int]] = set()
    pos = [0] * pp
    rounds: list[list[Action | None]] = []
    while any(pos[r] < len(schedule[r]) for r in range(pp)):
        row: list[Action | None] = []
        for r in range(pp):
            a = schedule[r][pos[r]] if pos[r] < len(schedule[r]) else None
            ok = a is not None and all(n in done for n in _needs(a, r, pp, nvs, v_shape))
            row.append(a if ok else None)
        if all(a is None for a in row):
            raise ValueError(f"pipeline schedule deadlocks at round {len(rounds)}: "
                             + _stuck(schedule, pos, pp, nvs, done, v_shape))
        for r, a in enumerate(row):
            if a is not None:
                done.add((a.kind, a.microbatch, virtual_stage(r, a.chunk, pp, v_shape)))
                pos[r] += 1
        rounds.append(row)
    return rounds


def _stuck(schedule: list[list[Action]], pos: list[int], pp: int, nvs: int,
           done: set[tuple[str, int, int]], v_shape: bool = False) -> str:
    """One-line account of what every waiting rank is blocked on."""
    parts = []
    for r in range(pp):
        if pos[r] < len(schedule[r]):
            a = schedule[r][pos[r]]
            waits = []
            for kind, mb, vs in _needs(a, r, pp, nvs, v_shape):
                if (kind, mb, vs) not in done:
                    src, chunk = stage_of(vs, pp, v_shape)
                    waits.append(f"{kind}{mb}.{chunk} on rank {src}")
            parts.append(f"rank {r} {a} waits for {', '.join(waits)}")
    return "; ".join(parts)


def transfers_after(round_actions: list[Action | None], pp: int, vpp: int,
                    num_virtual_stages: int, v_shape: bool = False) -> list[Transfer]:
    """Outputs produced in one round and where they go, in one order shared by all ranks.

    Walking this list in order (send if src, recv if dst) cannot deadlock with blocking p2p:
    the earliest unfinished transfer has both ends waiting on it. Self-transfers (pp == 1 with
    vpp > 1; DualPipe-V's turn at the last rank) are listed so the executor hands the tensor
    over locally."""
    out: list[Transfer] = []
    for rank, a in enumerate(round_actions):
        if a is None:
            continue
        vs = virtual_stage(rank, a.chunk, pp, v_shape)
        if a.kind == "F" and vs < num_virtual_stages - 1:
            dst, chunk = stage_of(vs + 1, pp, v_shape)
            out.append((rank, dst, "act", a.microbatch, chunk))
        elif a.kind == "B" and vs > 0:
            dst, chunk = stage_of(vs - 1, pp, v_shape)
            out.append((rank, dst, "grad", a.microbatch, chunk))
    return out


def describe_rounds(rounds: list[list[Action | None]], pp: int, vpp: int = 1,
                    v_shape: bool = False) -> list[Round]:
    """``plan_rounds`` output with each round's transfers attached: the executor's whole script."""
    return [Round(i, row, transfers_after(row, pp, vpp, pp * vpp, v_shape))
            for i, row in enumerate(rounds)]


def bubble_fraction(rounds: list[list[Action | None]], cost: dict | None = None) -> float:
    """Idle share of the simulated timeline (ranks x time).

    A round lasts as long as its slowest action, so with unequal F/B costs a rank running F next
    to a rank running B idles for the difference. That treats rounds as barriers, a pessimistic
    model: the exchange after a round only couples the ranks that trade tensors."""
    cost = _check_cost(cost)
    if not rounds:
        return 0.0
    span = sum(max((cost[a.kind] for a in row if a is not None), default=0.0) for row in rounds)
    busy = sum(cost[a.kind] for row in rounds for a in row if a is not None)
    return 1.0 - busy / (len(rounds[0]) * span)


def format_schedule(schedule: list[list[Action]],
                    rounds: list[list[Action | None]] | None = None) -> str:
    """Table with one row per rank: one column per round if ``rounds`` is given ('.' = idle),
    else one column per action index."""
    if rounds is not None:
        rows = [[str(row[r]) if row[r] is not None else "." for row in rounds]
                for r in range(len(schedule))]
    else:
        rows = [[str(a) for a in actions] for actions in schedule]
    width = max((len(cell) for row in rows for cell in row), default=1)
    return "\n".join(f"rank {r}: " + " ".join(cell.rjust(width) for cell in row)
                     for r, row in enumerate(rows))
