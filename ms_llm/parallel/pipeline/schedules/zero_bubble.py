"""ZB-H1 (``parallel.schedules_method zbh1``), the zero-bubble schedule of Qi et al., "Zero Bubble
Pipeline Parallelism", ICLR 2024.

The backward is split into ``B`` (the input gradient, which the previous stage waits for) and
``W`` (the weight gradient, which nobody waits for), so ``W`` can fill the slots where 1F1B
idles. ZB-H1 is the paper's handcrafted schedule at 1F1B's peak memory (``pp`` micro-batches'
activations, here counted from F until W releases them): rank ``r`` runs ``pp - r`` warm-up
forwards, then holds its first ``r`` weight gradients back, alternating B and F, then runs
B, W, F until the forwards are done, then B, W and the held-back W's. At unit costs the last rank
never idles after its first forward, and the bubble is ``(p - 1)(F + B - W)`` against 1F1B's
``(p - 1)(F + B + W)``, a third of it (``tests/parallel/test_pipeline_schedules.py`` checks both).
"""
from __future__ import annotations

from .actions import Action
from .rounds import bubble_fraction
from .spec import ScheduleSpec


def zero_bubble_h1_rank(pp: int, rank: int, num_microbatches: int) -> list[Action]:
    """ZB-H1's action list for ``rank`` (one model chunk per rank)."""
    m = num_microbatches
    f = min(pp - rank, m)
    acts = [Action("F", k) for k in range(f)]
    b = w = 0
    for _ in range(rank):              # the last ranks hold their first W's back
        if f >= m:
            break
        acts += [Action("B", b), Action("F", f)]
        b, f = b + 1, f + 1
    while f < m:
        acts += [Action("B", b), Action("W", w), Action("F", f)]
        b, w, f = b + 1, w + 1, f + 1
    while b < m:
        acts += [Action("B", b), Action("W", w)]
        b, w = b + 1, w + 1
    return acts + [Action("W", k) for k in range(w, m)]


def zero_bubble_note(rounds: list, pp: int, m: int) -> str:
    """The simulated bubble at F = B = W beside the paper's and 1F1B's analytic ones."""
    return (f"simulated bubble: {bubble_fraction(rounds):.3f} (F=B=W); ZB-H1's analytic "
            f"(p-1)/(3m+p-1) = {(pp - 1) / (3 * m + pp - 1):.3f}, 1F1B's (p-1)/(m+p-1) = "
            f"{(pp - 1) / (m + pp - 1):.3f}")


SCHEDULE = ScheduleSpec(
    name="zbh1", label="ZB-H1", method="zbh1",
    rank_actions=lambda pp, rank, m, vpp: zero_bubble_h1_rank(pp, rank, m),
    bubble_note=zero_bubble_note, chunks_rule="runs one model chunk per rank",
    splits_backward=True)
