"""Per-family HF <-> Megatron-Core (local spec) tensor layouts with tp / pp / vpp / ep splits.

Every conversion goes through one *full* per-layer form: Megatron-Core local-spec keys relative to
``decoder.layers.{i}.`` at tp = ep = 1, with MoE experts under their global id
(``mlp.experts.local_experts.{e}``). ``hf_layer_to_full`` / ``full_layer_to_hf`` translate names
and fuse QKV / gate-up; ``shard_layer`` / ``merge_layer`` apply and undo tensor and expert
parallelism (and the ``--moe-grouped-gemm`` layout). Working one layer at a time is what keeps
conversion memory at the size of a layer, not of the model.

Layout rules (Megatron-Core's local spec and its legacy checkpoint loader):

* ``linear_qkv``: per KV group ``[q(nh/ng*d) k(d) v(d)]``; tp rank r holds groups
  ``[r*ng/tp, (r+1)*ng/tp)`` (a contiguous dim-0 chunk).
* ``linear_fc1``: tp rank r holds ``[gate_r; up_r]`` (r-th chunks of gate and up).
* ``linear_proj`` / ``linear_fc2``: dim-1 chunks; norms and the router are replicated.
* word embeddings / output layer: vocab (dim 0) chunks after zero-padding the vocab.
* experts: ep rank q holds global experts ``[q*E/ep, (q+1)*E/ep)`` as local ids ``0..E/ep-1``;
  expert linears split over tp like the dense MLP (expert-tensor-parallel size = tp).
  Grouped GEMM: ``weight1 = stack_e([gate_r; up_r]_e.T)`` ([E_l, H, 2F/tp]) stored
  ``reshape(H, -1)``; ``weight2 = stack_e(fc2_e[:, r-chunk].T)`` ([E_l, F/tp, H]) stored
  ``reshape(-1, H)`` -- the memory layout Megatron's ``GroupedMLP`` views back.
* Megatron's ``state_dict()`` has ``<linear>._extra_state = None`` for every parallel linear
  (and the output layer); shards carry them so Megatron can load with ``strict=True``.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from . import layouts_deepseek as DS
from . import layouts_mtp as MTP

MODEL_TYPES = {  # --model-type-hf -> (family, config.json model_type)
    "llama2": ("llama", "llama"), "llama3": ("llama", "llama"), "llama": ("llama", "llama"),
    "qwen25": ("qwen25", "qwen2"), "qwen2.5": ("qwen25", "qwen2"), "qwen2": ("qwen25", "qwen2"),
    "qwen3": ("qwen3", "qwen3"), "qwen3-moe": ("qwen3-moe", "qwen3_moe"),
    "qwen3_moe": ("qwen3-moe", "qwen3_moe"),
    "deepseek3": ("deepseek-v3", "deepseek_v3"), "deepseek-v3": ("deepseek-v3", "deepseek_v3"),
    "deepseek_v3": ("deepseek-v3", "deepseek_v3"), "glm45": ("glm45", "glm4_moe"),
    "glm45-moe": ("glm45", "glm4_moe"), "glm4_moe": ("glm45", "glm4_moe"),
}
# config.json model_type -> the --model-type-hf name used when none is given.
HF_MODEL_TYPE_DEFAULTS = {"llama": "llama2", "qwen2": "qwen25", "qwen3": "qwen3",
                          "qwen3_moe": "qwen3-moe", "deepseek_v3": "deepseek3",
                          "glm4_moe": "glm45"}
EXTRA = "_extra_state"


@dataclass
class ModelSpec:
    """Architecture facts the layouts need (from an HF ``config.json``)."""

    family: str
    num_layers: int
    hidden: int
    ffn: int
    heads: int
    groups: int
    head_dim: int
    vocab: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool
    num_experts: int = 0
    moe_ffn: int = 0
    moe_topk: int = 0
    moe_layers: Tuple[bool, ...] = ()
    # DeepSeek-V3 / GLM-4.5 (layouts_deepseek): MLA dims, shared experts, expert bias, MTP.
    mla: bool = False
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope: int = 0
    qk_rope: int = 0
    v_head: int = 0
    attn_bias: bool = False
    shared_ffn: int = 0
    expert_bias: bool = False
    mtp_layers: int = 0

    def is_moe(self, hf_layer: int) -> bool:
        """``hf_layer >= num_layers``: an MTP layer, built like the last decoder layer."""
        return bool(self.moe_layers) and self.moe_layers[min(hf_layer, self.num_layers - 1)]


def spec_from_hf_config(cfg: dict, model_type_hf: str, source: str = "config.json") -> ModelSpec:
    """Validate ``config.json`` against ``--model-type-hf`` and extract the layout facts."""
    if model_type_hf not in MODEL_TYPES:
        raise ValueError(f"--model-type-hf: {model_type_hf!r} is not supported; choose from "
                         f"{sorted(MODEL_TYPES)}")
    family, want = MODEL_TYPES[model_type_hf]
    got = cfg.get("model_type")
    if got != want:
        raise ValueError(f"{source}: model_type is {got!r} but --model-type-hf {model_type_hf} "
                         f"expects {want!r} (wrong --model-type-hf for these weights?)")
    try:
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        spec = ModelSpec(
            family=family, num_layers=int(cfg["num_hidden_layers"]), hidden=hidden,
            ffn=int(cfg["intermediate_size"]), heads=heads,
            groups=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads), vocab=int(cfg["vocab_size"]),
            tied=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen25", qk_norm=family in ("qwen3", "qwen3-moe"))
    except KeyError as e:
        raise ValueError(f"{source}: missing key {e.args[0]!r}") from None
    if family in ("deepseek-v3", "glm45"):
        try:
            for k, v in DS.spec_fields(cfg, family).items():
                setattr(spec, k, v)
        except KeyError as e:
            raise ValueError(f"{source}: missing key {e.args[0]!r}") from None
        return spec
    if cfg.get("attention_bias") and family != "qwen25":
        raise ValueError(f"{source}: attention_bias=true (biases on o_proj too) has no Megatron "
                         f"local-spec equivalent here")
    if spec.heads % spec.groups:
        raise ValueError(f"{source}: num_attention_heads {spec.heads} is not a multiple of "
                         f"num_key_value_heads {spec.groups}")
    if family == "qwen3-moe":
        try:
            spec.num_experts = int(cfg["num_experts"])
            spec.moe_ffn = int(cfg["moe_intermediate_size"])
            spec.moe_topk = int(cfg.get("num_experts_per_tok", 0))
        except KeyError as e:
            raise ValueError(f"{source}: missing key {e.args[0]!r}") from None
        step = int(cfg.get("decoder_sparse_step", 1) or 1)
        only_mlp = set(cfg.get("mlp_only_layers") or [])
        spec.moe_layers = tuple(i not in only_mlp and spec.num_experts > 0 and (i + 1) % step == 0
                                for i in range(spec.num_layers))
    return spec


# --------------------------------------------------------------------------------------------
# Parallel layout
# --------------------------------------------------------------------------------------------

@dataclass
class ParallelLayout:
    """How a Megatron checkpoint is split: tp, pp (optionally uneven and with noop layers),
    virtual pipeline chunks, ep, the expert weight layout and the padded vocabulary."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    vpp_layers: Optional[int] = None          # --num-layers-per-virtual-pipeline-stage
    num_layer_list: Optional[List[int]] = None
    noop_layers: Tuple[int, ...] = ()
    grouped_gemm: bool = False
    padded_vocab: int = 0
    _chunks: list = field(default_factory=list, repr=False)

    @property
    def vpp(self) -> int:
        return len(self._chunks[0]) if self._chunks else 1

    def validate(self, spec: ModelSpec, where: str = "") -> None:
        """Check divisibility and build the (pp rank, vpp chunk) -> layers map."""
        w = where or "layout"
        for name, v in (("tensor", self.tp), ("pipeline", self.pp), ("expert", self.ep)):
            if v < 1:
                raise ValueError(f"{w}: {name}-parallel size must be >= 1, got {v}")
        if spec.groups % self.tp or spec.heads % self.tp:
            raise ValueError(f"{w}: tensor-parallel size {self.tp} must divide the query groups "
                             f"({spec.groups}) and heads ({spec.heads})")
        if spec.mla and spec.heads % self.tp:
            raise ValueError(f"{w}: tensor-parallel size {self.tp} must divide the heads "
                             f"({spec.heads})")
        if spec.shared_ffn % self.tp:
            raise ValueError(f"{w}: tensor-parallel size {self.tp} must divide the shared "
                             f"experts' FFN size ({spec.shared_ffn})")
        if spec.ffn % self.tp:
            raise ValueError(f"{w}: tensor-parallel size {self.tp} must divide "
                             f"intermediate_size ({spec.ffn})")
        if self.padded_vocab % self.tp or self.padded_vocab < spec.vocab:
            raise ValueError(f"{w}: tensor-parallel size {self.tp} does not divide the vocabulary "
                             f"({self.padded_vocab}); pass --make-vocab-size-divisible-by")
        if spec.num_experts:
            if spec.num_experts % self.ep:
                raise ValueError(f"{w}: expert-parallel size {self.ep} must divide num_experts "
                                 f"({spec.num_experts})")
            if spec.moe_ffn % self.tp:
                raise ValueError(f"{w}: tensor-parallel size {self.tp} must divide "
                                 f"moe_intermediate_size ({spec.moe_ffn})")
        elif self.ep != 1:
            raise ValueError(f"{w}: expert-parallel size {self.ep} needs a MoE model")
        MTP.validate_mtp(spec, self, w)
        n = spec.num_layers + len(self.noop_layers)
        if any(not 0 <= i < n for i in self.noop_layers) or \
                len(set(self.noop_layers)) != len(self.noop_layers):
            raise ValueError(f"{w}: --noop-layers {list(self.noop_layers)} must be distinct layer "
                             f"ids in [0, {n})")
        if self.num_layer_list is not None:
            if self.vpp_layers:
                raise ValueError(f"{w}: --num-layer-list and virtual pipeline stages cannot be "
                                 f"combined")
            if len(self.num_layer_list) != self.pp or sum(self.num_layer_list) != n or \
                    min(self.num_layer_list) < 1:
                raise ValueError(f"{w}: --num-layer-list {self.num_layer_list} must have "
                                 f"{self.pp} positive entries summing to {n} layers")
            starts = np.cumsum([0] + self.num_layer_list)
            self._chunks = [[list(range(starts[p], starts[p + 1]))] for p in range(self.pp)]
        elif self.vpp_layers:
            per = self.vpp_layers
            if per < 1 or n % (self.pp * per):
                raise ValueError(f"{w}: {n} layers cannot be split into pipeline size {self.pp} x "
                                 f"virtual stages of {per} layers")
            v = n // (self.pp * per)
            self._chunks = [[list(range((c * self.pp + p) * per, (c * self.pp + p + 1) * per))
                             for c in range(v)] for p in range(self.pp)]
        else:
            if n % self.pp:
                raise ValueError(f"{w}: {n} layers are not divisible by pipeline size {self.pp}; "
                                 f"pass --num-layer-list")
            per = n // self.pp
            self._chunks = [[list(range(p * per, (p + 1) * per))] for p in range(self.pp)]

    def chunks(self) -> List[Tuple[int, int, List[int]]]:
        """``(pp_rank, vpp_chunk, [Megatron layer ids])`` in model order."""
        out = [(p, c, layers) for p in range(self.pp)
               for c, layers in enumerate(self._chunks[p])]
        return sorted(out, key=lambda x: x[2][0] if x[2] else 0)

    def hf_layer(self, mg_layer: int) -> Optional[int]:
        """HF layer of a Megatron layer id (``None`` for a noop layer)."""
        if mg_layer in self.noop_layers:
            return None
        return mg_layer - sum(1 for i in self.noop_layers if i < mg_layer)

    def first_chunk(self) -> Tuple[int, int]:
        return (0, 0)

    def last_chunk(self) -> Tuple[int, int]:
        return (self.pp - 1, len(self._chunks[self.pp - 1]) - 1)


