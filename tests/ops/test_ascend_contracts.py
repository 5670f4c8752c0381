"""Every Ascend-only kernel call of ms-llm against the installed MindSpore's own contract.

The arguments are the exact ones ms-llm passes: a tiny bf16 dense + MoE model and a KV-cache
attention step run on the fake Ascend device (tests/helpers/fake_ascend.py), which records each
call. Each recorded call is then
* bound to the real API's signature (``inspect.signature(...).bind``): no misspelt or extra
  keyword, no missing argument;
* compiled on CPU with ``mindspore.jit``: the graph must get through parsing, argument
  conversion (layout enums, constants) and type inference and stop only at kernel selection
  ("Kernel select failed": no CPU kernel), not at a TypeError or ValueError;
and the documented limits ms-llm relies on are asserted on the docstrings, so a MindSpore that
changes them fails here.
"""
import inspect

import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor, mint, ops
from mindspore.ops.function.math_func import gmm

from helpers.fake_ascend import fake_ascend
from ms_llm.compat import bfloat16, manual_seed
from ms_llm.models import GPTModel, TransformerConfig
from ms_llm.ops import attention

KERNELS = {   # recorded name -> the real MindSpore API ms-llm calls
    "flash_attention_score": ops.flash_attention_score,
    "rms_norm": ops.rms_norm,
    "swiglu": ops.swiglu,
    "rotary_position_embedding": ops.rotary_position_embedding,
    "gmm": gmm,
    "bincount": mint.bincount,
    "cross_entropy": mint.nn.functional.cross_entropy,
}
# gmm is exported as gmm(*args, **kwargs); its docstring's first line is the real signature.
GMM_SIGNATURE = "gmm(x, weight, bias=None, group_list=None, group_type=0, group_list_type=0)"


@pytest.fixture(scope="module", autouse=True)
def graph_dumps_elsewhere(tmp_path_factory):
    """A failed compile writes rank_0/om/analyze_fail.ir under the working directory."""
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path_factory.mktemp("jit"))
        yield


@pytest.fixture(scope="module")
def recorded():
    """Each kernel's recorded (args, kwargs), from one fake-device run of a tiny model."""
    with pytest.MonkeyPatch.context() as mp:
        calls, _ = fake_ascend(mp)
        manual_seed(0)
        cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=2,
                                num_query_groups=1, kv_channels=16, ffn_hidden_size=64,
                                padded_vocab_size=64, params_dtype="bfloat16", mlp_type="moe",
                                num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                                moe_grouped_gemm=True, moe_shared_expert_intermediate_size=64)
        ids = Tensor(np.arange(32).reshape(2, 16).astype(np.int32))
        GPTModel(cfg)(ids, labels=ids)
        # a KV-cache step: the flash kernel with an explicit mask (sparse_mode 0)
        q = Tensor(np.ones((2, 2, 1, 16), np.float32)).astype(bfloat16)
        kv = Tensor(np.ones((2, 1, 8, 16), np.float32)).astype(bfloat16)
        attention.cache_attention(q, kv, kv, Tensor(np.zeros((2, 1, 1, 8), bool)))
        return {name: list(calls.raw[name]) for name in KERNELS}


def _signature(name):
    if name == "gmm":
        assert gmm.__doc__.strip().splitlines()[0].strip().startswith(GMM_SIGNATURE)
        params = GMM_SIGNATURE[len("gmm("):-1]
        return inspect.signature(eval(f"lambda {params}: None"))   # noqa: S307 (a literal)
    return inspect.signature(KERNELS[name])


def _compile(kernel, args, kwargs):
    """``kernel(*args, **kwargs)`` under mindspore.jit; Tensors become graph inputs, everything
    else stays a constant, as in ms-llm's captured step."""
    slots = [i for i, a in enumerate(args) if isinstance(a, Tensor)]

    def call(*tensors):
        full = list(args)
        for j in range(len(slots)):
            full[slots[j]] = tensors[j]
        return kernel(*full, **kwargs)

    return ms.jit(call)(*[args[i] for i in slots])


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_recorded_calls_bind_to_the_real_signature(recorded, name):
    assert recorded[name], f"the fake-device run never called {name}"
    for args, kwargs in recorded[name]:
        _signature(name).bind(*args, **kwargs)


@pytest.mark.parametrize("name", ["flash_attention_score", "rms_norm", "swiglu",
                                  "rotary_position_embedding", "gmm", "bincount"])
def test_recorded_calls_compile_up_to_the_missing_cpu_kernel(recorded, name):
    seen = set()
    for args, kwargs in recorded[name]:
        key = (tuple(type(a).__name__ for a in args), tuple(sorted(kwargs.items(), key=str)))
        if str(key) in seen:      # one compile per distinct call form keeps this fast
            continue
        seen.add(str(key))
        with pytest.raises(RuntimeError, match="Kernel select failed"):
            _compile(KERNELS[name], args, kwargs)


def test_cross_entropy_call_runs_on_cpu_too(recorded):
    """mint's cross_entropy has a CPU graph kernel (not a PyNative one): the recorded call
    compiles, runs and matches the composed form the fake computed."""
    from ms_llm.ops.cross_entropy import cross_entropy_composed
    args, kwargs = recorded["cross_entropy"][0]
    got = _compile(KERNELS["cross_entropy"], args, kwargs)
    want = cross_entropy_composed(args[0], args[1], kwargs["ignore_index"])
    np.testing.assert_allclose(got.asnumpy(), want.asnumpy(), rtol=1e-5, atol=1e-6)


def test_a_wrong_argument_is_caught_before_kernel_selection():
    """The compile check can fail: a layout the kernel does not know stops at argument
    conversion, not at kernel selection."""
    q = Tensor(np.ones((1, 2, 4, 16), np.float32)).astype(bfloat16)
    with pytest.raises(ValueError, match="input_layout"):
        _compile(ops.flash_attention_score, (q, q, q, 2),
                 dict(input_layout="BNSDX", sparse_mode=2,
                      attn_mask=Tensor(np.zeros((2048, 2048), bool))))


def _doc(api) -> str:
    return " ".join(api.__doc__.split())


def test_documented_limits_ms_llm_relies_on():
    fa = _doc(ops.flash_attention_score)
    assert "D: Head size. The value ranges are a multiple of 16, with the max value of 512." in fa
    assert "The supported dtype is float16 and bfloat16." in fa
    assert "If data type of `x` is not the same as the data type of `gamma`" in _doc(ops.rms_norm)
    rope = _doc(ops.rotary_position_embedding)
    assert "removed after version 2.9.0" in rope
    assert "When the layout is BNSD, B * N > 8S and D is 32-byte alignment" in rope
    assert "D < 896 and D is Even. B, N < 1000" in rope
    g = _doc(gmm)
    assert "list[int] or tuple[int], it's length should be less than or equal to 128" in g
    assert "When `group_list` is a Tensor, it's size should be less than or equal to 1024" in g
