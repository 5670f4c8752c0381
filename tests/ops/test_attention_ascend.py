"""The Ascend flash-attention branch of ms_llm.ops.attention, exercised on CPU with a stand-in for
``ops.flash_attention_score`` that enforces the kernel's documented input contract (q/k/v fp16 or
bf16 of one dtype, bool mask of a documented shape, BNSD layout) and computes with the composed
attention. The real kernel has never run here; this checks what the branch hands to it and what
it returns to the model."""
import numpy as np
import pytest
from mindspore import Tensor, ops

from ms_llm.compat import bfloat16, bool_, float16, float32
from ms_llm.ops import attention as attn


def contract_checking_kernel(calls):
    def fake(q, k, v, head_num, attn_mask=None, scalar_value=1.0, input_layout="BSH",
             sparse_mode=0, **_):
        assert q.dtype in (float16, bfloat16), q.dtype
        assert k.dtype == q.dtype and v.dtype == q.dtype
        assert input_layout == "BNSD" and head_num == q.shape[1]
        assert attn_mask.dtype == bool_
        b, _, s, _ = q.shape
        if sparse_mode == 2:
            assert attn_mask.shape == (2048, 2048)
            mask = None
        else:
            assert sparse_mode == 0
            assert attn_mask.shape in ((s, s), (b, 1, s, s)), attn_mask.shape
            mask = attn_mask.reshape(-1, 1, s, s)
        calls.append((q.dtype, sparse_mode))
        out = attn.causal_attention_composed(q.astype(float32), k.astype(float32),
                                             v.astype(float32), scalar_value, mask)
        return out.astype(q.dtype)
    return fake


@pytest.mark.parametrize("dtype,compute,rtol", [(float32, bfloat16, 3e-2),
                                                (float16, float16, 3e-3),
                                                (bfloat16, bfloat16, 0)])
@pytest.mark.parametrize("masked", [False, True])
def test_flash_branch_casts_to_a_kernel_dtype_and_back(monkeypatch, dtype, compute, rtol,
                                                       masked):
    calls = []
    monkeypatch.setattr(ops, "flash_attention_score", contract_checking_kernel(calls))
    rng = np.random.default_rng(0)
    q, k, v = (Tensor(rng.standard_normal((2, h, 8, 16)).astype(np.float32)).astype(dtype)
               for h in (4, 2, 2))
    mask = None
    if masked:   # packed documents: two blocks of 4 tokens, causal inside each
        m = np.triu(np.ones((8, 8), bool), 1)
        m[4:, :4] = True
        mask = Tensor(m.reshape(1, 1, 8, 8))
    out = attn._flash_attention_ascend(q, k, v, 0.25, mask)
    assert out.dtype == dtype and out.shape == q.shape
    assert calls == [(compute, 0 if masked else 2)]
    want = attn.causal_attention_composed(q.astype(float32), k.astype(float32),
                                          v.astype(float32), 0.25, mask).asnumpy()
    np.testing.assert_allclose(out.astype(float32).asnumpy(), want, rtol=rtol,
                               atol=rtol or 2e-2)


def test_kernel_dtype_choice():
    assert attn._flash_attention_dtype(float32) == bfloat16
    assert attn._flash_attention_dtype(float16) == float16
    assert attn._flash_attention_dtype(bfloat16) == bfloat16
