"""Tiny random Hugging Face checkpoint folders for tests (no torch, no transformers).

``make_hf_checkpoint`` writes ``config.json`` with the fields ``transformers`` itself writes for
``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM`` and the weights as
``model.safetensors`` (or HF-style shards plus ``model.safetensors.index.json``), using the HF
parameter names. It returns the float64 values that were actually stored, i.e. after rounding to
the storage dtype, so a reference computed from them is exact for what a loader reads.

Family semantics (as in HF modeling code):

* ``llama``: ``attention_bias`` puts a bias on q, k, v **and** o_proj; no QK-norm.
* ``qwen2``: q/k/v always have a bias, o_proj never has one; no QK-norm; no ``head_dim`` key
  (head_dim = hidden / heads).
* ``qwen3``: always has per-head ``q_norm`` / ``k_norm``; ``attention_bias`` like llama;
  an explicit ``head_dim`` that may differ from hidden / heads.
"""
from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

__all__ = ["make_hf_checkpoint", "load_config", "FAMILIES"]

FAMILIES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}

_STORAGE = {
    "float32": np.float32,
    "bfloat16": ml_dtypes.bfloat16,
    "float16": np.float16,
}


def load_config(dirpath) -> dict:
    with open(os.path.join(os.fspath(dirpath), "config.json")) as f:
        return json.load(f)


def _build_config(family, *, hidden, layers, heads, kv_heads, head_dim, ffn, vocab, tied,
                  attention_bias, dtype, rope_theta, rms_norm_eps, max_pos):
    arch, model_type = FAMILIES[family]
    cfg = {
        "architectures": [arch],
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": ffn,
        "max_position_embeddings": max_pos,
        "model_type": model_type,
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": rms_norm_eps,
        "rope_scaling": None,
        "rope_theta": rope_theta,
        "tie_word_embeddings": tied,
        "torch_dtype": dtype,
        "transformers_version": "4.51.0",
        "use_cache": True,
        "vocab_size": vocab,
    }
    if model_type == "llama":
        cfg.update({
            "attention_bias": attention_bias,
            "head_dim": head_dim,
            "mlp_bias": False,
            "pretraining_tp": 1,
        })
    elif model_type == "qwen2":
        cfg.update({
            "max_window_layers": layers,
            "sliding_window": max_pos,
            "use_sliding_window": False,
        })
    elif model_type == "qwen3":
        cfg.update({
            "attention_bias": attention_bias,
            "head_dim": head_dim,
            "max_window_layers": layers,
            "sliding_window": None,
            "use_sliding_window": False,
        })
    return dict(sorted(cfg.items()))


