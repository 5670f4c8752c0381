"""A tiny random HF Qwen3-MoE folder (8 experts, top-2, 3 layers with layer 1 dense through
``mlp_only_layers``) written with HF's key names and ``config.json`` fields, and its float64
forward (``moe_reference``): shared by the MoE layer tests and the inference tests."""
from __future__ import annotations

import json
import os

import numpy as np
from safetensors.numpy import save_file

from . import moe_reference

H, NH, NG, D, E, K, FM, FFN, V, LAYERS = 32, 4, 2, 8, 8, 2, 16, 48, 96, 3
EPS, THETA, AUX_COEF = 1e-6, 1000000.0, 0.02


def hf_config(norm_topk_prob: bool, dense_layers=(1,)) -> dict:
    """The tiny checkpoint's HF ``config.json``."""
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
           "attention_bias": False, "attention_dropout": 0.0, "decoder_sparse_step": 1,
           "head_dim": D, "hidden_act": "silu", "hidden_size": H, "intermediate_size": FFN,
           "max_position_embeddings": 512, "mlp_only_layers": list(dense_layers),
           "moe_intermediate_size": FM, "norm_topk_prob": norm_topk_prob,
           "num_attention_heads": NH, "num_experts": E, "num_experts_per_tok": K,
           "num_hidden_layers": LAYERS, "num_key_value_heads": NG, "output_router_logits": True,
           "rms_norm_eps": EPS, "rope_scaling": None, "rope_theta": THETA,
           "router_aux_loss_coef": AUX_COEF, "tie_word_embeddings": False,
           "torch_dtype": "float32", "vocab_size": V}


def write_qwen3_moe(path, norm_topk_prob: bool, seed: int = 0, dense_layers=(1,)) -> dict:
    """A tiny random HF Qwen3-MoE folder; returns the stored tensors as float64."""
    rng = np.random.default_rng(seed)

    def lin(o, i):
        return rng.standard_normal((o, i)) / np.sqrt(i)

    def norm_w(n):
        return rng.uniform(0.6, 1.4, size=n)

    w = {"model.embed_tokens.weight": rng.standard_normal((V, H)),
         "model.norm.weight": norm_w(H), "lm_head.weight": lin(V, H)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w.update({p + "input_layernorm.weight": norm_w(H),
                  p + "post_attention_layernorm.weight": norm_w(H),
                  p + "self_attn.q_proj.weight": lin(NH * D, H),
                  p + "self_attn.k_proj.weight": lin(NG * D, H),
                  p + "self_attn.v_proj.weight": lin(NG * D, H),
                  p + "self_attn.o_proj.weight": lin(H, NH * D),
                  p + "self_attn.q_norm.weight": norm_w(D),
                  p + "self_attn.k_norm.weight": norm_w(D)})
        if i in dense_layers:
            w.update({p + "mlp.gate_proj.weight": lin(FFN, H), p + "mlp.up_proj.weight":
                      lin(FFN, H), p + "mlp.down_proj.weight": lin(H, FFN)})
        else:
            w[p + "mlp.gate.weight"] = 2.0 * lin(E, H)   # confident-ish routing: clear top-k gaps
            for e in range(E):
                q = f"{p}mlp.experts.{e}."
                w.update({q + "gate_proj.weight": lin(FM, H), q + "up_proj.weight": lin(FM, H),
                          q + "down_proj.weight": lin(H, FM)})
    stored = {k: np.ascontiguousarray(v.astype(np.float32)) for k, v in w.items()}
    cfg = hf_config(norm_topk_prob, dense_layers)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    save_file(stored, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return {k: v.astype(np.float64) for k, v in stored.items()}


def reference_forward(w, ids, norm_topk_prob, dense_layers=(1,)):
    """Float64 HF Qwen3-MoE forward (tests/moe_reference.py):
    (logits, {layer: (router_logits, top_idx, probs)})."""
    return moe_reference.qwen3_moe_forward(w, hf_config(norm_topk_prob, dense_layers), ids)
