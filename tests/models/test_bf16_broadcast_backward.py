"""bf16 training on CPU through the layers whose backward sums over a broadcast: MLA's shared
rope key (one per token, every head), Gated DeltaNet's key heads repeated for the value heads
and its causal conv weights, and the gated shared expert's per-token gate. MindSpore 2.10 has no
bf16 ReduceSum kernel on CPU, so these sums run in fp32 (``F.broadcast_to``, an fp32 conv); the
published MindSpeed scripts of DeepSeek-V2-Lite and Qwen3-Next train with --bf16.

Reference: the same model in float32 with the same (bf16-representable) weights; gradients agree
to bf16 rounding (rtol 0.1 on the gradient norm per parameter, atol 1e-2 absolute)."""
import numpy as np
import pytest
import mindspore as ms

from ms_llm.compat import F
from ms_llm.models import TransformerConfig
from ms_llm.models.gpt import GPTModel
from ms_llm.models.registry import get_family


def test_broadcast_to_backward_sums_a_bf16_input():
    x = ms.Tensor(np.arange(6, dtype=np.float32).reshape(2, 1, 3)).astype(ms.bfloat16)
    g = ms.grad(lambda t: F.broadcast_to(t, (2, 4, 3)).astype(ms.float32).sum())(x)
    assert g.dtype == ms.bfloat16
    np.testing.assert_array_equal(g.astype(ms.float32).asnumpy(), np.full((2, 1, 3), 4.0))


# top-k = every expert: no discrete routing choice that bf16 rounding could flip (a flipped
# choice moves a whole expert's gradient, far beyond rounding; seen with top-2 on some weights)
SMALL = dict(num_layers=1, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
             padded_vocab_size=64, max_position_embeddings=64, num_moe_experts=4,
             moe_router_topk=4, moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=32)
CASES = {
    "qwen3-next gated delta net": ("qwen3-next", dict(
        layer_types=["gated_delta_net"], num_query_groups=2, kv_channels=16,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_chunk_size=16)),
    "deepseek-v2 mla, no query lora": ("deepseek-v2", dict(
        kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16)),
}


def _grads(cfg, state, ids):
    m = GPTModel(cfg)
    for p in m.trainable_params():
        p.set_data(ms.Tensor(state[p.name]).astype(p.dtype))
    params = m.trainable_params()
    g = ms.grad(lambda: m(ids).astype(ms.float32).sum(), grad_position=None, weights=params)()
    return {p.name: x.astype(ms.float32).asnumpy() for p, x in zip(params, g)}


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("case", sorted(CASES))
def test_bf16_gradients_match_fp32(case, seed):
    family, extra = CASES[case]
    ms.set_seed(seed)       # the weights do not depend on which tests ran before in this process
    kw = dict(get_family(family).defaults, **SMALL, **extra)
    fp32 = TransformerConfig(**kw)
    init = GPTModel(fp32)
    # weights rounded to bf16 once, so both runs start from the same numbers
    state = {p.name: p.astype(ms.bfloat16).astype(ms.float32).asnumpy()
             for p in init.trainable_params()}
    ids = ms.Tensor(np.random.default_rng(0).integers(0, 64, (1, 32)).astype(np.int32))
    want = _grads(fp32, state, ids)
    got = _grads(fp32.replace(params_dtype="bfloat16"), state, ids)
    assert set(got) == set(want)
    for name in want:
        assert np.all(np.isfinite(got[name])), name
        scale = np.linalg.norm(want[name]) + 1e-2
        assert np.linalg.norm(got[name] - want[name]) <= 0.1 * scale, name
