"""The tiny HF Qwen3-MoE folder of the conversion tests (3 layers, 4 experts top-2, layer 1 dense;
HF key names, ``config.json`` keys ``num_experts``, ``num_experts_per_tok``,
``moe_intermediate_size``, ``norm_topk_prob``, ``decoder_sparse_step``, ``mlp_only_layers``):
test_convert_moe's layouts and test_pretrained_run's MoE settings."""
from __future__ import annotations

import json
import os

import numpy as np
from safetensors.numpy import save_file

H, NH, NG, D, E, F, FFN, V, LAYERS = 32, 4, 2, 8, 4, 16, 24, 64, 3


def make_qwen3_moe(path, seed=0) -> dict:
    """Layers 0 and 2 are MoE; layer 1 is dense (``mlp_only_layers=[1]``)."""
    rng = np.random.default_rng(seed)
    r = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    w = {"model.embed_tokens.weight": r(V, H), "model.norm.weight": r(H), "lm_head.weight": r(V, H)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w.update({p + "input_layernorm.weight": r(H), p + "post_attention_layernorm.weight": r(H),
                  p + "self_attn.q_proj.weight": r(NH * D, H), p + "self_attn.k_proj.weight":
                  r(NG * D, H), p + "self_attn.v_proj.weight": r(NG * D, H),
                  p + "self_attn.o_proj.weight": r(H, NH * D), p + "self_attn.q_norm.weight": r(D),
                  p + "self_attn.k_norm.weight": r(D)})
        if i == 1:
            w.update({p + "mlp.gate_proj.weight": r(FFN, H), p + "mlp.up_proj.weight": r(FFN, H),
                      p + "mlp.down_proj.weight": r(H, FFN)})
        else:
            w[p + "mlp.gate.weight"] = r(E, H)
            for e in range(E):
                q = f"{p}mlp.experts.{e}."
                w.update({q + "gate_proj.weight": r(F, H), q + "up_proj.weight": r(F, H),
                          q + "down_proj.weight": r(H, F)})
    os.makedirs(path, exist_ok=True)
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
           "hidden_size": H, "intermediate_size": FFN, "moe_intermediate_size": F,
           "num_attention_heads": NH, "num_key_value_heads": NG, "head_dim": D,
           "num_hidden_layers": LAYERS, "num_experts": E, "num_experts_per_tok": 2,
           "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [1],
           "vocab_size": V, "tie_word_embeddings": False, "rms_norm_eps": 1e-6,
           "rope_theta": 1000000.0, "max_position_embeddings": 512, "attention_bias": False,
           "hidden_act": "silu", "torch_dtype": "float32"}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    save_file(w, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return w
