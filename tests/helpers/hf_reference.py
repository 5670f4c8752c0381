"""Independent float64 NumPy reference of the HF Llama / Qwen2 / Qwen3 causal LM.

Written from the Hugging Face modeling semantics (``modeling_llama.py`` / ``modeling_qwen2.py`` /
``modeling_qwen3.py``), not from ms_llm code, with a hand-written backward (no autograd library).

Forward, per decoder layer (pre-norm):

    h   = RMSNorm(x; input_layernorm)
    q,k,v = h Wq^T (+bq), h Wk^T (+bk), h Wv^T (+bv)         # [b, s, n, d]
    q,k = RMSNorm_d(q; q_norm), RMSNorm_d(k; k_norm)          # Qwen3 only, per head, BEFORE RoPE
    q,k = RoPE(q), RoPE(k)                                    # rotate-half, positions 0..s-1
    o   = softmax(q k^T / sqrt(d) + causal) v                 # GQA: query head j uses kv head j // (nh/nkv)
    x   = x + o Wo^T (+bo)
    x   = x + down(silu(gate h2) * up h2),  h2 = RMSNorm(x; post_attention_layernorm)
    logits = RMSNorm(x; model.norm) W_lm^T                    # W_lm = embed_tokens if tied

``RMSNorm(x; w) = x / sqrt(mean(x^2) + eps) * w``; ``inv_freq = 1 / theta^(arange(0, d, 2) / d)``,
``emb = cat(freqs, freqs)``, ``RoPE(x) = x cos + rotate_half(x) sin``, ``rotate_half([x1, x2]) =
[-x2, x1]``.

Biases follow HF: Qwen2 has q/k/v biases and no o bias; Llama/Qwen3 ``attention_bias`` puts a
bias on q, k, v and o. The presence of a bias/q_norm is read from the config (``model_type``,
``attention_bias``) and cross-checked against the weight dict.

Loss convention (Megatron, matching ``model(ids, labels=labels)``): ``labels[b, t]`` is the target
of position ``t`` — no internal shift (HF's ``labels=`` argument shifts; use
:func:`shift_labels` to turn HF-style labels into this convention). The loss is the mean
cross-entropy over positions whose label is not ``ignore_index``.
"""
from __future__ import annotations

import numpy as np

__all__ = ["ModelSpec", "spec_from_config", "forward", "loss", "per_token_loss",
           "loss_and_grads", "shift_labels", "global_grad_norm"]


class ModelSpec:
    def __init__(self, cfg: dict):
        self.model_type = cfg["model_type"]
        if self.model_type not in ("llama", "qwen2", "qwen3"):
            raise ValueError(f"unsupported model_type {self.model_type!r}")
        self.hidden = int(cfg["hidden_size"])
        self.layers = int(cfg["num_hidden_layers"])
        self.nh = int(cfg["num_attention_heads"])
        self.nkv = int(cfg.get("num_key_value_heads") or self.nh)
        hd = cfg.get("head_dim")
        self.d = int(hd) if hd else self.hidden // self.nh
        self.eps = float(cfg["rms_norm_eps"])
        self.theta = float(cfg.get("rope_theta", 10000.0))
        self.vocab = int(cfg["vocab_size"])
        self.tied = bool(cfg.get("tie_word_embeddings", False))
        if cfg.get("rope_scaling"):
            raise NotImplementedError("reference implements default RoPE only")
        self.qk_norm = self.model_type == "qwen3"
        if self.model_type == "qwen2":
            self.qkv_bias, self.o_bias = True, False
        else:
            ab = bool(cfg.get("attention_bias", False))
            self.qkv_bias, self.o_bias = ab, ab
        assert self.nh % self.nkv == 0
        self.group = self.nh // self.nkv


def spec_from_config(cfg) -> ModelSpec:
    return cfg if isinstance(cfg, ModelSpec) else ModelSpec(cfg)


def shift_labels(labels, ignore_index=-100):
    """HF-style labels (== input_ids) -> per-position targets: out[:, t] = labels[:, t + 1]."""
    labels = np.asarray(labels)
    out = np.full_like(labels, ignore_index)
    out[:, :-1] = labels[:, 1:]
    return out


# ----------------------------------------------------------------------------- building blocks

