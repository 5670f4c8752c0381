"""The unit a pipeline schedule is made of, shared by every schedule builder (``schedules``,
``zero_bubble``) so that those modules do not import each other."""
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
