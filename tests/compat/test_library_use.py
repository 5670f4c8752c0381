"""ms_llm as a library inside a program that already runs MindSpore.

Each case is a fresh interpreter (the device can be chosen once per process): the program runs a
MindSpore kernel of its own first, then calls the ms_llm API, which must adopt the running device
instead of trying to set it (MindSpore raises "The runtime has been initialized" for that).
"""
import os
import subprocess
import sys
import textwrap

from helpers.paths import ROOT, TESTS


PRELUDE = """
import numpy as np
import mindspore as ms
from mindspore import Tensor
x = Tensor(np.ones((2, 3), np.float32))
assert float((x + x).sum().asnumpy()) == 12.0      # the runtime is now initialised
"""


def run_program(body: str, prelude: str = PRELUDE) -> subprocess.CompletedProcess:
    code = textwrap.dedent(prelude) + textwrap.dedent(body)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, TESTS]), GLOG_v="3")
    env.pop("MS_LLM_DEVICE", None)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env=env, cwd=ROOT)


def test_from_pretrained_after_a_mindspore_op(tmp_path):
    r = run_program(f"""
        from helpers.hf_fixtures import make_hf_checkpoint
        from ms_llm.checkpoint import from_pretrained
        make_hf_checkpoint({str(tmp_path)!r}, "qwen3", vocab=64)
        model = from_pretrained({str(tmp_path)!r})
        logits = model(Tensor(np.arange(8, dtype=np.int32).reshape(1, 8)))
        assert logits.shape == (1, 8, 64), logits.shape
        assert np.isfinite(logits.asnumpy()).all()
        from ms_llm.compat import device
        print("device", device())
    """)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "device CPU" in r.stdout


def test_mx_linear_after_a_mindspore_op():
    r = run_program("""
        from ms_llm.quant import mx_linear
        rng = np.random.default_rng(0)
        a = rng.standard_normal((4, 64)).astype(np.float32)
        w = rng.standard_normal((32, 64)).astype(np.float32)
        y = mx_linear(Tensor(a), Tensor(w)).asnumpy()
        assert y.shape == (4, 32)
        # MXFP8 rounding: close to the fp32 product, not equal to it
        ref = a @ w.T
        rel = np.abs(y - ref).max() / np.abs(ref).max()
        assert 0 < rel < 0.1, rel
        print("ok")
    """)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ok" in r.stdout


def test_device_chosen_by_the_caller_is_kept():
    # set_device with an explicit id: setup_device must not call set_device again (it would
    # raise "can not be modified" for the id) and must refuse another device in one line.
    r = run_program("""
        import mindspore as ms
        ms.set_device("CPU", 0)
        from ms_llm.compat import setup_device
        assert setup_device() == "CPU"
        assert setup_device("cpu") == "CPU"
        try:
            setup_device("Ascend")
        except RuntimeError as e:
            print("refused:", e)
    """, prelude="")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "refused: device already set to CPU" in r.stdout


def test_other_device_than_the_running_one_is_refused():
    r = run_program("""
        from ms_llm.compat import setup_device
        try:
            setup_device("Ascend")
        except RuntimeError as e:
            print("refused:", e)
        assert setup_device() == "CPU"
    """)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "refused: device: MindSpore already runs on CPU in this process, cannot switch to " \
           "Ascend" in r.stdout
