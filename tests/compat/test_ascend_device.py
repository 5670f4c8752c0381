"""Device choices for Ascend, checked on the CPU build of MindSpore 2.10: why Ascend is not used
when it is asked for, ``runtime.sync_ops`` by device, and the MXFP8 path on Ascend (emulated with
a notice, ``native`` refused, the Ascend 950 check) including a probe of the missing MX ops."""
import sys

import mindspore as ms
import pytest
from mindspore import ops

from helpers.fake_ascend import no_device_chosen
from ms_llm.compat import DeviceUnavailableError
from ms_llm.compat.environment import configure
from ms_llm.quant import _dispatch as mx_dispatch

device_mod = sys.modules["ms_llm.compat.device"]   # ms_llm.compat re-exports device() by name


@pytest.fixture
def fresh_device(monkeypatch):
    """setup_device as in a new process with no device chosen; ``set_device`` recorded only."""
    return no_device_chosen(monkeypatch)


def test_ascend_asked_for_on_a_cpu_build_says_why_in_one_line(fresh_device):
    with pytest.raises(DeviceUnavailableError) as e:
        device_mod.setup_device("Ascend")
    msg = str(e.value)
    assert "\n" not in msg and "training.device" in msg and ms.__version__ in msg
    assert "libmindspore_ascend" in msg     # the plugin's own load error, as MindSpore has it
    assert fresh_device == []                # never handed to MindSpore


def test_auto_on_an_npu_host_logs_why_it_runs_on_cpu(fresh_device, monkeypatch, caplog):
    monkeypatch.setenv("ASCEND_HOME_PATH", "/usr/local/Ascend/ascend-toolkit/latest")
    monkeypatch.setitem(device_mod._STATE, "threads", 1)
    with caplog.at_level("WARNING", "ms_llm.compat"):
        assert device_mod.setup_device() == "CPU"
    assert "running on CPU although this host has Ascend NPUs" in caplog.text
    assert "libmindspore_ascend" in caplog.text


def test_sync_ops_defaults_on_for_cpu_only(monkeypatch):
    monkeypatch.delenv("MS_LLM_SYNC", raising=False)
    assert device_mod.sync_ops_default("CPU") is True
    assert device_mod.sync_ops_default("Ascend") is False
    try:
        configure({"runtime.sync_ops": True})
        assert device_mod.sync_ops_default("Ascend") is True
        configure({"runtime.sync_ops": False})
        assert device_mod.sync_ops_default("CPU") is False
    finally:
        configure({})


def test_setup_device_on_ascend_launches_asynchronously(fresh_device, monkeypatch):
    monkeypatch.delenv("MS_LLM_SYNC", raising=False)
    monkeypatch.setattr(device_mod, "ascend_plugin_error", lambda: None)   # plugin "loaded"
    assert device_mod.setup_device("Ascend") == "Ascend"
    assert fresh_device == ["Ascend"]        # set_device, and no launch_blocking


# ----------------------------------------------------------------------------- MXFP8 on Ascend
def test_mx_ops_missing_in_this_mindspore():
    """Probe: MindSpore 2.10 has no dynamic MX quantize op and no E8M0 dtype. When this fails
    MindSpore has gained them: write the native MX path against their real signatures (and the
    block-scaled quant_matmul) and move this probe to the next version."""
    if not ms.__version__.startswith("2.10."):
        pytest.skip(f"probe written for MindSpore 2.10, this is {ms.__version__}")
    assert not hasattr(ops.auto_generate, "dynamic_mx_quant")
    assert not hasattr(ms, "float8_e8m0fnu")
    assert mx_dispatch.missing_mx_ops() == ["dynamic_mx_quant", "float8_e8m0fnu"]


@pytest.fixture
def fake_ascend_mx(monkeypatch):
    monkeypatch.setitem(device_mod._STATE, "device", "Ascend")
    monkeypatch.setattr(mx_dispatch, "_STATE", {})
    yield
    configure({})


def test_mx_auto_on_ascend_emulates_with_a_notice_naming_the_missing_ops(fake_ascend_mx, caplog):
    configure({"quant.mx_path": "auto"})
    with caplog.at_level("WARNING", "ms_llm.quant"):
        assert mx_dispatch.resolve_mx_path() == "emulated"
    notices = [r.getMessage() for r in caplog.records if r.name == "ms_llm.quant"]
    assert len(notices) == 1 and "\n" not in notices[0]
    assert "dynamic_mx_quant" in notices[0] and "float8_e8m0fnu" in notices[0]


def test_mx_native_on_ascend_is_refused_in_one_line(fake_ascend_mx):
    configure({"quant.mx_path": "native"})
    with pytest.raises(DeviceUnavailableError, match=r"quant.mx_path native.*dynamic_mx_quant"):
        mx_dispatch.resolve_mx_path()


@pytest.mark.parametrize("soc,usable", [("ascend950pr_9599", True), ("ascend910b1", False),
                                        ("ascend910_9391", False), ("", False)])
def test_mx_native_only_on_an_ascend_950(fake_ascend_mx, monkeypatch, soc, usable):
    monkeypatch.setattr(mx_dispatch, "missing_mx_ops", lambda: [])   # a MindSpore that has them
    monkeypatch.setattr(mx_dispatch, "ascend_soc_version", lambda: soc)
    reason = mx_dispatch._native_support()
    assert (reason == "") == usable, reason
    if not usable:
        assert "Ascend 950 only" in reason


def test_native_mx_call_binds_to_quant_matmul_with_scales_that_follow_the_operands(
        fake_ascend_mx, monkeypatch):
    """The native GEMM as it would run once MindSpore has the MX ops (stand-ins for the missing
    ``dynamic_mx_quant`` and E8M0 dtype): the call binds to 2.10's ``quant_matmul`` and every
    operand's block scales have the operand's layout (x2 = b^T [K, N], its scales [K/32, N])."""
    import inspect
    import numpy as np
    from mindspore import Tensor
    real = inspect.signature(ops.auto_generate.quant_matmul)
    seen = {}

    def quant(t, axis, round_mode, dst_type, blocksize, scale_alg):
        assert axis == -1 and blocksize == 32
        return t, Tensor(np.ones((t.shape[0], t.shape[1] // 32), np.float32))

    def matmul(*args, **kwargs):
        bound = real.bind(*args, **kwargs).arguments
        x1, x2, scale = bound["x1"], bound["x2"], bound["scale"]
        assert x1.shape[1] == x2.shape[0]
        assert scale.shape == (x2.shape[0] // 32, x2.shape[1])
        assert bound["pertoken_scale"].shape == (x1.shape[0], x1.shape[1] // 32)
        seen["ok"] = True
        return Tensor(np.zeros((x1.shape[0], x2.shape[1]), np.float32))

    monkeypatch.setattr(ops.auto_generate, "dynamic_mx_quant", quant, raising=False)
    monkeypatch.setattr(ops.auto_generate, "quant_matmul", matmul)
    monkeypatch.setattr(ms, "float8_e8m0fnu", ms.uint8, raising=False)
    monkeypatch.setattr(ms, "float8_e4m3fn", getattr(ms, "float8_e4m3fn", ms.uint8), raising=False)
    a = Tensor(np.ones((4, 64), np.float32))
    b = Tensor(np.ones((8, 64), np.float32))
    assert mx_dispatch._native_mm_nt(a, b, "float8_e4m3fn", "floor").shape == (4, 8)
    assert seen["ok"]


def test_the_soc_query_answers_empty_without_an_ascend_runtime():
    from ms_llm.compat.private_api import ascend_soc_version
    assert ascend_soc_version() == ""
