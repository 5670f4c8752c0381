"""Ring-attention kernel (single process) against an independent fp64 NumPy reference.

cp ranks are simulated in one process: each rank's queries (chunks i and 2cp-1-i) attend over
the K/V blocks of every rank in ring order, and the loss sums over ranks, so the gradients that
reach the global q/k/v include every block's dK/dV returned to its owner.
"""
import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor, ops

from ms_llm.parallel.context_parallel.kernel import attention_over_blocks
from ms_llm.parallel.context_parallel.layout import (SKIP, ChunkMask, local_token_index,
                                                     rank_chunks, split_sequence)


def reference(q, k, v, mask, w):
    """fp64 causal (GQA) attention, loss = sum(out * w), and its gradients by hand."""
    b, nh, s, d = q.shape
    ng = k.shape[1]
    r = nh // ng
    ke, ve = np.repeat(k, r, axis=1), np.repeat(v, r, axis=1)
    scale = 1.0 / np.sqrt(d)
    sc = np.einsum("bhqd,bhkd->bhqk", q, ke) * scale
    masked = np.triu(np.ones((s, s), bool), 1)[None, None]
    if mask is not None:
        masked = masked | mask[:, None]
    sc = np.where(masked, -np.inf, sc)
    p = np.exp(sc - sc.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.einsum("bhqk,bhkd->bhqd", p, ve)
    dout = w
    dp = np.einsum("bhqd,bhkd->bhqk", dout, ve)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True)) * scale
    dq = np.einsum("bhqk,bhkd->bhqd", ds, ke)
    dk = np.einsum("bhqk,bhqd->bhkd", ds, q).reshape(b, ng, r, s, d).sum(2)
    dv = np.einsum("bhqk,bhqd->bhkd", p, dout).reshape(b, ng, r, s, d).sum(2)
    return out, dq, dk, dv


def doc_mask(doc_ids):
    """[b, s] document ids -> [b, s, s] True where query and key are in different documents."""
    return doc_ids[:, :, None] != doc_ids[:, None, :]


def simulate(q, k, v, w, cp, mask):
    s = q.shape[2]
    masks = ChunkMask(s, 2 * cp, mask)
    idx = [local_token_index(s, cp, i) for i in range(cp)]
    outs = {}

    def loss_fn(qt, kt, vt):
        total = 0
        for i in range(cp):
            qi = ops.gather(qt, Tensor(idx[i].astype(np.int32)), 2)
            blocks = []
            for step in range(cp):          # ring order: own block first, then rank i-1, ...
                j = (i - step) % cp
                ji = Tensor(idx[j].astype(np.int32))
                blocks.append((ops.gather(kt, ji, 2), ops.gather(vt, ji, 2), rank_chunks(cp, j)))
            out = attention_over_blocks(qi, rank_chunks(cp, i), blocks, masks)
            outs[i] = out
            total = total + (out * Tensor(split_sequence(w, cp, i, dim=2))).sum()
        return total

    grad_fn = ms.value_and_grad(loss_fn, grad_position=(0, 1, 2))
    _, (dq, dk, dv) = grad_fn(Tensor(q), Tensor(k), Tensor(v))
    return outs, masks, dq.asnumpy(), dk.asnumpy(), dv.asnumpy()


CASES = {
    "causal": None,
    # documents [0..2], [3..8], [9..13], [14..15]: boundaries inside chunks of 2 and 4 tokens;
    # the second sample has one document crossing every chunk boundary but one
    "documents": np.array([[0] * 3 + [1] * 6 + [2] * 5 + [3] * 2,
                           [0] * 1 + [1] * 12 + [2] * 3]),
}