def padded_vocab_size(vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron's ``_vocab_size_with_padding``; ``divisible_by`` 0/None means no padding."""
    if not divisible_by:
        return vocab
    mult = divisible_by * tp
    return -(-vocab // mult) * mult


# --------------------------------------------------------------------------------------------
# HF <-> full layer
# --------------------------------------------------------------------------------------------

def _fuse_qkv(q, k, v, ng):
    tail = q.shape[1:]
    return np.concatenate([q.reshape(ng, -1, *tail), k.reshape(ng, -1, *tail),
                           v.reshape(ng, -1, *tail)], axis=1).reshape(-1, *tail)


def _split_qkv(qkv, nh, ng, d):
    tail = qkv.shape[1:]
    g = qkv.reshape(ng, (nh // ng + 2) * d, *tail)
    qd = nh // ng * d
    return (g[:, :qd].reshape(-1, *tail), g[:, qd:qd + d].reshape(-1, *tail),
            g[:, qd + d:].reshape(-1, *tail))


def hf_layer_names(spec: ModelSpec, i: int) -> List[Tuple[str, tuple]]:
    """HF tensor names and shapes of layer ``i`` in HF module order."""
    p, H, d = f"model.layers.{i}.", spec.hidden, spec.head_dim
    if spec.mla:
        return DS.mla_hf_names(spec, p) + _mlp_hf_names(spec, i, p)
    out = [(p + "self_attn.q_proj.weight", (spec.heads * d, H))]
    if spec.qkv_bias:
        out.append((p + "self_attn.q_proj.bias", (spec.heads * d,)))
    out.append((p + "self_attn.k_proj.weight", (spec.groups * d, H)))
    if spec.qkv_bias:
        out.append((p + "self_attn.k_proj.bias", (spec.groups * d,)))
    out.append((p + "self_attn.v_proj.weight", (spec.groups * d, H)))
    if spec.qkv_bias:
        out.append((p + "self_attn.v_proj.bias", (spec.groups * d,)))
    out.append((p + "self_attn.o_proj.weight", (H, spec.heads * d)))
    if spec.qk_norm:
        out += [(p + "self_attn.q_norm.weight", (d,)), (p + "self_attn.k_norm.weight", (d,))]
    return out + _mlp_hf_names(spec, i, p)


def _mlp_hf_names(spec: ModelSpec, i: int, p: str) -> List[Tuple[str, tuple]]:
    H, out = spec.hidden, []
    if spec.is_moe(i):
        F = spec.moe_ffn
        out.append((p + "mlp.gate.weight", (spec.num_experts, H)))
        out += DS.moe_extra_hf_names(spec, p)
        for e in range(spec.num_experts):
            q = f"{p}mlp.experts.{e}."
            out += [(q + "gate_proj.weight", (F, H)), (q + "up_proj.weight", (F, H)),
                    (q + "down_proj.weight", (H, F))]
    else:
        F = spec.ffn
        out += [(p + "mlp.gate_proj.weight", (F, H)), (p + "mlp.up_proj.weight", (F, H)),
                (p + "mlp.down_proj.weight", (H, F))]
    out += [(p + "input_layernorm.weight", (H,)), (p + "post_attention_layernorm.weight", (H,))]
    return out


def hf_names(spec: ModelSpec) -> List[Tuple[str, tuple]]:
    """All HF tensor names and shapes in the order ``save_pretrained`` writes them."""
    out = [("model.embed_tokens.weight", (spec.vocab, spec.hidden))]
    for i in range(spec.num_layers):
        out += hf_layer_names(spec, i)
    for j in range(spec.mtp_layers):
        out += MTP.mtp_hf_names(spec, j, hf_layer_names)
    out.append(("model.norm.weight", (spec.hidden,)))
    if not spec.tied:
        out.append(("lm_head.weight", (spec.vocab, spec.hidden)))
    return out


def hf_layer_to_full(spec: ModelSpec, get: Callable[[str], np.ndarray], i: int) -> Dict:
    """HF tensors of layer ``i`` -> full Megatron layer (relative keys, global expert ids)."""
    p, ng = f"model.layers.{i}.", spec.groups
    a = p + "self_attn."
    full = OrderedDict()
    full["input_layernorm.weight"] = get(p + "input_layernorm.weight")
    if spec.mla:
        full.update(DS.mla_hf_to_full(spec, get, p))
        return _mlp_hf_to_full(spec, get, i, p, full)
    full["self_attention.linear_proj.weight"] = get(a + "o_proj.weight")
    full["self_attention.linear_qkv.weight"] = _fuse_qkv(
        get(a + "q_proj.weight"), get(a + "k_proj.weight"), get(a + "v_proj.weight"), ng)
    if spec.qkv_bias:
        full["self_attention.linear_qkv.bias"] = _fuse_qkv(
            get(a + "q_proj.bias"), get(a + "k_proj.bias"), get(a + "v_proj.bias"), ng)
    if spec.qk_norm:
        full["self_attention.q_layernorm.weight"] = get(a + "q_norm.weight")
        full["self_attention.k_layernorm.weight"] = get(a + "k_norm.weight")
    return _mlp_hf_to_full(spec, get, i, p, full)


def _mlp_hf_to_full(spec: ModelSpec, get: Callable[[str], np.ndarray], i: int, p: str,
                    full: Dict) -> Dict:
    full["pre_mlp_layernorm.weight"] = get(p + "post_attention_layernorm.weight")
    if spec.is_moe(i):
        full["mlp.router.weight"] = get(p + "mlp.gate.weight")
        full.update(DS.moe_extra_hf_to_full(spec, get, p))
        for e in range(spec.num_experts):
            q, m = f"{p}mlp.experts.{e}.", f"mlp.experts.local_experts.{e}."
            full[m + "linear_fc1.weight"] = np.concatenate(
                [get(q + "gate_proj.weight"), get(q + "up_proj.weight")], axis=0)
            full[m + "linear_fc2.weight"] = get(q + "down_proj.weight")
    else:
        full["mlp.linear_fc1.weight"] = np.concatenate(
            [get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")], axis=0)
        full["mlp.linear_fc2.weight"] = get(p + "mlp.down_proj.weight")
    return full


def full_layer_to_hf(spec: ModelSpec, full: Dict, i: int) -> Dict[str, np.ndarray]:
    """Inverse of ``hf_layer_to_full`` (HF names of layer ``i``)."""
    p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
    hf = {p + "input_layernorm.weight": full["input_layernorm.weight"],
          a + "o_proj.weight": full["self_attention.linear_proj.weight"],
          p + "post_attention_layernorm.weight": full["pre_mlp_layernorm.weight"]}
    if spec.mla:
        del hf[a + "o_proj.weight"]
        hf.update(DS.mla_full_to_hf(spec, full, p))
        return _mlp_full_to_hf(spec, full, i, p, hf)
    q, k, v = _split_qkv(full["self_attention.linear_qkv.weight"], spec.heads, spec.groups,
                         spec.head_dim)
    hf.update({a + "q_proj.weight": q, a + "k_proj.weight": k, a + "v_proj.weight": v})
    if spec.qkv_bias:
        q, k, v = _split_qkv(full["self_attention.linear_qkv.bias"], spec.heads, spec.groups,
                             spec.head_dim)
        hf.update({a + "q_proj.bias": q, a + "k_proj.bias": k, a + "v_proj.bias": v})
    if spec.qk_norm:
        hf[a + "q_norm.weight"] = full["self_attention.q_layernorm.weight"]
        hf[a + "k_norm.weight"] = full["self_attention.k_layernorm.weight"]
    return _mlp_full_to_hf(spec, full, i, p, hf)


def _mlp_full_to_hf(spec: ModelSpec, full: Dict, i: int, p: str, hf: Dict) -> Dict:
    if spec.is_moe(i):
        hf[p + "mlp.gate.weight"] = full["mlp.router.weight"]
        hf.update(DS.moe_extra_full_to_hf(spec, full, p))
        for e in range(spec.num_experts):
            m = f"mlp.experts.local_experts.{e}."
            fc1 = full[m + "linear_fc1.weight"]
            F = fc1.shape[0] // 2
            hf[f"{p}mlp.experts.{e}.gate_proj.weight"] = fc1[:F]
            hf[f"{p}mlp.experts.{e}.up_proj.weight"] = fc1[F:]
            hf[f"{p}mlp.experts.{e}.down_proj.weight"] = full[m + "linear_fc2.weight"]
    else:
        fc1 = full["mlp.linear_fc1.weight"]
        F = fc1.shape[0] // 2
        hf[p + "mlp.gate_proj.weight"] = fc1[:F]
        hf[p + "mlp.up_proj.weight"] = fc1[F:]
        hf[p + "mlp.down_proj.weight"] = full["mlp.linear_fc2.weight"]
    return hf


# --------------------------------------------------------------------------------------------
# full layer <-> tp / ep shards
# --------------------------------------------------------------------------------------------

def _fc1_shard(fc1: np.ndarray, tp: int, r: int) -> np.ndarray:
    gate, up = np.split(fc1, 2, axis=0)
    return np.concatenate([np.split(gate, tp, axis=0)[r], np.split(up, tp, axis=0)[r]], axis=0)


def _fc1_merge(parts: List[np.ndarray]) -> np.ndarray:
    halves = [np.split(x, 2, axis=0) for x in parts]
    return np.concatenate([h[0] for h in halves] + [h[1] for h in halves], axis=0)


def shard_layer(spec: ModelSpec, lay: ParallelLayout, full: Dict, hf_layer: int
                ) -> Dict[Tuple[int, int], "OrderedDict[str, Optional[np.ndarray]]"]:
    """Full layer -> ``{(tp_rank, ep_rank): relative keys in Megatron state-dict order}``."""
    tp, ep = lay.tp, lay.ep
    out = {}
    for t in range(tp):
        dense = OrderedDict()
        dense["input_layernorm.weight"] = full["input_layernorm.weight"]
        if spec.mla:
            dense.update(DS.mla_shard(spec, full, tp, t))
        else:
            _attention_shard(spec, full, tp, t, dense)
        dense["pre_mlp_layernorm.weight"] = full["pre_mlp_layernorm.weight"]
        if not spec.is_moe(hf_layer):
            dense["mlp.linear_fc1.weight"] = _fc1_shard(full["mlp.linear_fc1.weight"], tp, t)
            dense["mlp.linear_fc1." + EXTRA] = None
            dense["mlp.linear_fc2.weight"] = np.split(full["mlp.linear_fc2.weight"], tp,
                                                      axis=1)[t]
            dense["mlp.linear_fc2." + EXTRA] = None
            for q in range(ep):
                out[(t, q)] = dense
            continue
        n_local = spec.num_experts // ep
        for q in range(ep):
            sd = OrderedDict(dense)
            sd["mlp.router.weight"] = full["mlp.router.weight"]
            sd.update(DS.moe_extra_shard(spec, full, tp, t, _fc1_shard))
            _experts_shard(spec, lay, full, t, q, n_local, sd)
            out[(t, q)] = sd
    return out


def _attention_shard(spec: ModelSpec, full: Dict, tp: int, t: int, dense: Dict) -> None:
    dense["self_attention.linear_proj.weight"] = np.split(
        full["self_attention.linear_proj.weight"], tp, axis=1)[t]
    dense["self_attention.linear_proj." + EXTRA] = None
    dense["self_attention.linear_qkv.weight"] = np.split(
        full["self_attention.linear_qkv.weight"], tp, axis=0)[t]
    if spec.qkv_bias:
        dense["self_attention.linear_qkv.bias"] = np.split(
            full["self_attention.linear_qkv.bias"], tp, axis=0)[t]
    dense["self_attention.linear_qkv." + EXTRA] = None
    if spec.qk_norm:
        dense["self_attention.q_layernorm.weight"] = full["self_attention.q_layernorm.weight"]
        dense["self_attention.k_layernorm.weight"] = full["self_attention.k_layernorm.weight"]


def _experts_shard(spec: ModelSpec, lay: ParallelLayout, full: Dict, t: int, q: int,
                   n_local: int, sd: Dict) -> None:
    tp = lay.tp
    fc1 = [_fc1_shard(full[f"mlp.experts.local_experts.{q * n_local + j}.linear_fc1."
                           f"weight"], tp, t) for j in range(n_local)]
    fc2 = [np.split(full[f"mlp.experts.local_experts.{q * n_local + j}.linear_fc2."
                         f"weight"], tp, axis=1)[t] for j in range(n_local)]
    if lay.grouped_gemm:
        H = spec.hidden
        sd["mlp.experts.weight1"] = np.ascontiguousarray(
            np.stack([w.T for w in fc1])).reshape(H, -1)
        sd["mlp.experts.weight2"] = np.ascontiguousarray(
            np.stack([w.T for w in fc2])).reshape(-1, H)
    else:
        for j in range(n_local):
            m = f"mlp.experts.local_experts.{j}."
            sd[m + "linear_fc1.weight"] = fc1[j]
            sd[m + "linear_fc1." + EXTRA] = None
            sd[m + "linear_fc2.weight"] = fc2[j]
            sd[m + "linear_fc2." + EXTRA] = None


def merge_layer(spec: ModelSpec, lay: ParallelLayout, part: Callable[[int, int, str], np.ndarray],
                hf_layer: int) -> Dict:
    """Inverse of ``shard_layer``: ``part(tp_rank, ep_rank, relative_key)`` reads one shard."""
    tp = lay.tp
    full = OrderedDict()
    full["input_layernorm.weight"] = part(0, 0, "input_layernorm.weight")
    if spec.mla:
        full.update(DS.mla_merge(spec, part, tp))
    else:
        _attention_merge(spec, part, tp, full)
    full["pre_mlp_layernorm.weight"] = part(0, 0, "pre_mlp_layernorm.weight")
    if not spec.is_moe(hf_layer):
        full["mlp.linear_fc1.weight"] = _fc1_merge([part(t, 0, "mlp.linear_fc1.weight")
                                                    for t in range(tp)])
        full["mlp.linear_fc2.weight"] = np.concatenate(
            [part(t, 0, "mlp.linear_fc2.weight") for t in range(tp)], axis=1)
        return full
    full["mlp.router.weight"] = part(0, 0, "mlp.router.weight")
    full.update(DS.moe_extra_merge(spec, part, tp, _fc1_merge))
    _experts_merge(spec, lay, part, full)
    return full


def _attention_merge(spec: ModelSpec, part, tp: int, full: Dict) -> None:
    full["self_attention.linear_proj.weight"] = np.concatenate(
        [part(t, 0, "self_attention.linear_proj.weight") for t in range(tp)], axis=1)
    full["self_attention.linear_qkv.weight"] = np.concatenate(
        [part(t, 0, "self_attention.linear_qkv.weight") for t in range(tp)], axis=0)
    if spec.qkv_bias:
        full["self_attention.linear_qkv.bias"] = np.concatenate(
            [part(t, 0, "self_attention.linear_qkv.bias") for t in range(tp)], axis=0)
    if spec.qk_norm:
        full["self_attention.q_layernorm.weight"] = part(0, 0, "self_attention.q_layernorm.weight")
        full["self_attention.k_layernorm.weight"] = part(0, 0, "self_attention.k_layernorm.weight")


def _experts_merge(spec: ModelSpec, lay: ParallelLayout, part, full: Dict) -> None:
    tp, n_local, H = lay.tp, spec.num_experts // lay.ep, spec.hidden
    for q in range(lay.ep):
        if lay.grouped_gemm:
            w1 = [part(t, q, "mlp.experts.weight1").reshape(n_local, H, -1) for t in range(tp)]
            w2 = [part(t, q, "mlp.experts.weight2").reshape(n_local, -1, H) for t in range(tp)]
            fc1 = [[w1[t][j].T for t in range(tp)] for j in range(n_local)]
            fc2 = [[w2[t][j].T for t in range(tp)] for j in range(n_local)]
        else:
            fc1 = [[part(t, q, f"mlp.experts.local_experts.{j}.linear_fc1.weight")
                    for t in range(tp)] for j in range(n_local)]
            fc2 = [[part(t, q, f"mlp.experts.local_experts.{j}.linear_fc2.weight")
                    for t in range(tp)] for j in range(n_local)]
        for j in range(n_local):
            m = f"mlp.experts.local_experts.{q * n_local + j}."
            full[m + "linear_fc1.weight"] = np.ascontiguousarray(_fc1_merge(fc1[j]))
            full[m + "linear_fc2.weight"] = np.ascontiguousarray(np.concatenate(fc2[j], axis=1))


# --------------------------------------------------------------------------------------------
# Embedding, final norm, output layer
# --------------------------------------------------------------------------------------------

def pad_vocab(w: np.ndarray, padded: int) -> np.ndarray:
    """Zero rows up to ``padded`` (the padding rows never score: their logits are 0)."""
    if w.shape[0] == padded:
        return w
    return np.concatenate([w, np.zeros((padded - w.shape[0],) + w.shape[1:], w.dtype)], axis=0)


def vocab_shards(w: np.ndarray, lay: ParallelLayout) -> List[np.ndarray]:
    return np.split(pad_vocab(w, lay.padded_vocab), lay.tp, axis=0)


def vocab_merge(parts: List[np.ndarray], vocab: int) -> np.ndarray:
    return np.concatenate(parts, axis=0)[:vocab]
