"""ms-llm's Ascend communication branch in a fake 2-rank HCCL world
(tests/helpers/fake_hccl_world.py): the world's own checks (mismatched collectives, send/recv pairs, deadlocks) on hand-made call
sequences, then data-, tensor- and pipeline-parallel training steps of a tiny model run through
it on two spawned ranks with the device faked as Ascend, equal to the single-process run.

Tolerance: rtol 1e-5 on loss and gradient norm over 1 AdamW step (fp32), as the msrun tests of
the same layouts (tests/parallel/test_parallel_training.py): only the order of fp32 sums differs.
"""
import threading

import numpy as np
import pytest

from helpers.fake_hccl_world import (WORLD_GROUP, Call, FakeDistributed, World, WorldError,
                                     run_world)
from helpers.fake_world_training import LAYOUTS, layout_args, record

RTOL = 1e-5


def _run_ranks(world, *sequences):
    """Each rank's ``Call`` sequence on its own thread; the errors by rank."""
    errors = {}

    def run(rank, calls):
        try:
            for c in calls:
                world.call(c)
            world.finish(rank)
        except WorldError as e:
            errors[rank] = str(e)
    threads = [threading.Thread(target=run, args=(r, s)) for r, s in enumerate(sequences)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return errors


def _all_reduce(rank, shape=(4,), value=1.0):
    return Call(rank, "all_reduce", WORLD_GROUP, {"op": "sum", "shape": shape,
                                                 "dtype": "Float32"},
                {"tensor": np.full(shape, value, np.float32)})


def _p2p(rank, op, peer, shape=(2, 3), dtype="Float32"):
    data = {"tensor": np.arange(np.prod(shape), dtype=np.float32).reshape(shape)} \
        if op == "send" else {}
    return Call(rank, op, WORLD_GROUP, {"peer": peer, "shape": shape, "dtype": dtype, "tag": 0},
                data)


def test_matching_calls_complete_with_the_composed_result():
    world = World(2)
    a, b = _all_reduce(0, value=1.0), _all_reduce(1, value=2.0)
    s, r = _p2p(0, "send", 1), _p2p(1, "recv", 0)
    assert _run_ranks(world, [a, s], [b, r]) == {}
    np.testing.assert_array_equal(a.result["tensor"], np.full(4, 3.0, np.float32))
    np.testing.assert_array_equal(r.result["tensor"], s.data["tensor"])
    assert [op for op, _, _ in world.log[0]] == ["all_reduce", "send"]
    assert [op for op, _, _ in world.log[1]] == ["all_reduce", "recv"]


def _all_to_all(rank, in_splits, out_splits):
    rows = np.arange(sum(in_splits) * 2, dtype=np.float32).reshape(-1, 2) + 100 * rank
    return Call(rank, "all_to_all_single", WORLD_GROUP, {"row": (2,), "dtype": "Float32"},
                {"input": rows}, {"splits": (tuple(in_splits), tuple(out_splits))})


def test_all_to_all_moves_each_ranks_split_to_its_peer():
    a, b = _all_to_all(0, [1, 2], [1, 3]), _all_to_all(1, [3, 1], [2, 1])
    assert _run_ranks(World(2), [a], [b]) == {}
    ins = [a.data["input"], b.data["input"]]
    np.testing.assert_array_equal(a.result["output"], np.concatenate([ins[0][:1], ins[1][:3]]))
    np.testing.assert_array_equal(b.result["output"], np.concatenate([ins[0][1:], ins[1][3:]]))


@pytest.mark.parametrize("rank0,rank1,message", [
    # rank 1 expects 1 row from rank 0, which sends it 2
    ([_all_to_all(0, [1, 2], [1, 3])], [_all_to_all(1, [3, 1], [1, 2])],
     "all_to_all_single mismatch"),
    # the same collective with other shapes on the two ranks
    ([_all_reduce(0, (4,))], [_all_reduce(1, (8,))], "collective mismatch"),
    # collectives in another order
    ([_all_reduce(0), Call(0, "broadcast", WORLD_GROUP, {"src": 0, "shape": (4,),
                                                         "dtype": "Float32"},
                           {"tensor": np.zeros(4, np.float32)})],
     [Call(1, "broadcast", WORLD_GROUP, {"src": 0, "shape": (4,), "dtype": "Float32"},
           {"tensor": np.zeros(4, np.float32)}), _all_reduce(1)], "collective mismatch"),
    # a receive of another shape or dtype than the send
    ([_p2p(0, "send", 1, (2, 3))], [_p2p(1, "recv", 0, (3, 2))], "send/recv mismatch"),
    ([_p2p(0, "send", 1)], [_p2p(1, "recv", 0, dtype="BFloat16")], "send/recv mismatch"),
    # both ranks send first: HCCL's blocking send waits forever
    ([_p2p(0, "send", 1), _p2p(0, "recv", 1)], [_p2p(1, "send", 0), _p2p(1, "recv", 0)],
     "deadlock"),
    # a collective one rank skips
    ([_all_reduce(0), _all_reduce(0)], [_all_reduce(1)], "deadlock"),
    # a send while the peer is in a collective
    ([_p2p(0, "send", 1)], [_all_reduce(1)], "deadlock"),
])
def test_the_world_fails_where_hccl_would_hang(rank0, rank1, message):
    errors = _run_ranks(World(2), rank0, rank1)
    assert errors and all(message in e for e in errors.values()), errors


def _rank_side_calls():
    """Rank 0's fake ``mint.distributed``, answering every call with the input (a 1-rank echo),
    and what it sent."""
    sent = []

    def answer(c):
        sent.append(c)
        return {"tensor": c.data.get("tensor")}
    return FakeDistributed(0, answer).module, sent


def test_the_rank_side_takes_the_arguments_as_mindspore_binds_them():
    from mindspore import Tensor
    dist, sent = _rank_side_calls()
    t = Tensor(np.arange(4, dtype=np.float32))
    assert dist.all_reduce(t, "max", None, False) is None      # positional, as bound
    assert dist.all_reduce(t, async_op=True).wait()            # a handle when asynchronous
    assert [c.meta["op"] for c in sent] == ["max", "sum"] and sent[0].group == WORLD_GROUP
    with pytest.raises(TypeError):
        dist.all_reduce(t, op="sum", grop="x")                  # not in the real signature


@pytest.mark.parametrize("call,error,message", [
    (lambda d, T: d.all_reduce(T(np.zeros((4, 2), np.float32)).transpose(1, 0)), ValueError,
     "not contiguous"),
    (lambda d, T: d.all_reduce(T(np.zeros(4, np.bool_))), TypeError, "HCCL does not move"),
    (lambda d, T: d.all_reduce(T(np.zeros(4, np.float32)), group=3), TypeError,
     "group must be a str"),
    (lambda d, T: d.all_reduce(T(np.zeros(4, np.float32)), op="mean"), ValueError, "reduce op"),
    (lambda d, T: d.send(T(np.zeros(4, np.float32)), dst=0), ValueError, "another rank"),
    (lambda d, T: d.send(T(np.zeros(4, np.float32)), dst=True), ValueError, "another rank"),
    (lambda d, T: d.all_gather_into_tensor(T(np.zeros((4, 3), np.float32)),
                                           T(np.zeros((2, 2), np.float32))), ValueError,
     "differ beyond dim 0"),
])
def test_the_rank_side_refuses_what_hccl_would_not_take(call, error, message):
    from mindspore import Tensor
    dist, sent = _rank_side_calls()
    with pytest.raises(error, match=message):
        call(dist, Tensor)
    assert sent == []


@pytest.fixture(scope="module")
def world_run(tmp_path_factory):
    """The 2-rank world's records, and each layout's single-process reference computed here
    while the ranks run (the test process only waits on them otherwise)."""
    root = tmp_path_factory.mktemp("fake_world")
    box = {}

    def ranks():
        try:
            box["world"] = run_world("helpers.fake_world_training:train_layouts", 2,
                                     (str(root), list(LAYOUTS)))
        except BaseException as e:   # noqa: BLE001 - re-raised in the test's thread
            box["error"] = e
    thread = threading.Thread(target=ranks)
    thread.start()
    refs = {name: record(layout_args(name, str(root / f"one_process_{name}"), parallel=False))
            for name in LAYOUTS}
    thread.join()
    if "error" in box:
        raise box["error"]
    return (*box["world"], refs)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_training_in_the_fake_world_equals_one_process(world_run, name):
    results, world, refs = world_run
    ref = refs[name]
    for rank in range(2):
        run = results[rank][name]
        np.testing.assert_allclose(run["grad_norm"], ref["grad_norm"], rtol=RTOL,
                                   err_msg=f"{name} rank {rank}")
        np.testing.assert_allclose(run["loss"], ref["loss"], rtol=RTOL,
                                   err_msg=f"{name} rank {rank}")


def test_both_ranks_issue_one_consistent_sequence(world_run):
    """Collectives in the same order with the same arguments on both ranks (the World already
    refused any other), each send matched by the peer's receive in order, and each layout's
    traffic of the kind it needs: gradient all-reduces, sequence-parallel gathers and
    reduce-scatters, pipeline sends and receives."""
    _, world, _ = world_run
    collectives = [[(op, g, m) for op, g, m in world.log[r] if op not in ("send", "recv")]
                   for r in range(2)]
    assert collectives[0] == collectives[1]
    sends = {r: [m["shape"] for op, _, m in world.log[r] if op == "send"] for r in range(2)}
    recvs = {r: [m["shape"] for op, _, m in world.log[r] if op == "recv"] for r in range(2)}
    assert sends[0] == recvs[1] and sends[1] == recvs[0] and sends[0] and sends[1]
    ops = {op for op, _, _ in world.log[0]}
    assert {"all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "send",
            "recv"} <= ops, ops