def _rms_fwd(x, w, eps):
    r = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return x * r * w, (x, r, w)


def _rms_bwd(dy, cache):
    x, r, w = cache
    dw = (dy * x * r).reshape(-1, x.shape[-1]).sum(0)
    g = dy * w
    dx = r * g - (r ** 3) * x * np.mean(g * x, axis=-1, keepdims=True)
    return dx, dw


def _rope_tables(s, d, theta):
    inv_freq = 1.0 / (theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    freqs = np.outer(np.arange(s, dtype=np.float64), inv_freq)  # [s, d/2]
    emb = np.concatenate([freqs, freqs], axis=-1)  # [s, d]
    return np.cos(emb), np.sin(emb)


def _rotate_half(x):
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def _rope_fwd(x, cos, sin):  # x [b, s, n, d], cos/sin [s, d]
    c, s_ = cos[None, :, None, :], sin[None, :, None, :]
    return x * c + _rotate_half(x) * s_


def _rope_bwd(dy, cos, sin):  # transpose of the rotation: R^T = -R
    c, s_ = cos[None, :, None, :], sin[None, :, None, :]
    return dy * c - _rotate_half(dy * s_)


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _lm_weight(weights, spec):
    if spec.tied:
        return weights["model.embed_tokens.weight"]
    return weights["lm_head.weight"]


def _check_keys(weights, spec):
    for i in range(spec.layers):
        p = f"model.layers.{i}.self_attn."
        for n in ("q", "k", "v"):
            has = p + f"{n}_proj.bias" in weights
            if has != spec.qkv_bias:
                raise KeyError(f"{p}{n}_proj.bias presence {has} != config ({spec.qkv_bias})")
        if (p + "o_proj.bias" in weights) != spec.o_bias:
            raise KeyError(f"{p}o_proj.bias presence does not match config")
        if (p + "q_norm.weight" in weights) != spec.qk_norm:
            raise KeyError(f"{p}q_norm.weight presence does not match model_type")
    if not spec.tied and "lm_head.weight" not in weights:
        raise KeyError("lm_head.weight missing for an untied model")


# ----------------------------------------------------------------------------- forward

def _forward(weights, spec, input_ids, keep):
    W = {k: np.asarray(v, dtype=np.float64) for k, v in weights.items()}
    ids = np.asarray(input_ids).astype(np.int64)
    b, s = ids.shape
    nh, nkv, d, g = spec.nh, spec.nkv, spec.d, spec.group
    cos, sin = _rope_tables(s, d, spec.theta)
    mask = np.triu(np.ones((s, s), dtype=bool), k=1)  # True = masked (future)
    scale = 1.0 / np.sqrt(d)
    caches = []

    x = W["model.embed_tokens.weight"][ids]  # [b, s, H]
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        c = {}
        h, c["ln1"] = _rms_fwd(x, W[p + "input_layernorm.weight"], spec.eps)
        q = h @ W[p + "self_attn.q_proj.weight"].T
        k = h @ W[p + "self_attn.k_proj.weight"].T
        v = h @ W[p + "self_attn.v_proj.weight"].T
        if spec.qkv_bias:
            q = q + W[p + "self_attn.q_proj.bias"]
            k = k + W[p + "self_attn.k_proj.bias"]
            v = v + W[p + "self_attn.v_proj.bias"]
        q = q.reshape(b, s, nh, d)
        k = k.reshape(b, s, nkv, d)
        v = v.reshape(b, s, nkv, d)
        if spec.qk_norm:
            q, c["qn"] = _rms_fwd(q, W[p + "self_attn.q_norm.weight"], spec.eps)
            k, c["kn"] = _rms_fwd(k, W[p + "self_attn.k_norm.weight"], spec.eps)
        q = _rope_fwd(q, cos, sin)
        k = _rope_fwd(k, cos, sin)
        qh = q.transpose(0, 2, 1, 3)  # [b, nh, s, d]
        kh = np.repeat(k.transpose(0, 2, 1, 3), g, axis=1)  # head j -> kv head j // g
        vh = np.repeat(v.transpose(0, 2, 1, 3), g, axis=1)
        sc = (qh @ kh.transpose(0, 1, 3, 2)) * scale
        sc = np.where(mask, -np.inf, sc)
        sc = sc - sc.max(-1, keepdims=True)
        e = np.exp(sc)
        pr = e / e.sum(-1, keepdims=True)
        o = (pr @ vh).transpose(0, 2, 1, 3).reshape(b, s, nh * d)
        attn = o @ W[p + "self_attn.o_proj.weight"].T
        if spec.o_bias:
            attn = attn + W[p + "self_attn.o_proj.bias"]
        c.update(h=h, qh=qh, kh=kh, vh=vh, pr=pr, o=o)
        x = x + attn
        h2, c["ln2"] = _rms_fwd(x, W[p + "post_attention_layernorm.weight"], spec.eps)
        gt = h2 @ W[p + "mlp.gate_proj.weight"].T
        up = h2 @ W[p + "mlp.up_proj.weight"].T
        a = _silu(gt) * up
        x = x + a @ W[p + "mlp.down_proj.weight"].T
        c.update(h2=h2, gt=gt, up=up, a=a)
        if keep:
            caches.append(c)
    hf, cf = _rms_fwd(x, W["model.norm.weight"], spec.eps)
    logits = hf @ _lm_weight(W, spec).T
    return logits, dict(W=W, ids=ids, caches=caches, hf=hf, cf=cf, cos=cos, sin=sin)


def forward(weights, cfg, input_ids):
    """Logits ``[b, s, V]`` (float64) of the HF causal LM."""
    spec = spec_from_config(cfg)
    _check_keys(weights, spec)
    return _forward(weights, spec, input_ids, keep=False)[0]


def _log_softmax(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def per_token_loss(weights, cfg, input_ids, labels, ignore_index=-100):
    """Per-position CE ``[b, s]`` (0 where the label is ignored)."""
    logits = forward(weights, cfg, input_ids)
    labels = np.asarray(labels).astype(np.int64)
    valid = labels != ignore_index
    lp = _log_softmax(logits)
    tgt = np.where(valid, labels, 0)
    nll = -np.take_along_axis(lp, tgt[..., None], axis=-1)[..., 0]
    return np.where(valid, nll, 0.0)


def loss(weights, cfg, input_ids, labels, ignore_index=-100):
    """Mean CE over positions with ``labels != ignore_index`` (labels NOT shifted)."""
    labels = np.asarray(labels)
    n = int((labels != ignore_index).sum())
    if n == 0:
        raise ValueError("all labels are ignored")
    return float(per_token_loss(weights, cfg, input_ids, labels, ignore_index).sum() / n)


# ----------------------------------------------------------------------------- backward

def loss_and_grads(weights, cfg, input_ids, labels, ignore_index=-100):
    """``(loss, {hf_name: dloss/dparam})`` with a hand-written backward, float64."""
    spec = spec_from_config(cfg)
    _check_keys(weights, spec)
    logits, st = _forward(weights, spec, input_ids, keep=True)
    W, ids, caches = st["W"], st["ids"], st["caches"]
    cos, sin = st["cos"], st["sin"]
    b, s = ids.shape
    nh, nkv, d, g, H = spec.nh, spec.nkv, spec.d, spec.group, spec.hidden
    scale = 1.0 / np.sqrt(d)
    grads = {k: np.zeros_like(v) for k, v in W.items()}

    # cross-entropy
    labels = np.asarray(labels).astype(np.int64)
    valid = labels != ignore_index
    n = int(valid.sum())
    if n == 0:
        raise ValueError("all labels are ignored")
    tgt = np.where(valid, labels, 0)
    lp = _log_softmax(logits)
    nll = -np.take_along_axis(lp, tgt[..., None], axis=-1)[..., 0]
    L = float(np.where(valid, nll, 0.0).sum() / n)
    dlogits = np.exp(lp)
    np.put_along_axis(dlogits, tgt[..., None],
                      np.take_along_axis(dlogits, tgt[..., None], axis=-1) - 1.0, axis=-1)
    dlogits *= valid[..., None] / n

    # lm head + final norm
    hf = st["hf"]
    dWlm = dlogits.reshape(-1, spec.vocab).T @ hf.reshape(-1, H)
    if spec.tied:
        grads["model.embed_tokens.weight"] += dWlm
    else:
        grads["lm_head.weight"] += dWlm
    dx, grads["model.norm.weight"] = _rms_bwd(dlogits @ _lm_weight(W, spec), st["cf"])

    for i in reversed(range(spec.layers)):
        p = f"model.layers.{i}."
        c = caches[i]
        # MLP: x_out = x_mid + a Wd^T
        dm = dx
        grads[p + "mlp.down_proj.weight"] = dm.reshape(-1, H).T @ c["a"].reshape(-1, c["a"].shape[-1])
        da = dm @ W[p + "mlp.down_proj.weight"]
        gt, up = c["gt"], c["up"]
        sg = _sigmoid(gt)
        dup = da * (gt * sg)
        dgt = da * up * (sg * (1.0 + gt * (1.0 - sg)))
        h2f = c["h2"].reshape(-1, H)
        grads[p + "mlp.gate_proj.weight"] = dgt.reshape(-1, gt.shape[-1]).T @ h2f
        grads[p + "mlp.up_proj.weight"] = dup.reshape(-1, up.shape[-1]).T @ h2f
        dh2 = dgt @ W[p + "mlp.gate_proj.weight"] + dup @ W[p + "mlp.up_proj.weight"]
        dxn, grads[p + "post_attention_layernorm.weight"] = _rms_bwd(dh2, c["ln2"])
        dx = dx + dxn

        # attention: x_mid = x_in + o Wo^T (+bo)
        dattn = dx
        grads[p + "self_attn.o_proj.weight"] = dattn.reshape(-1, H).T @ c["o"].reshape(-1, nh * d)
        if spec.o_bias:
            grads[p + "self_attn.o_proj.bias"] = dattn.reshape(-1, H).sum(0)
        do = (dattn @ W[p + "self_attn.o_proj.weight"]).reshape(b, s, nh, d).transpose(0, 2, 1, 3)
        pr, qh, kh, vh = c["pr"], c["qh"], c["kh"], c["vh"]
        dpr = do @ vh.transpose(0, 1, 3, 2)
        dvh = pr.transpose(0, 1, 3, 2) @ do
        dsc = pr * (dpr - (dpr * pr).sum(-1, keepdims=True))  # masked entries have pr == 0
        dqh = (dsc @ kh) * scale
        dkh = (dsc.transpose(0, 1, 3, 2) @ qh) * scale
        # un-expand GQA: heads j = kv * g + r  ->  sum over r
        dk = dkh.reshape(b, nkv, g, s, d).sum(2).transpose(0, 2, 1, 3)  # [b, s, nkv, d]
        dv = dvh.reshape(b, nkv, g, s, d).sum(2).transpose(0, 2, 1, 3)
        dq = dqh.transpose(0, 2, 1, 3)  # [b, s, nh, d]
        dq = _rope_bwd(dq, cos, sin)
        dk = _rope_bwd(dk, cos, sin)
        if spec.qk_norm:
            dq, grads[p + "self_attn.q_norm.weight"] = _rms_bwd(dq, c["qn"])
            dk, grads[p + "self_attn.k_norm.weight"] = _rms_bwd(dk, c["kn"])
        dq = dq.reshape(b, s, nh * d)
        dk = dk.reshape(b, s, nkv * d)
        dv = dv.reshape(b, s, nkv * d)
        hfl = c["h"].reshape(-1, H)
        for name, dt in (("q", dq), ("k", dk), ("v", dv)):
            grads[p + f"self_attn.{name}_proj.weight"] = dt.reshape(-1, dt.shape[-1]).T @ hfl
            if spec.qkv_bias:
                grads[p + f"self_attn.{name}_proj.bias"] = dt.reshape(-1, dt.shape[-1]).sum(0)
        dh = (dq @ W[p + "self_attn.q_proj.weight"] + dk @ W[p + "self_attn.k_proj.weight"]
              + dv @ W[p + "self_attn.v_proj.weight"])
        dxn, grads[p + "input_layernorm.weight"] = _rms_bwd(dh, c["ln1"])
        dx = dx + dxn

    np.add.at(grads["model.embed_tokens.weight"], ids.reshape(-1), dx.reshape(-1, H))
    return L, grads


def global_grad_norm(grads) -> float:
    return float(np.sqrt(sum(float((np.asarray(v, dtype=np.float64) ** 2).sum())
                             for v in grads.values())))
