"""What a checkpoint layout needs to know about a model (``ModelSpec``, derived from the family's
one parse of ``config.json``) and how a Megatron checkpoint is split (``ParallelLayout``).

``spec_from_hf_config`` is the only way a ``ModelSpec`` is made from a ``config.json``: the
family registry (``ms_llm.models.registry``) translates the config into a TransformerConfig, and
the layout facts are read off that (plus the facts only the folder has: MTP depths, MLA
biases), so a loaded model and a converted checkpoint can never disagree about the architecture.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Tuple

import numpy as np

from ..config import TransformerConfig
from ..mixers import mixers_used
from ..registry import FamilySpec, families, family_for_config, get_family
from . import mtp as MTP


def megatron_names() -> Dict[str, str]:
    """``--model-type-hf`` name (MindSpeed-LLM's) -> family name, for every registered family."""
    return {n: s.name for s in families() for n in s.megatron_names}


def default_megatron_name(model_type: Optional[str]) -> Optional[str]:
    """The ``--model-type-hf`` name used for a ``config.json`` ``model_type`` when none is given."""
    for s in families():
        if s.hf_model_type == model_type:
            return s.convert_name
    return None


def family_of(model_type_hf: str) -> FamilySpec:
    """The family of a ``--model-type-hf`` name (one line listing the choices otherwise)."""
    known = megatron_names()
    if model_type_hf not in known:
        raise ValueError(f"--model-type-hf: {model_type_hf!r} is not supported; choose from "
                         f"{sorted(known)}")
    return get_family(known[model_type_hf])



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
    # DeepSeek-V3 / GLM-4.5 (mla, moe): MLA dims, shared experts, expert bias, MTP.
    mla: bool = False
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope: int = 0
    qk_rope: int = 0
    v_head: int = 0
    attn_bias: bool = False
    shared_ffn: int = 0
    expert_bias: bool = False
    # Qwen3-Next: the shared expert's sigmoid gate (Megatron ``mlp.shared_experts.gate_weight``,
    # HF ``mlp.shared_expert_gate.weight``) and the HF prefix of the shared expert.
    shared_gate: bool = False
    hf_shared: str = "mlp.shared_experts."
    # Gated DeltaNet sizes (key heads, value heads, key / value head dims, conv kernel).
    linear: Tuple[int, ...] = ()
    mtp_layers: int = 0
    # Where HF keeps the MTP depths (mtp): "layers" = DeepSeek's model.layers.{L + j};
    # "mtp" = Qwen3-Next's / Qwen3.5's mtp.* (one depth).
    mtp_hf: str = "layers"
    # Layout of the MTP layers; empty: the last decoder layer's (a hybrid model's MTP layer is
    # full attention whatever its last decoder layer is).
    mtp_kind: str = ""
    # Checkpoint layout name of each decoder layer (``kinds.LAYER_KINDS``); empty: every layer
    # "mla" when ``mla`` else "attention". The config the spec was read from (None when built
    # by hand).
    layer_kinds: Tuple[str, ...] = ()
    config: Optional[TransformerConfig] = field(default=None, repr=False, compare=False)

    def is_moe(self, hf_layer: int) -> bool:
        """``hf_layer >= num_layers``: an MTP layer, built like the last decoder layer."""
        return bool(self.moe_layers) and self.moe_layers[min(hf_layer, self.num_layers - 1)]



    def kind(self, hf_layer: int) -> str:
        """Layout name of layer ``hf_layer`` (an MTP layer is built like the last decoder
        layer)."""
        if hf_layer >= self.num_layers and self.mtp_kind:
            return self.mtp_kind
        if self.layer_kinds:
            return self.layer_kinds[min(hf_layer, self.num_layers - 1)]
        return "mla" if self.mla else "attention"

    @classmethod
    def from_config(cls, family: str, c: TransformerConfig, kinds: Tuple[str, ...] = (),
                    **extras) -> "ModelSpec":
        """The layout facts of a TransformerConfig; ``extras``: facts only a folder has."""
        moe, mla = c.mlp_type == "moe", c.multi_latent_attention
        return cls(
            family=family, num_layers=c.num_layers, hidden=c.hidden_size,
            ffn=c.ffn_hidden_size, heads=c.num_attention_heads, groups=c.num_query_groups,
            head_dim=c.kv_channels, vocab=c.padded_vocab_size,
            tied=not c.untie_embeddings_and_output_weights, qkv_bias=c.add_qkv_bias,
            qk_norm=c.qk_layernorm, num_experts=(c.num_moe_experts or 0) if moe else 0,
            moe_ffn=c.moe_ffn_hidden_size if moe else 0,
            moe_topk=c.moe_router_topk if moe else 0,
            moe_layers=tuple(c.is_moe_layer(i) for i in range(c.num_layers)) if moe else (),
            mla=mla, q_lora_rank=(c.q_lora_rank or 0) if mla else 0,
            kv_lora_rank=c.kv_lora_rank if mla else 0, qk_nope=c.qk_head_dim if mla else 0,
            qk_rope=c.qk_pos_emb_head_dim if mla else 0, v_head=c.v_head_dim if mla else 0,
            shared_ffn=(c.moe_shared_expert_intermediate_size or 0) if moe else 0,
            expert_bias=bool(moe and c.moe_router_enable_expert_bias),
            shared_gate=bool(moe and c.moe_shared_expert_gate),
            linear=_layout_sizes(c),
            layer_kinds=tuple(kinds), config=c, **extras)


def _layout_sizes(c: TransformerConfig) -> Tuple[int, ...]:
    """``ModelSpec.linear``: the sizes the config's token mixers give their checkpoint layouts
    beyond the attention ones (``MixerKind.layout_sizes``: Gated DeltaNet's), or ()."""
    sizes = [k.layout_sizes(c) for k in mixers_used(c) if k.layout_sizes is not None]
    if len(sizes) > 1:
        raise ValueError(f"model.layer_types: {len(sizes)} kinds with their own layout sizes "
                         f"in one model (ModelSpec.linear holds one)")
    return tuple(sizes[0]) if sizes else ()


def export_family(config: TransformerConfig, model_type_hf: Optional[str] = None
                  ) -> Tuple[FamilySpec, str]:
    """The family an exported TransformerConfig is written as and its ``--model-type-hf`` name:
    the registry's guess, or the family ``model_type_hf`` names when that family also describes
    the config (one line otherwise)."""
    guess = family_for_config(config)
    if model_type_hf is None:
        return guess, guess.convert_name
    named = family_of(model_type_hf)
    moe = config.mlp_type == "moe"
    if named is guess or named.claims(config):
        return named, model_type_hf
    if moe and not named.is_moe:
        raise ValueError(f"export: model_type_hf {model_type_hf!r} cannot hold a MoE model "
                         f"(mlp_type 'moe' exports as {guess.convert_name})")
    if named.is_moe and not moe:
        raise ValueError(f"export: model_type_hf {model_type_hf!r} needs a MoE model (mlp_type "
                         f"is {config.mlp_type!r})")
    raise ValueError(f"export: model_type_hf {model_type_hf!r} cannot hold this model (it "
                     f"exports as {guess.convert_name})")


def spec_of_config(fam: FamilySpec, c: TransformerConfig, hf: Mapping,
                   source: str = "config.json") -> ModelSpec:
    """The layout of a model built from ``c`` (already parsed from ``hf``), without a second
    parse."""
    return ModelSpec.from_config(fam.name, c, fam.kinds(c), **fam.layout_extras(hf, source))


def spec_from_hf_config(cfg: Mapping, model_type_hf: str,
                        source: str = "config.json") -> ModelSpec:
    """Validate ``config.json`` against ``--model-type-hf`` and extract the layout facts."""
    fam = family_of(model_type_hf)
    got = cfg.get("model_type")
    if got != fam.hf_model_type:
        raise ValueError(f"{source}: model_type is {got!r} but --model-type-hf {model_type_hf} "
                         f"expects {fam.hf_model_type!r} (wrong --model-type-hf for these "
                         f"weights?)")
    try:
        c = fam.config_for_layout(cfg, source)
        extras = fam.layout_extras(cfg, source)
    except KeyError as e:
        raise ValueError(f"{source}: missing key {e.args[0]!r}") from None
    return ModelSpec.from_config(fam.name, c, fam.kinds(c), **extras)



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
