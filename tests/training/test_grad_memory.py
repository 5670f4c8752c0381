"""Gradient clipping one tensor at a time and the chunked host sum of squares (issue 31, memory at real size):
the same numbers as torch / float64 NumPy, and no gradient-sized temporaries."""
import numpy as np
import pytest
import torch
from mindspore import Tensor

from ms_llm.compat import setup_device
from ms_llm.training import grad as gradlib

setup_device("CPU")


def test_clip_equals_torch_clip_grad_norm():
    rng = np.random.default_rng(1)
    arrays = [rng.standard_normal(s).astype(np.float32) * 3 for s in ((64, 32), (32,), (5, 7))]
    ps = [torch.nn.Parameter(torch.zeros(a.shape)) for a in arrays]
    for p, a in zip(ps, arrays):
        p.grad = torch.from_numpy(a.copy())
    tnorm = float(torch.nn.utils.clip_grad_norm_(ps, 1.0))
    grads = [Tensor(a.copy()) for a in arrays]
    norm = gradlib.global_norm(grads)
    assert norm == pytest.approx(tnorm, rel=1e-6)   # fp32 sums in different orders
    out = gradlib.clip_(grads, 1.0, norm)
    assert out is grads                              # the list is updated in place
    for o, p in zip(out, ps):
        # coefficient from fp32 (torch) vs float64 (here) norms: a few ulp
        np.testing.assert_allclose(o.asnumpy(), p.grad.numpy(), rtol=1e-6, atol=1e-8)


# Run in a fresh interpreter: peak RSS of a pytest worker that ran other tests first depends on
# what MindSpore's allocator already holds (it keeps freed blocks and reuses them only for equal
# sizes), which made the in-process measurement flaky under xdist.
_MEASURE = """
import numpy as np
from mindspore import Tensor
from ms_llm.compat import setup_device
from ms_llm.training import grad as gradlib
setup_device("CPU")

def status(key):
    with open("/proc/self/status", encoding="ascii") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

n = 8 * 2 ** 20                                  # 4 gradients of 32 MiB each
grads = [Tensor(np.ones(n, np.float32)) for _ in range(4)]
gradlib.clip_([Tensor(np.ones(8, np.float32))], 1.0, 2.0)   # kernels loaded before measuring
with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
    f.write("5")                                 # reset VmHWM to the current RSS
base = status("VmRSS")
norm = gradlib.global_norm(grads)                # squared in 16 MiB chunks
gradlib.clip_(grads, 1.0, norm)                  # a copying clip would add 128 MiB
print(status("VmHWM") - base, float(grads[3].asnumpy()[0]))
"""


def test_clip_and_norm_hold_at_most_one_more_gradient():
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", _MEASURE], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    grown, first = r.stdout.split()[-2:]
    grown = int(grown)
    # one 32 MiB gradient alive twice (old and scaled) plus a 16 MiB square chunk, with slack
    assert grown < 56 * 2 ** 20, f"peak RSS grew {grown / 2 ** 20:.0f} MiB over 128 MiB of grads"
    n = 8 * 2 ** 20
    np.testing.assert_allclose(float(first), 1.0 / (np.sqrt(4 * n) + 1e-6), rtol=1e-6)


def test_host_sum_of_squares_chunked_equals_float64():
    rng = np.random.default_rng(2)
    a = rng.standard_normal(2 * gradlib.SQUARE_CHUNK + 123).astype(np.float32)
    b = rng.standard_normal((3, 5)).astype(np.float32)
    got = gradlib.host_sum_of_squares([Tensor(a), Tensor(b)])
    want = float(np.sum(a.astype(np.float64) ** 2) + np.sum(b.astype(np.float64) ** 2))
    assert got == pytest.approx(want, rel=1e-6)      # pairwise fp32 sums: ~1e-7 relative


def test_clip_of_a_tuple_returns_scaled_list():
    a = np.full((3, 4), 2.0, np.float32)
    out = gradlib.clip_((Tensor(a),), 1.0, 4.0)
    assert isinstance(out, list)
    np.testing.assert_allclose(out[0].asnumpy(), a / (4.0 + 1e-6), rtol=1e-6)
