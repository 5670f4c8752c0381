"""DualPipe-V (DeepSeek's "DualPipeV", ``parallel.schedules_method dualpipev``; MindSpeed's
``--schedules-method dualpipev`` sets it and two chunks per rank) as data.

The model is cut into ``2 * pp`` stages placed in a V: rank ``r`` holds stage ``r`` (chunk 0,
on the way down) and stage ``2 * pp - 1 - r`` (chunk 1, on the way back), so rank 0 holds both
the embedding and the loss, and the last rank hands its chunk-0 output to its own chunk 1 without
a transfer (``placement.V_SHAPE``).

Each rank runs eight phases (``pp`` ranks, ``m >= 2 * pp`` micro-batches, rank ``r``):

1. ``2 (pp - r - 1)`` chunk-0 forwards (warm-up);
2. ``r + 1`` pairs of a chunk-0 and a chunk-1 forward;
3. ``pp - r - 1`` times: a chunk-1 input-gradient backward, a deferred weight gradient, a chunk-1
   forward (zero bubble);
4. ``m - 2 pp + r + 1`` times the steady state: F chunk 0, B chunk 1, F chunk 1, B chunk 0 (DualPipe
   runs each F/B pair overlapped, the forward's communication hidden behind the backward's
   compute; here the pair runs back to back);
5. ``pp - r - 1`` times: B chunk 1, F chunk 1, B chunk 0;
6. ``r + 1`` pairs of a chunk-1 and a chunk-0 backward, the second half of them input-gradient
   only;
7. ``pp - r - 1`` times: a deferred weight gradient, then a chunk-0 input-gradient backward;
8. ``r + 1`` deferred weight gradients.

Every backward is ``B`` (input and bias/norm gradients) then ``W`` (the linears' weight
gradients, ``weight_grad``): a full backward is ``B`` directly followed by its ``W``; a
zero-bubble one queues its ``W``, and the queued ``W`` run first-in first-out, as DualPipe's
``WeightGradStore`` does. The phase counts and the place where phase 6 switches to deferring
follow DeepSeek's reference (``dualpipev.py``), written afresh as action lists.
"""
from __future__ import annotations

from collections import deque

from .actions import Action
from .placement import V_SHAPE
from .rounds import bubble_fraction, plan_rounds
from .spec import ScheduleSpec
from .zero_bubble import SCHEDULE as ZB_H1


def dualpipe_v_rank(pp: int, rank: int, num_microbatches: int) -> list[Action]:
    """DualPipe-V's action list for ``rank`` (two chunks per rank, the V placement;
    ``num_microbatches >= 2 pp``, which ``SCHEDULE.build`` checks)."""
    m = num_microbatches
    acts: list[Action] = []
    fwd, bwd = [0, 0], [0, 0]          # next micro-batch per chunk
    queued: deque = deque()            # deferred W's, first in first out

    def f(chunk: int) -> None:
        acts.append(Action("F", fwd[chunk], chunk))
        fwd[chunk] += 1

    def b(chunk: int, defer: bool) -> None:
        mb = bwd[chunk]
        bwd[chunk] += 1
        acts.append(Action("B", mb, chunk))
        if defer:
            queued.append(Action("W", mb, chunk))
        else:
            acts.append(Action("W", mb, chunk))

    def w() -> None:
        acts.append(queued.popleft())

    down, up = pp - rank - 1, rank + 1
    for _ in range(2 * down):                    # 1
        f(0)
    for _ in range(up):                          # 2
        f(0)
        f(1)
    for _ in range(down):                        # 3
        b(1, defer=True)
        w()
        f(1)
    for _ in range(m - 2 * pp + rank + 1):       # 4
        f(0)
        b(1, defer=False)
        f(1)
        b(0, defer=False)
    for _ in range(down):                        # 5
        b(1, defer=False)
        f(1)
        b(0, defer=False)
    defer = False
    for i in range(up):                          # 6
        if i == up // 2 and rank % 2 == 1:
            defer = True
        b(1, defer)
        if i == up // 2 and rank % 2 == 0:
            defer = True
        b(0, defer)
    for _ in range(down):                        # 7
        w()
        b(0, defer=True)
    for _ in range(up):                          # 8
        w()
    if queued or fwd != [m, m] or bwd != [m, m]:
        raise AssertionError(f"dualpipev rank {rank}: {len(queued)} W left, forwards {fwd}, "
                             f"backwards {bwd} of {m}")
    return acts


def dualpipe_v_note(rounds: list, pp: int, m: int) -> str:
    """The simulated bubble beside ZB-H1's on the same ranks (each of its actions a whole stage:
    two chunks)."""
    zb = bubble_fraction(plan_rounds(ZB_H1.build(pp, m, 1), pp))
    return (f"simulated bubble: {bubble_fraction(rounds):.3f} (F=B=W per chunk, stages in a "
            f"V: rank 0 holds the first and the last); ZB-H1 on the same ranks: {zb:.3f}")


SCHEDULE = ScheduleSpec(
    name="dualpipev", label="DualPipe-V", method="dualpipev",
    rank_actions=lambda pp, rank, m, vpp: dualpipe_v_rank(pp, rank, m),
    bubble_note=dualpipe_v_note, chunks_rule="runs two model chunks per rank in a V",
    min_chunks=2, max_chunks=2, placement=V_SHAPE, splits_backward=True,
    microbatches_per_rank=2, mindspeed=True)
