"""The unit a pipeline schedule is made of (``Action``), shared by every schedule file, and what
one rank's action list implies for MindSpore's pending backward closures (``kept_backwards``)."""
from dataclasses import dataclass


@dataclass(frozen=True)
class Action:
    """One step on one rank: forward ("F"), backward ("B") or, in zero-bubble schedules, the
    deferred weight gradient ("W", after its "B", which then gives the input gradient only) of
    ``microbatch`` through ``chunk``."""
    kind: str
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}.{self.chunk}"


def check_sizes(pp: int, num_microbatches: int, vpp: int = 1) -> None:
    """Refuse a schedule with no stage, chunk or micro-batch before building it."""
    if pp < 1 or vpp < 1 or num_microbatches < 1:
        raise ValueError(f"pipeline schedule needs pp >= 1, vpp >= 1 and at least one microbatch "
                         f"(got pp={pp}, vpp={vpp}, microbatches={num_microbatches})")


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