def make_hf_checkpoint(dirpath, family, *, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=None,
                       ffn=96, vocab=128, tied=False, qkv_bias=None, qk_norm=None, dtype="float32",
                       shards=1, seed=0, rope_theta=10000.0, rms_norm_eps=1e-6,
                       max_position_embeddings=2048) -> dict:
    """Write a tiny random HF checkpoint folder; return ``{hf_name: float64 ndarray}`` as stored.

    ``qkv_bias`` / ``qk_norm`` default to the family's fixed behaviour (qwen2: bias, qwen3:
    QK-norm). Combinations HF cannot express (qwen2 without bias, qwen3 without QK-norm, llama or
    qwen2 with QK-norm) raise ``ValueError``. For llama/qwen3 ``qkv_bias=True`` means
    ``attention_bias=True`` which, as in HF, also adds ``o_proj.bias``.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {sorted(FAMILIES)}")
    if dtype not in _STORAGE:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(_STORAGE)}")
    if heads % kv_heads:
        raise ValueError("heads must be a multiple of kv_heads")
    if qkv_bias is None:
        qkv_bias = family == "qwen2"
    if qk_norm is None:
        qk_norm = family == "qwen3"
    if family == "qwen2" and not qkv_bias:
        raise ValueError("HF Qwen2 always has q/k/v biases")
    if family == "qwen3" and not qk_norm:
        raise ValueError("HF Qwen3 always has q_norm/k_norm")
    if family != "qwen3" and qk_norm:
        raise ValueError(f"HF {family} has no QK-norm")
    if head_dim is None:
        head_dim = hidden // heads
    if family == "qwen2" and head_dim != hidden // heads:
        raise ValueError("HF Qwen2 has no head_dim key: head_dim must be hidden // heads")
    if shards < 1:
        raise ValueError("shards must be >= 1")

    rng = np.random.default_rng(seed)
    d, H, F, V = head_dim, hidden, ffn, vocab

    def lin(out_f, in_f):  # ~ unit-variance outputs for unit-variance inputs
        return rng.standard_normal((out_f, in_f)) / np.sqrt(in_f)

    def norm_w(n):  # around 1 but clearly not 1, so a dropped/misplaced norm weight shows
        return rng.uniform(0.6, 1.4, size=n)

    def bias(n):
        return 0.3 * rng.standard_normal(n)

    w = {"model.embed_tokens.weight": 0.3 * rng.standard_normal((V, H))}
    for i in range(layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm_w(H)
        w[p + "self_attn.q_proj.weight"] = lin(heads * d, H)
        w[p + "self_attn.k_proj.weight"] = lin(kv_heads * d, H)
        w[p + "self_attn.v_proj.weight"] = lin(kv_heads * d, H)
        if qkv_bias:
            w[p + "self_attn.q_proj.bias"] = bias(heads * d)
            w[p + "self_attn.k_proj.bias"] = bias(kv_heads * d)
            w[p + "self_attn.v_proj.bias"] = bias(kv_heads * d)
        if qk_norm:
            w[p + "self_attn.q_norm.weight"] = norm_w(d)
            w[p + "self_attn.k_norm.weight"] = norm_w(d)
        w[p + "self_attn.o_proj.weight"] = lin(H, heads * d)
        if qkv_bias and family != "qwen2":
            w[p + "self_attn.o_proj.bias"] = bias(H)
        w[p + "post_attention_layernorm.weight"] = norm_w(H)
        w[p + "mlp.gate_proj.weight"] = lin(F, H)
        w[p + "mlp.up_proj.weight"] = lin(F, H)
        w[p + "mlp.down_proj.weight"] = lin(H, F)
    w["model.norm.weight"] = norm_w(H)
    if not tied:
        w["lm_head.weight"] = lin(V, H)

    sdt = _STORAGE[dtype]
    stored = {k: np.ascontiguousarray(v.astype(np.float32).astype(sdt)) for k, v in w.items()}
    out = {k: v.astype(np.float64) for k, v in stored.items()}

    dirpath = os.fspath(dirpath)
    os.makedirs(dirpath, exist_ok=True)
    cfg = _build_config(family, hidden=H, layers=layers, heads=heads, kv_heads=kv_heads,
                        head_dim=d, ffn=F, vocab=V, tied=bool(tied), attention_bias=bool(qkv_bias),
                        dtype=dtype, rope_theta=float(rope_theta), rms_norm_eps=float(rms_norm_eps),
                        max_pos=int(max_position_embeddings))
    with open(os.path.join(dirpath, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")

    meta = {"format": "pt"}
    keys = list(stored)
    if shards == 1:
        save_file(stored, os.path.join(dirpath, "model.safetensors"), metadata=meta)
    else:
        groups = [list(g) for g in np.array_split(np.array(keys, dtype=object), shards)]
        weight_map = {}
        for j, g in enumerate(groups):
            fname = f"model-{j + 1:05d}-of-{shards:05d}.safetensors"
            save_file({k: stored[k] for k in g}, os.path.join(dirpath, fname), metadata=meta)
            weight_map.update({k: fname for k in g})
        index = {
            "metadata": {"total_size": int(sum(v.nbytes for v in stored.values()))},
            "weight_map": dict(sorted(weight_map.items())),
        }
        with open(os.path.join(dirpath, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
            f.write("\n")
    return out
