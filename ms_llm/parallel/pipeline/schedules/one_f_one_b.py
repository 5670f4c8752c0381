"""1F1B: Megatron-Core's ``forward_backward_pipelining_without_interleaving``, the default
schedule (``parallel.schedules_method`` unset, one model chunk per rank).

Rank ``r`` runs ``min(pp - r - 1, m)`` warm-up forwards, then alternates one forward and one
backward, then drains the remaining backwards. Alternating caps the activations a rank holds at
``pp - r`` micro-batches (GPipe holds all ``m``) at the same bubble, ``(p-1)/(m+p-1)``.
"""
from __future__ import annotations

from .actions import Action
from .rounds import bubble_fraction
from .spec import ScheduleSpec


def one_f_one_b_order(forwards: list[Action], backwards: list[Action],
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
    warmup = min(pp - rank - 1, num_microbatches)
    fwd = [Action("F", mb) for mb in range(num_microbatches)]
    bwd = [Action("B", mb) for mb in range(num_microbatches)]
    return one_f_one_b_order(fwd, bwd, warmup)


def one_f_one_b_note(rounds: list, pp: int, m: int) -> str:
    """The simulated bubble at B = F and B = 2 F beside 1F1B's analytic one: the line
    ``ms-llm schedule`` prints for the schedules without a B/W split."""
    return (f"simulated bubble: {bubble_fraction(rounds):.3f} (F=B), "
            f"{bubble_fraction(rounds, {'F': 1, 'B': 2}):.3f} (B=2F); 1F1B's analytic "
            f"(p-1)/(m+p-1) = {(pp - 1) / (m + pp - 1):.3f}")


SCHEDULE = ScheduleSpec(
    name="1f1b", label="1F1B", method=None,
    rank_actions=lambda pp, rank, m, vpp: one_f_one_b(pp, rank, m),
    bubble_note=one_f_one_b_note, chunks_rule="runs one model chunk per rank")