@pytest.fixture(params=["per_pair", "fused", "per_pair_composed", "fused_composed"])
def block_mode(request, monkeypatch):
    """Both ways the kernel computes a K/V block: chunk pair by chunk pair (long chunks) and the
    whole block as one masked product (short chunks); the threshold picks one per shape. Each
    pair runs the C++ pair kernel on CPU, or (``_composed``) the composed MindSpore ops every
    other device runs."""
    from ms_llm.parallel.context_parallel import kernel
    from ms_llm.ops.attention import pair_kernel_enabled
    monkeypatch.setattr(kernel, "FUSED_BLOCK_MAX_CHUNK", 0 if request.param.startswith("per_pair")
                        else 1 << 30)
    if request.param.endswith("composed"):
        monkeypatch.setattr(kernel, "pair_kernel_enabled", lambda: False)
    else:
        assert pair_kernel_enabled()    # this CPU test machine has the BLAS kernels
    return request.param


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_ring_kernel_matches_reference(cp, case, block_mode):
    rng = np.random.default_rng(cp * 10 + len(case))
    b, nh, ng, s, d = 2, 4, 2, 16, 8
    q = rng.standard_normal((b, nh, s, d)).astype(np.float32)
    k = rng.standard_normal((b, ng, s, d)).astype(np.float32)
    v = rng.standard_normal((b, ng, s, d)).astype(np.float32)
    w = rng.standard_normal((b, nh, s, d)).astype(np.float32)
    mask = None if CASES[case] is None else doc_mask(CASES[case])
    outs, masks, dq, dk, dv = simulate(q, k, v, w, cp, mask)
    ref, rdq, rdk, rdv = reference(*(x.astype(np.float64) for x in (q, k, v)), mask,
                                   w.astype(np.float64))
    # fp32 kernel vs fp64 reference on O(1) values: 1e-5 absolute covers fp32 rounding of
    # 16-term softmax sums and the exp/log of the online merge (CPU exp is ~5e-6 relative).
    for i in range(cp):
        np.testing.assert_allclose(outs[i].asnumpy(), split_sequence(ref, cp, i, dim=2),
                                   rtol=1e-5, atol=1e-5)
    for got, want in ((dq, rdq), (dk, rdk), (dv, rdv)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-5)


def test_causal_work_is_balanced_and_masked_blocks_skipped():
    for cp in (2, 4):
        masks = ChunkMask(16 * cp, 2 * cp)
        every = list(range(2 * cp))
        work = [masks.work(rank_chunks(cp, i), every) for i in range(cp)]
        assert len(set(work)) == 1, work                    # load balance
        assert work[0] * cp == (2 * cp) * (2 * cp + 1) // 2  # only the lower triangle
    # two documents split at chunk boundary 8 of 16 tokens (cp=2, chunks of 4): chunk 3's
    # queries never see chunks 0 and 1
    docs = np.array([[0] * 8 + [1] * 8])
    masks = ChunkMask(16, 4, doc_mask(docs))
    assert masks.pair(3, 0) is SKIP and masks.pair(3, 1) is SKIP
    assert masks.pair(2, 1) is SKIP and masks.pair(1, 0) == "full"


def test_skipped_blocks_are_not_computed(monkeypatch, block_mode):
    """Forward and backward run one pair computation per non-skipped (query, key) chunk pair,
    or, fused, one per K/V block with any such pair."""
    from ms_llm.parallel.context_parallel import kernel
    calls = {"fwd": 0, "bwd": 0}
    fwd, bwd = kernel.pair_forward, kernel.pair_backward

    def count(key, fn):
        def wrapped(*a, **k):
            calls[key] += 1
            return fn(*a, **k)
        return wrapped
    monkeypatch.setattr(kernel, "pair_forward", count("fwd", fwd))
    monkeypatch.setattr(kernel, "pair_backward", count("bwd", bwd))
    rng = np.random.default_rng(0)
    cp, s = 2, 16
    q = rng.standard_normal((1, 2, s, 4)).astype(np.float32)
    k = rng.standard_normal((1, 1, s, 4)).astype(np.float32)
    mask = doc_mask(np.array([[0] * 8 + [1] * 8]))
    _, masks, *_ = simulate(q, k, k.copy(), q.copy(), cp, mask)
    every = list(range(2 * cp))
    expected = sum(masks.work(rank_chunks(cp, i), every) for i in range(cp))
    assert expected == 6 < (2 * cp) * (2 * cp + 1) // 2   # two documents: fewer than causal
    if block_mode.startswith("fused"):
        # every block of this mask holds a computed pair (e.g. rank 0's chunk 3 sees rank 1's
        # chunk 2, same document): one product per block
        blocks = [masks.block(rank_chunks(cp, i), rank_chunks(cp, j))
                  for i in range(cp) for j in range(cp)]
        expected = sum(b is not SKIP for b in blocks)
        assert expected == 4
        # one document per chunk: only the diagonal pairs attend, so the cross-rank blocks are
        # skipped as a whole
        one_per_chunk = ChunkMask(16, 4, doc_mask(np.repeat(np.arange(4), 4)[None]))
        assert one_per_chunk.block([0, 3], [1, 2]) is SKIP
        assert one_per_chunk.block([1, 2], [0, 3]) is SKIP
        assert one_per_chunk.block([0, 3], [0, 3]) is not SKIP
    assert calls == {"fwd": expected, "bwd": expected}
