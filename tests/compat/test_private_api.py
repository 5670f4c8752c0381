"""Every private MindSpore API ms_llm relies on (``ms_llm.compat.private_api``) still exists and still
does what ms_llm needs. A MindSpore upgrade that removes or changes one fails here, by name."""
import numpy as np
import mindspore as ms
import pytest
from mindspore import Parameter, Tensor, nn

from ms_llm.compat import private_api as P


def test_version_check():
    assert P.version_verified("2.10.0") and P.version_verified("2.10")
    assert not P.version_verified("2.100.0") and not P.version_verified("2.11.0")


def test_missing_api_error_names_api_and_version():
    with pytest.raises(P.PrivateAPIError, match=r"MindSpore \S+ has no Thing\._gone"):
        P._require(object(), "_gone", "Thing._gone")


def test_autograd_function_base_runs_custom_backward():
    calls = []

    class Triple(P.autograd_function_base()):
        @staticmethod
        def forward(ctx, x):
            return x * 2.0

        @staticmethod
        def backward(ctx, dy):
            calls.append(1)
            return dy * 3.0            # deliberately not the true derivative

    x = Tensor(np.arange(4, dtype=np.float32))
    g = ms.grad(lambda v: Triple.apply(v).sum())(x)
    np.testing.assert_array_equal(g.asnumpy(), np.full(4, 3.0, np.float32))
    assert calls == [1]


def test_no_grad_stops_gradients():
    a = np.arange(1, 6, dtype=np.float32)

    def f(x):
        with P.no_grad():
            y = x * 3.0
        return (y * x).sum()

    np.testing.assert_allclose(ms.grad(f)(Tensor(a)).asnumpy(), 3 * a, rtol=1e-6)


def test_grouped_matmul_kernel_is_importable():
    assert callable(P.grouped_matmul_kernel())


def test_child_cell_reads_named_and_list_children():
    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.inner = nn.Dense(2, 2)
            self.blocks = nn.CellList([nn.Dense(2, 2), nn.Dense(2, 3)])

    net = Net()
    assert P.child_cell(net, "inner") is net.inner
    assert P.child_cell(P.child_cell(net, "blocks"), "1") is net.blocks[1]
    with pytest.raises(KeyError):
        P.child_cell(net, "missing")


def test_shadow_attribute_keeps_the_parameter_registered():
    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.w = Parameter(Tensor(np.ones(3, np.float32)), name="w")

    net = Net()
    full = Tensor(np.full(3, 7.0, np.float32))
    P.shadow_attribute(net, "w", full)
    assert net.w is full
    assert [n for n, _ in net.parameters_and_names()] == ["w"]
    assert isinstance(dict(net.parameters_and_names())["w"], Parameter)
    P.unshadow_attribute(net, "w")
    assert isinstance(net.w, Parameter)
    np.testing.assert_array_equal(net.w.asnumpy(), np.ones(3, np.float32))


def test_free_and_refill_storage():
    t = Tensor(np.arange(6, dtype=np.float32)) * 1.0
    assert P.storage_nbytes(t) == 24
    P.free_storage(t)
    assert P.storage_nbytes(t) == 0
    P.refill_storage(t, Tensor(np.arange(6, dtype=np.float32)) * 2.0)
    assert P.storage_nbytes(t) == 24
    np.testing.assert_array_equal(t.asnumpy(), np.arange(6, dtype=np.float32) * 2.0)


def test_device_chosen_by_caller_reads_set_device():
    # conftest has set the CPU device in this process, as a caller's set_device would.
    assert P.device_chosen_by_caller() is True


def test_legacy_kernel_seeds_round_trip_replays_dropout():
    from mindspore import ops
    x = Tensor(np.ones(64, np.float32))
    ms.set_seed(11)
    ops.dropout(x, 0.5)
    saved = P.legacy_kernel_seeds()
    assert any(name == "dropout" for name, _, _ in saved)
    first = ops.dropout(x, 0.5).asnumpy()
    assert not np.array_equal(first, ops.dropout(x, 0.5).asnumpy())   # the counter advances
    P.set_legacy_kernel_seeds(saved)
    np.testing.assert_array_equal(ops.dropout(x, 0.5).asnumpy(), first)
