"""The small models and the step-by-step decode loop of the fused decode tests (the one-token
step, test_decode_fast, and the whole-model step, test_decode_model_step): the attention
variants the fused kernels cover, built on CPU with random norm weights."""
from __future__ import annotations

import numpy as np
from mindspore import Tensor

from ms_llm.compat import manual_seed, no_grad, setup_device
from ms_llm.inference import KVCache
from ms_llm.models import GPTModel, TransformerConfig, family_defaults, fused_decode

V = 96


def build(family: str = "llama", **over) -> GPTModel:
    setup_device("CPU")
    manual_seed(over.pop("seed", 0))
    kw = dict(family_defaults(family), num_layers=2, hidden_size=64, ffn_hidden_size=96,
              num_attention_heads=4, num_query_groups=2, kv_channels=16, padded_vocab_size=V,
              max_position_embeddings=256, init_method_std=0.3)
    kw.update(over)
    model = GPTModel(TransformerConfig(**kw))
    # random norm weights, so an offset or a swapped weight shows
    for name, p in model.parameters_and_names():
        if name.endswith("layernorm.weight"):
            p.set_data(Tensor(np.random.default_rng(len(name)).uniform(0.5, 1.5, p.shape)
                              .astype(np.float32)))
    model.set_train(False)
    return model


VARIANTS = {
    "llama-mha": dict(num_query_groups=4),
    "qwen25-gqa-bias": dict(family="qwen25", add_bias_linear=True),
    "qwen3-mqa-qknorm": dict(family="qwen3", num_query_groups=1),
    "gated-zero-centred-partial-rope": dict(family="qwen3", attention_output_gate=True,
                                           layernorm_zero_centered_gamma=True,
                                           rotary_percent=0.5),
    "moe": dict(family="qwen3", mlp_type="moe", num_moe_experts=4, moe_router_topk=2,
                moe_ffn_hidden_size=32),
    "qwen3-next-hybrid": dict(family="qwen3", attention_output_gate=True,
                              layernorm_zero_centered_gamma=True, rotary_percent=0.25,
                              layer_types=["gated_delta_net", "attention"],
                              linear_key_head_dim=8, linear_value_head_dim=8,
                              linear_num_key_heads=2, linear_num_value_heads=4),
}


def step_logits(model, prompts, mask, steps: int, fused: bool):
    """Prefill, then ``steps`` one-token steps feeding fixed tokens; each step's logits."""
    before = fused_decode.set_enabled(fused)
    try:
        b, s = prompts.shape
        cache = KVCache.for_model(model, b, s + steps)
        cache.mark_padding(~mask)
        pos = np.maximum(np.cumsum(mask, 1) - 1, 0)
        padded = not mask.all()
        out = []
        with no_grad():
            model(Tensor(prompts.astype(np.int32)), kv_cache=cache, logits_to_keep=1,
                  position_ids=Tensor(pos.astype(np.int32)) if padded else None)
            nxt = pos[:, -1] + 1
            for t in range(steps):
                cache.mark_padding(np.zeros((b, 1), bool))
                tok = np.full((b, 1), 7 * t + 3, np.int32)
                p = Tensor((nxt + t)[:, None].astype(np.int32)) if padded else None
                out.append(model(Tensor(tok), kv_cache=cache, position_ids=p,
                                 logits_to_keep=1).asnumpy()[:, -1])
        return np.stack(out, 1), cache
    finally:
        fused_decode.set_enabled(before)
