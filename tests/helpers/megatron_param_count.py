"""The parameter count of a Megatron-Core GPT model from its launch flags, written from
Megatron-Core's module definitions (``TransformerLayer``, ``SelfAttention``, ``MLASelfAttention``,
``MoELayer``, ``MultiTokenPredictionLayer``) and MindSpeed-LLM's Qwen3-Next ones (gated full
attention, Gated DeltaNet, the shared expert's gate), independently of ms-llm's flag translation and
model code: the reference ``ms-llm plan``'s totals are checked against.

Conventions stated: MoE routers' ``expert_bias`` (``--moe-router-enable-expert-bias``) is
counted (ms-llm keeps it as a non-trainable parameter, Megatron as a buffer of the same size);
``--noop-layers`` hold no parameters (MindSpeed's ``NoopTransformerLayer``)."""
from __future__ import annotations

from typing import Dict, List, Sequence


def flag_values(argv: Sequence[str]) -> Dict[str, List[str]]:
    """``--flag v1 v2`` -> {"--flag": ["v1", "v2"]} (last occurrence wins; ``--f=v`` split)."""
    out: Dict[str, List[str]] = {}
    key = None
    for a in argv:
        if a.startswith("--"):
            key, _, val = a.partition("=")
            out[key] = [val] if val else []
        elif key is not None:
            out[key].append(a)
    return out


def megatron_parameter_count(argv: Sequence[str], vocab: int) -> Dict[str, int]:
    """Elements of every parameter: ``total``, of them in routed ``experts`` (cut over expert
    parallel), and the ``embedding`` (``vocab``: the padded vocabulary, when no flag gives
    it)."""
    f = flag_values(argv)

    def num(flag, default=None):
        return int(f[flag][0]) if flag in f else default

    h, layers = num("--hidden-size"), num("--num-layers")
    nh = num("--num-attention-heads")
    ng = num("--num-query-groups", nh) if "--group-query-attention" in f else nh
    d = num("--kv-channels", h // nh)
    ffn = num("--ffn-hidden-size", 4 * h)
    v = num("--padded-vocab-size", vocab)
    bias = "--disable-bias-linear" not in f
    glu = "--swiglu" in f
    noop = {int(x) for x in f.get("--noop-layers", [""])[0].split(",") if x} \
        if "--noop-layers" in f else set()

    def mlp(width: int) -> int:
        return h * width * (2 if glu else 1) + width * h + \
            ((width * (2 if glu else 1) + h) if bias else 0)

    if "--multi-latent-attention" in f:
        ql, kvl = num("--q-lora-rank"), num("--kv-lora-rank")
        qk, pe, vd = num("--qk-head-dim"), num("--qk-pos-emb-head-dim"), num("--v-head-dim")
        q = h * nh * (qk + pe) if ql is None else h * ql + ql + ql * nh * (qk + pe)
        attention = q + h * (kvl + pe) + kvl + kvl * nh * (qk + vd) + nh * vd * h
    else:
        attention = h * (nh + 2 * ng) * d + nh * d * h
        attention += (nh + 2 * ng) * d if "--add-qkv-bias" in f or bias else 0
        attention += h if bias else 0
        attention += 2 * d if "--qk-layernorm" in f else 0

    # MindSpeed-LLM's qwen3_next_spec: full attention's q_proj also yields the output gate
    # (nh x d more rows); every layer n (1-based) with n % --full-attention-interval != 0 is its
    # Gated DeltaNet instead: in_proj_qkvz, in_proj_ba, a depthwise conv1d (no bias), dt_bias,
    # A_log, the gated norm and out_proj (CustomQwen3NextGatedDeltaNetAttention)
    hybrid = "qwen3_next_spec" in " ".join(f.get("--spec", []))
    if hybrid:
        attention += nh * d * h
    interval = num("--full-attention-interval", 0)
    hk, hv = num("--linear-num-key-heads", 0), num("--linear-num-value-heads", 0)
    dk, dv = num("--linear-key-head-dim", 0), num("--linear-value-head-dim", 0)
    kd, vd_ = hk * dk, hv * dv
    linear = h * (2 * kd + 2 * vd_) + h * 2 * hv + (2 * kd + vd_) * num("--mamba-d-conv", 4) + \
        2 * hv + dv + vd_ * h
    is_linear = [bool(interval) and (i + 1) % interval != 0 for i in range(layers)]

    experts = num("--num-experts")
    if experts:
        fm = num("--moe-ffn-hidden-size", ffn)
        shared = num("--moe-shared-expert-intermediate-size") or \
            (num("--n-shared-experts", 0) * fm)
        routed = experts * mlp(fm)
        moe = experts * h + routed + (mlp(shared) if shared else 0)
        moe += h if shared and "--shared-expert-gate" in f else 0   # its gate_weight [1, h]
        moe += experts if "--moe-router-enable-expert-bias" in f else 0
        first_dense = num("--first-k-dense-replace", 0)
        freq = num("--moe-layer-freq", 1)
        is_moe = [i >= first_dense and i % freq == 0 for i in range(layers)]
    else:
        routed, moe, is_moe = 0, 0, [False] * layers

    def layer(i_moe: bool, i_linear: bool = False) -> int:
        return 2 * h + (linear if i_linear else attention) + (moe if i_moe else mlp(ffn))

    kept = [i for i in range(layers) if i not in noop]
    total = sum(layer(is_moe[i], is_linear[i]) for i in kept)
    total += h                                               # final norm
    total += v * h * (2 if "--untie-embeddings-and-output-weights" in f else 1)
    # multi-token prediction: enorm, hnorm, eh_proj [h, 2h], a layer (MoE as the last), a norm
    mtp = num("--mtp-num-layers", 0)
    total += mtp * (3 * h + 2 * h * h + layer(bool(experts)))
    return {"total": total, "embedding": v * h,
            "experts": routed * (sum(is_moe[i] for i in kept) + (mtp if experts else 0))}
