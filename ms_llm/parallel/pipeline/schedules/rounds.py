"""Any pipeline schedule replayed in lockstep rounds: what the executor runs, and the simulator.

Like ``torch.distributed.pipelining`` a schedule is data (per rank, a list of ``Action``), so it
can be validated, simulated and printed without devices. Point-to-point on this backend blocks,
so the executor does not follow each rank's list freely: ``plan_rounds`` replays all ranks in
lockstep rounds, a rank running its next action only once the inputs exist, and after every round
all produced outputs are exchanged in one global order (``transfers_after``). Every receive is
then matched by a send of the same round, and a schedule whose data dependencies form a cycle is
rejected before any device waits forever. Which rank and chunk hold a virtual stage is the
schedule's ``placement`` (``placement.ROUND_ROBIN`` unless given).
"""
from dataclasses import dataclass

from .actions import Action
from .placement import ROUND_ROBIN, StagePlacement

Transfer = tuple[int, int, str, int, int]  # (src_rank, dst_rank, "act"|"grad", microbatch, dst_chunk)


@dataclass
class Round:
    """A lockstep round for the executor: what each rank runs, then which outputs move where."""
    index: int
    actions: list[Action | None]
    transfers: list[Transfer]


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
           placement: StagePlacement) -> list[tuple[str, int, int]]:
    """(kind, microbatch, virtual stage) that must be finished in an earlier round."""
    vs = placement.virtual_stage(rank, action.chunk, pp)
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
                cost: dict | None = None,
                placement: StagePlacement = ROUND_ROBIN) -> list[list[Action | None]]:
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
            ok = a is not None and all(n in done for n in _needs(a, r, pp, nvs, placement))
            row.append(a if ok else None)
        if all(a is None for a in row):
            raise ValueError(f"pipeline schedule deadlocks at round {len(rounds)}: "
                             + _stuck(schedule, pos, pp, nvs, done, placement))
        for r, a in enumerate(row):
            if a is not None:
                done.add((a.kind, a.microbatch, placement.virtual_stage(r, a.chunk, pp)))
                pos[r] += 1
        rounds.append(row)
    return rounds


def _stuck(schedule: list[list[Action]], pos: list[int], pp: int, nvs: int,
           done: set[tuple[str, int, int]], placement: StagePlacement) -> str:
    """One-line account of what every waiting rank is blocked on."""
    parts = []
    for r in range(pp):
        if pos[r] < len(schedule[r]):
            a = schedule[r][pos[r]]
            waits = []
            for kind, mb, vs in _needs(a, r, pp, nvs, placement):
                if (kind, mb, vs) not in done:
                    src, chunk = placement.stage_of(vs, pp)
                    waits.append(f"{kind}{mb}.{chunk} on rank {src}")
            parts.append(f"rank {r} {a} waits for {', '.join(waits)}")
    return "; ".join(parts)


def transfers_after(round_actions: list[Action | None], pp: int, vpp: int,
                    num_virtual_stages: int,
                    placement: StagePlacement = ROUND_ROBIN) -> list[Transfer]:
    """Outputs produced in one round and where they go, in one order shared by all ranks.

    Walking this list in order (send if src, recv if dst) cannot deadlock with blocking p2p:
    the earliest unfinished transfer has both ends waiting on it. Self-transfers (pp == 1 with
    vpp > 1; a V placement's turn at the last rank) are listed so the executor hands the tensor
    over locally."""
    out: list[Transfer] = []
    for rank, a in enumerate(round_actions):
        if a is None:
            continue
        vs = placement.virtual_stage(rank, a.chunk, pp)
        if a.kind == "F" and vs < num_virtual_stages - 1:
            dst, chunk = placement.stage_of(vs + 1, pp)
            out.append((rank, dst, "act", a.microbatch, chunk))
        elif a.kind == "B" and vs > 0:
            dst, chunk = placement.stage_of(vs - 1, pp)
            out.append((rank, dst, "grad", a.microbatch, chunk))
    return out


def describe_rounds(rounds: list[list[Action | None]], pp: int, vpp: int = 1,
                    placement: StagePlacement = ROUND_ROBIN) -> list[Round]:
    """``plan_rounds`` output with each round's transfers attached: the executor's whole script."""
    return [Round(i, row, transfers_after(row, pp, vpp, pp * vpp, placement))
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
