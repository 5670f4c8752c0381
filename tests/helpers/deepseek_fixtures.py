"""Tiny random DeepSeek-V3 / GLM-4.5 checkpoints built with transformers (test-only), and the
transformers reference numbers (logits, loss, grad norm, routing) for a batch.

Weights are re-drawn at unit scale (HF's 0.02 init makes the sigmoid router near 0.5 everywhere,
so routing would hinge on rounding); ``e_score_correction_bias`` is non-zero so the choice bias
is exercised; all in float32 with eager attention."""
from __future__ import annotations

import numpy as np

VOCAB = 96

DEEPSEEK_BASE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
    n_routed_experts=8,
    kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
    n_group=4, topk_group=2, num_experts_per_tok=3, first_k_dense_replace=1,
    routed_scaling_factor=2.5, max_position_embeddings=128, rms_norm_eps=1e-6,
    tie_word_embeddings=False)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
        "mscale": 1.0, "mscale_all_dim": 0.8, "rope_theta": 10000.0, "beta_fast": 32,
        "beta_slow": 1}
GLM_BASE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
    n_shared_experts=1, n_routed_experts=8, n_group=1, topk_group=1, num_experts_per_tok=2,
    first_k_dense_replace=1, routed_scaling_factor=1.5, partial_rotary_factor=0.5,
    attention_bias=True, use_qk_norm=True, max_position_embeddings=128, rms_norm_eps=1e-5,
    tie_word_embeddings=False)

CASES = {
    "deepseek_q_lora": ("deepseek_v3", dict(DEEPSEEK_BASE)),
    "deepseek_yarn_no_q_lora": ("deepseek_v3", dict(DEEPSEEK_BASE, q_lora_rank=None,
                                                    rope_parameters=YARN, norm_topk_prob=False)),
    "glm45": ("glm4_moe", dict(GLM_BASE)),
}


def build_hf(kind: str, kwargs: dict, seed: int = 0):
    import torch
    import transformers as tf
    torch.manual_seed(seed)
    if kind == "deepseek_v3":
        cfg = tf.DeepseekV3Config(**kwargs)
        model = tf.DeepseekV3ForCausalLM(cfg)
    else:
        cfg = tf.Glm4MoeConfig(**kwargs)
        model = tf.Glm4MoeForCausalLM(cfg)
    model.config._attn_implementation = "eager"
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:        # norms around 1, biases around 0
                if "norm" in name:
                    p.copy_(0.6 + 0.8 * torch.rand(p.shape, generator=g))
                else:
                    p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
            else:                  # fused experts [E, out, in]
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    return model.float().eval()


def batch(seed: int = 0, b: int = 2, s: int = 12):
    rng = np.random.default_rng(100 + seed)
    ids = rng.integers(0, VOCAB, size=(b, s)).astype(np.int64)
    labels = rng.integers(0, VOCAB, size=(b, s)).astype(np.int64)
    labels[0, :2] = -100
    return ids, labels


def hf_reference(model, ids: np.ndarray, labels: np.ndarray):
    """(logits [b, s, V], mean loss over valid labels, global grad norm, {layer: experts [T, k]
    sorted})."""
    import torch
    routes = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:
            hooks.append(gate.register_forward_hook(
                lambda m, inp, out, i=i: routes.__setitem__(i, out[2].detach().numpy())))
    model.zero_grad()
    logits = model(torch.tensor(ids)).logits
    lab = torch.tensor(labels)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             lab.reshape(-1), ignore_index=-100)
    loss.backward()
    norm = float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters()
                                if p.grad is not None)))
    for h in hooks:
        h.remove()
    return (logits.detach().double().numpy(), float(loss.detach()), norm,
            {i: np.sort(r, -1) for i, r in routes.items()})


def run_convert(*args) -> None:
    """``ms-llm convert`` in this process, arguments as a user types them; must succeed."""
    from ms_llm.checkpoint.convert import main as convert_main
    assert convert_main([str(a) for a in args]) == 0, args


def same_bits(a, b) -> bool:
    """Same dtype, shape and bytes (conversions must be bit-exact, NaN payloads included)."""
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(
        np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8))
