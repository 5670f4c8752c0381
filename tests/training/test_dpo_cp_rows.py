"""DPO's per-row log-probabilities from context-parallel pieces, in one process.

Under cp each rank holds two chunks of every row; ``sequence_logps`` must add the pieces'
log-prob sums, and for ``ipo`` (a per-token mean) their token counts, before dividing. Here
the two "ranks" are the pieces of ``split_sequence`` and the pieces object returns the other
piece's partial sums added, as the cp all-reduce does; the reference is the NumPy value of the
whole rows. The msrun equality (with the collective and its gradient) is test_dpo_parallel's
cp2 layout. Tolerance rtol 1e-6: fp32 sums of 16 terms against float64.
"""
import numpy as np
import pytest
from mindspore import Tensor

from ms_llm.parallel.context_parallel.layout import split_sequence
from ms_llm.training.dpo import sequence_logps

ROWS, S, CP = 4, 16, 2


class OtherPieceAdded:
    """Both pieces' partial sums, known in advance: ``sum_*`` adds the other piece's."""

    def __init__(self, logp_parts, count_parts, me):
        self.other_logp = sum(p for i, p in enumerate(logp_parts) if i != me)
        self.other_count = sum(c for i, c in enumerate(count_parts) if i != me)

    def sum_logps(self, x):
        return x + Tensor(self.other_logp)

    def sum_counts(self, x):
        return x + Tensor(self.other_count)


@pytest.mark.parametrize("average", [False, True])
def test_pieces_give_the_whole_rows_logps(average):
    rng = np.random.default_rng(0)
    nll = rng.uniform(0.1, 5.0, (ROWS, S)).astype(np.float32)
    mask = (rng.uniform(size=(ROWS, S)) < 0.6).astype(np.float32)
    mask[0] = 0.0                                  # an empty reply counts as one token (ipo)
    whole = -(nll.astype(np.float64) * mask).sum(-1)
    if average:
        whole = whole / np.maximum(mask.sum(-1), 1.0)
    pieces = [(split_sequence(nll, CP, r), split_sequence(mask, CP, r)) for r in range(CP)]
    logp_parts = [-(n * m).sum(-1) for n, m in pieces]
    count_parts = [m.sum(-1) for _, m in pieces]
    for r, (n, m) in enumerate(pieces):
        got = sequence_logps(Tensor(n), Tensor(m), average,
                             OtherPieceAdded(logp_parts, count_parts, r)).asnumpy()
        np.testing.assert_allclose(got, whole, rtol=1e-6)
