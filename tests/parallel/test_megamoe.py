"""MegaMoE and the expert-parallel helpers in one process (their msrun parity runs are in
test_parallel_training.py): the pipelined custom-backward path must reproduce autograd through
the plain dispatcher for any expert grouping and token chunking, including idle experts."""
import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor

from ms_llm.compat import manual_seed
from ms_llm.models.config import TransformerConfig
from ms_llm.models.moe import MoELayer
from ms_llm.parallel import comm
from ms_llm.parallel.expert_parallel import regroup_index
from ms_llm.parallel.megamoe import MegaMoEDispatcher, Timeline


def test_regroup_index_orders_rows_expert_major():
    blocks = np.array([[2, 0, 1], [1, 3, 0]])     # [src rank, local expert] row counts
    # Received layout: src0 (e0 x2, e2 x1), src1 (e0 x1, e1 x3) -> rows 0..7.
    labels = [(0, 0), (0, 0), (0, 2), (1, 0), (1, 1), (1, 1), (1, 1)]
    want = sorted(range(len(labels)), key=lambda i: (labels[i][1], labels[i][0], i))
    np.testing.assert_array_equal(regroup_index(blocks), want)


def _layer(grouped: bool) -> MoELayer:
    manual_seed(0)
    c = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32,
                          mlp_type="moe", num_moe_experts=8, moe_router_topk=2,
                          moe_ffn_hidden_size=24, moe_grouped_gemm=grouped)
    layer = MoELayer(c)
    layer.set_train(True)
    return layer


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("groups,chunks", [(1, 1), (3, 1), (2, 3), (8, 2)])
def test_megamoe_matches_plain_dispatcher(grouped, groups, chunks):
    layer = _layer(grouped)
    # Starve expert 5: its router row is pushed far negative for these inputs.
    x_np = np.random.RandomState(0).randn(2, 7, 16).astype(np.float32)
    w = layer.router.weight.asnumpy().copy()
    w[5] = -5.0 * x_np.reshape(-1, 16).mean(0) / np.linalg.norm(x_np.reshape(-1, 16).mean(0))
    layer.router.weight.set_data(Tensor(w))
    x = Tensor(x_np)
    dy = Tensor(np.random.RandomState(1).randn(2, 7, 16).astype(np.float32))
    params = [p for p in layer.trainable_params()]
    grad = ms.value_and_grad(lambda v: (layer(v) * dy).sum(), 0, params)
    l0, (dx0, g0) = grad(x)
    idx = layer.last_top_indices.asnumpy()
    timeline = Timeline()
    layer.token_dispatcher = MegaMoEDispatcher(8, 2, comm.world_group(), groups,
                                               token_chunks=chunks, timeline=timeline)
    l1, (dx1, g1) = grad(x)
    np.testing.assert_array_equal(layer.last_top_indices.asnumpy(), idx)
    # Same rows through the same fp32 GEMMs; only the order of fp32 sums differs (chunks, the
    # combine). The loss sums terms of ~1e-2 that cancel to ~2.5e-4, which magnifies rounding in
    # relative terms (1.7e-6 seen), hence 1e-5 relative, as for the gradients.
    np.testing.assert_allclose(float(l1.asnumpy()), float(l0.asnumpy()), rtol=1e-5)
    np.testing.assert_allclose(dx1.asnumpy(), dx0.asnumpy(), rtol=1e-5, atol=1e-7)
    for a, b, p in zip(g1, g0, params):
        np.testing.assert_allclose(a.asnumpy(), b.asnumpy(), rtol=1e-5, atol=1e-7, err_msg=p.name)
    stages = {e["group"] for e in timeline.events if e["kind"] == "compute"}
    assert len(stages) == min(groups, 8) * chunks
    assert {e["phase"] for e in timeline.events} == {"fwd", "bwd"}


def test_dead_expert_gets_zero_gradient_through_megamoe():
    layer = _layer(False)
    x = Tensor(np.random.RandomState(2).randn(1, 6, 16).astype(np.float32))
    layer.token_dispatcher = MegaMoEDispatcher(8, 2, comm.world_group(), 4, token_chunks=2)
    params = [p for p in layer.trainable_params()]
    _, grads = ms.value_and_grad(lambda v: layer(v).sum(), None, params)(x)
    used = set(layer.last_top_indices.asnumpy().reshape(-1).tolist())
    idle = [e for e in range(8) if e not in used]
    assert idle, "6 tokens x top-2 over 8 experts should leave an expert idle"
    checked = 0
    for p, g in zip(params, grads):
        if ".local_experts." in p.name:
            e = int(p.name.split(".local_experts.")[1].split(".")[0])
            assert (np.abs(g.asnumpy()).max() == 0) == (e in idle), p.name
            checked += 1
    assert checked == 16


def test_megamoe_rejects_bad_sizes():
    with pytest.raises(ValueError, match="token_chunks"):
        MegaMoEDispatcher(8, 2, comm.world_group(), 2, token_chunks=0)
    with pytest.raises(ValueError, match="expert_groups"):
        MegaMoEDispatcher(8, 2, comm.world_group(), 0)
