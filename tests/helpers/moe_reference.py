"""Independent float64 NumPy reference of Hugging Face's Qwen3-MoE causal LM, shared by the MoE
tests (test_moe, test_dcp_export_moe, test_inference).

Written from the HF modeling semantics (``modeling_qwen3_moe.py``), not from ms_llm code:

* ``Qwen3MoeSparseMoeBlock``: ``softmax(gate(x))`` over all experts -> top-k (stable order) ->
  divided by their sum iff ``norm_topk_prob`` -> weighted sum of
  ``down(silu(gate_proj x) * up_proj x)`` of the chosen experts;
* layer ``i`` is sparse iff ``i`` is not in ``mlp_only_layers`` and
  ``(i + 1) % decoder_sparse_step == 0``, otherwise a dense SwiGLU MLP;
* attention as Qwen3 (q/k RMSNorm per head before rotate-half RoPE, GQA, causal), pre-norm
  residual blocks, final RMSNorm and ``lm_head`` (``embed_tokens`` when tied).
"""
from __future__ import annotations

from typing import Dict, Tuple

import numpy as np


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def rope(x: np.ndarray, theta: float) -> np.ndarray:
    """Rotate-half RoPE on ``x`` [b, s, n, d], positions 0..s-1, ``emb = cat(freqs, freqs)``."""
    s, d = x.shape[1], x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    emb = np.concatenate([np.outer(np.arange(s), inv)] * 2, -1)
    cos, sin = np.cos(emb)[None, :, None], np.sin(emb)[None, :, None]
    rot = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos + rot * sin


def swiglu_mlp(x: np.ndarray, w: Dict[str, np.ndarray], prefix: str) -> np.ndarray:
    return (silu(x @ w[prefix + "gate_proj.weight"].T) * (x @ w[prefix + "up_proj.weight"].T)) \
        @ w[prefix + "down_proj.weight"].T


def sparse_moe_block(h: np.ndarray, w: Dict[str, np.ndarray], prefix: str, top_k: int,
                     norm_topk_prob: bool) -> Tuple[np.ndarray, ...]:
    """HF ``Qwen3MoeSparseMoeBlock`` of layer ``prefix`` (``model.layers.{i}.``) on flattened
    tokens ``h`` [T, H]: ``(out, router_logits, top [T, k], probs)``."""
    logits = h @ w[prefix + "mlp.gate.weight"].T
    probs = softmax(logits)
    top = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
    wts = np.take_along_axis(probs, top, -1)
    if norm_topk_prob:
        wts = wts / wts.sum(-1, keepdims=True)
    out = np.zeros_like(h)
    for e in range(logits.shape[-1]):   # expert-major, as HF loops over experts
        rows, slot = np.nonzero(top == e)
        if rows.size:
            out[rows] += swiglu_mlp(h[rows], w, f"{prefix}mlp.experts.{e}.") * \
                wts[rows, slot][:, None]
    return out, logits, top, probs


def is_sparse_layer(cfg: dict, i: int) -> bool:
    return i not in (cfg.get("mlp_only_layers") or []) and \
        (i + 1) % cfg.get("decoder_sparse_step", 1) == 0


def qwen3_moe_forward(w: Dict[str, np.ndarray], cfg: dict, ids: np.ndarray):
    """Float64 forward of the HF config ``cfg`` with weights ``w`` (HF names) on ``ids`` [b, s]:
    ``(logits [b, s, V], {sparse layer: (router_logits, top, probs)})``."""
    w = {k: np.asarray(v, np.float64) for k, v in w.items()}
    b, s = ids.shape
    nh, ng, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps, theta, k = cfg["rms_norm_eps"], cfg["rope_theta"], cfg["num_experts_per_tok"]
    causal = np.triu(np.ones((s, s), bool), 1)
    x = w["model.embed_tokens.weight"][ids]
    routing = {}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms_norm(x, w[p + "input_layernorm.weight"], eps)
        q = rms_norm((h @ w[p + "self_attn.q_proj.weight"].T).reshape(b, s, nh, d),
                     w[p + "self_attn.q_norm.weight"], eps)
        kk = rms_norm((h @ w[p + "self_attn.k_proj.weight"].T).reshape(b, s, ng, d),
                      w[p + "self_attn.k_norm.weight"], eps)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(b, s, ng, d)
        q, kk = rope(q, theta).transpose(0, 2, 1, 3), rope(kk, theta).transpose(0, 2, 1, 3)
        kk, v = np.repeat(kk, nh // ng, 1), np.repeat(v.transpose(0, 2, 1, 3), nh // ng, 1)
        sc = np.where(causal, -np.inf, q @ kk.transpose(0, 1, 3, 2) / np.sqrt(d))
        o = (softmax(sc) @ v).transpose(0, 2, 1, 3).reshape(b, s, nh * d)
        x = x + o @ w[p + "self_attn.o_proj.weight"].T
        h2 = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps).reshape(b * s, -1)
        if is_sparse_layer(cfg, i):
            out, logits, top, probs = sparse_moe_block(h2, w, p, k, cfg["norm_topk_prob"])
            routing[i] = (logits, top, probs)
        else:
            out = swiglu_mlp(h2, w, p + "mlp.")
        x = x + out.reshape(b, s, -1)
    lm = w["model.embed_tokens.weight" if cfg.get("tie_word_embeddings") else "lm_head.weight"]
    return rms_norm(x, w["model.norm.weight"], eps) @ lm.T, routing
