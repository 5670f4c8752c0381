"""MoE auxiliary losses over sequences cut into context-parallel pieces, in one process.

Under context parallel each rank's router sees its two chunks of every sequence and gets the
routed counts summed over the cp ranks (``TopKRouter.token_partition``). Each rank's loss is
then its share: the shares of all pieces must add up to the loss of the whole sequences, and
the router-weight gradients of the shares must add up to that loss's gradient (the trainer sums
both over cp). Here the "ranks" are the pieces of ``split_sequence`` run one after the other,
and the partition returns the counts of the whole sequences, as the cp all-reduce does. The
whole-sequence losses themselves are checked against NumPy in test_deepseek_router / test_moe;
the msrun equality is test_context_parallel_training's cp2_moe_ep2 run.

Tolerance rtol 1e-5 (atol 1e-9 for near-zero gradient entries): the same fp32 terms summed in
two groups instead of one.
"""
import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

from ms_llm.models.config import TransformerConfig
from ms_llm.models.moe import TopKRouter
from ms_llm.parallel.context_parallel.layout import local_token_index

E, K, H, B, S, CP = 8, 2, 16, 3, 8, 2


class WholeSequenceCounts:
    """The cp all-reduce's result, known in advance: counts of the whole sequences."""

    def __init__(self, idx: np.ndarray):                     # idx [B, S, K] of the full run
        self.pieces = CP
        self.total = np.bincount(idx.reshape(-1), minlength=E).astype(np.float32)
        self.per_seq = np.stack([np.bincount(r.reshape(-1), minlength=E) for r in idx]
                                ).astype(np.float32)

    def sum_counts(self, counts: Tensor) -> Tensor:
        want = self.total if counts.ndim == 1 else self.per_seq
        assert counts.shape == want.shape
        return Tensor(want)


def _router(balancing, score):
    c = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=2, mlp_type="moe",
                          num_moe_experts=E, moe_router_topk=K, moe_ffn_hidden_size=8,
                          moe_router_score_function=score,
                          moe_router_load_balancing_type=balancing, moe_aux_loss_coeff=0.1,
                          moe_z_loss_coeff=0.01)
    return TopKRouter(c)


def _loss_and_grad(router, x, seq_length):
    router.seq_length = seq_length

    def fn(inp):
        router(inp)
        return router.aux_loss
    loss, (grad,) = ms.value_and_grad(fn, None, [router.weight])(Tensor(x))
    return float(loss.asnumpy()), grad.asnumpy()


@pytest.mark.parametrize("balancing,score", [("aux_loss", "softmax"),
                                             ("seq_aux_loss", "sigmoid")])
def test_cp_shares_add_up_to_the_whole_sequence_loss(balancing, score):
    rng = np.random.default_rng(5)
    router = _router(balancing, score)
    router.weight.set_data(Tensor(rng.standard_normal((E, H)).astype(np.float32)))
    x = rng.standard_normal((B, S, H)).astype(np.float32)
    whole_loss, whole_grad = _loss_and_grad(router, x.reshape(B * S, H), S)
    _, idx = router(Tensor(x.reshape(B * S, H)))
    router.token_partition = WholeSequenceCounts(idx.asnumpy().reshape(B, S, K))
    losses, grads = [], []
    for r in range(CP):
        piece = x[:, local_token_index(S, CP, r)]             # this rank's two chunks
        loss, grad = _loss_and_grad(router, piece.reshape(-1, H), piece.shape[1])
        losses.append(loss)
        grads.append(grad)
    np.testing.assert_allclose(sum(losses), whole_loss, rtol=1e-5)
    np.testing.assert_allclose(sum(grads), whole_grad, rtol=1e-5, atol=1e-9)
    # a single piece alone is not the whole loss (the test would be vacuous otherwise)
    assert abs(losses[0] - whole_loss) > 1e-3 * abs(whole_loss)
