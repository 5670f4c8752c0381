"""``TransformerConfig`` with Megatron-Core's field names, so its users' argument names carry over."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import List, Optional

from .mixers import validate_mixers


@dataclass
class TransformerConfig:
    """Architecture of a GPT-style decoder. Field names follow ``megatron.core.TransformerConfig``
    (and Megatron's ``--`` flags), so ``num_query_groups`` is the number of KV heads and
    ``kv_channels`` the head dimension."""

    num_layers: int = 2
    hidden_size: int = 128
    ffn_hidden_size: Optional[int] = None          # default 4 * hidden_size
    num_attention_heads: int = 4
    num_query_groups: Optional[int] = None         # None = multi-head attention (= heads)
    kv_channels: Optional[int] = None              # head dim; default hidden_size // heads
    padded_vocab_size: int = 32000
    max_position_embeddings: int = 4096

    normalization: str = "RMSNorm"                 # only RMSNorm for the dense families here
    layernorm_epsilon: float = 1e-6
    qk_layernorm: bool = False                     # Qwen3
    gated_linear_unit: bool = True                 # fused [gate; up] in linear_fc1
    activation_func: str = "silu"                  # gated + silu = SwiGLU
    position_embedding_type: str = "rope"          # "rope", or "yarn" (RoPE with YaRN scaling)
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0
    # YaRN (position_embedding_type "yarn"; Megatron-Core's names, HF rope_scaling in comments).
    yarn_rotary_scaling_factor: Optional[float] = None          # factor (None: max_pos / original)
    yarn_original_max_position_embeddings: Optional[int] = None  # None: max_position_embeddings
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: Optional[float] = None
    yarn_mscale_all_dim: Optional[float] = None
    yarn_attention_factor: Optional[float] = None   # None: from the factor / mscale (HF's rule)
    yarn_correction_range_round_to_int: bool = True  # HF truncate
    untie_embeddings_and_output_weights: bool = True
    add_bias_linear: bool = False
    add_qkv_bias: bool = False                     # Qwen2.5
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    init_method_std: float = 0.02
    params_dtype: str = "float32"                  # storage dtype of parameters
    mlp_type: str = "dense"                        # "dense" or "moe" (ms_llm.models.moe)

    # Mixture of experts (Megatron-Core names; used when mlp_type == "moe").
    num_moe_experts: Optional[int] = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: Optional[int] = None      # expert FFN size; default ffn_hidden_size
    moe_shared_expert_intermediate_size: Optional[int] = None   # None = no shared experts
    moe_shared_expert_gate: bool = False           # sigmoid(x . gate_weight) scales them (Qwen2-MoE)
    moe_router_score_function: str = "softmax"     # "softmax" or "sigmoid"
    # False: top-k of the logits, softmax over the k (= HF norm_topk_prob true);
    # True: softmax over all experts, then top-k without renormalising (norm_topk_prob false).
    moe_router_pre_softmax: bool = False
    moe_router_topk_scaling_factor: Optional[float] = None
    moe_router_load_balancing_type: str = "aux_loss"   # "aux_loss" or "none"
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: Optional[float] = None
    moe_router_enable_expert_bias: bool = False    # aux-loss-free balancing (sigmoid router only)
    moe_router_bias_update_rate: float = 1e-3
    moe_layer_freq: int = 1                        # layer i is MoE when i % freq == 0
    moe_layer_pattern: Optional[List[int]] = None  # 1 = MoE, 0 = dense, per layer (overrides freq)
    moe_grouped_gemm: bool = False                 # experts as weight1/weight2 instead of local_experts
    # DeepSeek-V3 / GLM-4.5 routing (HF n_group / topk_group / norm_topk_prob): experts in
    # moe_router_num_groups groups, tokens routed inside their moe_router_group_topk best groups.
    moe_router_num_groups: Optional[int] = None
    moe_router_group_topk: Optional[int] = None
    moe_router_norm_topk_prob: bool = True         # sigmoid router: renormalise the k weights

    # Multi-head latent attention (DeepSeek-V3; Megatron-Core's MLATransformerConfig names:
    # qk_head_dim = HF qk_nope_head_dim, qk_pos_emb_head_dim = HF qk_rope_head_dim).
    multi_latent_attention: bool = False
    q_lora_rank: Optional[int] = None              # None: linear_q_proj instead of down/up
    kv_lora_rank: int = 512
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    mla_rope_interleaved: bool = True              # HF rope_interleave: rope dims in (x0,x1) pairs
    # Multi-token prediction (Megatron-Core's names).
    mtp_num_layers: Optional[int] = None
    mtp_loss_scaling_factor: float = 0.1
    # Output layer + cross entropy in chunks of tokens with their own backward: the logits and
    # their gradient never exist whole (ms_llm.ops.fused_cross_entropy; Megatron's flag name).
    cross_entropy_loss_fusion: bool = False
    # Hybrid layers (Qwen3-Next). ``layer_types`` names each decoder layer's token mixer, a kind
    # of ms_llm.models.mixers ("attention": the model's full attention; "gated_delta_net"; None:
    # all full attention); the linear_* sizes are Megatron-Core's GatedDeltaNet.
    layer_types: Optional[List[str]] = None
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_chunk_size: int = 64                    # chunk of the parallel delta-rule form
    attention_output_gate: bool = False            # out * sigmoid(gate), gate from linear_qkv
    layernorm_zero_centered_gamma: bool = False    # RMSNorm scales by (1 + weight), weight 0-init
    # QK-clip (Kimi K2's MuonClip, Megatron-Core's names; ms_llm.training.qk_clip): after each
    # step, a query group whose max attention logit passed the threshold has its W_q rows scaled
    # by eta^alpha and W_k rows by eta^(1-alpha), eta = threshold / max logit
    qk_clip: bool = False
    qk_clip_alpha: float = 0.5
    qk_clip_threshold: float = 100.0
    log_max_attention_logit: bool = False          # log it without clipping (qk_clip logs too)

    @property
    def rotary_dim(self) -> int:
        """Width RoPE rotates: MLA's decoupled rope part, else ``kv_channels * rotary_percent``
        (GLM-4.5's partial rotary; the rest of each head passes through)."""
        if self.multi_latent_attention:
            return self.qk_pos_emb_head_dim
        return int(self.kv_channels * self.rotary_percent)

    @property
    def swiglu(self) -> bool:
        return self.gated_linear_unit and self.activation_func == "silu"

    def __post_init__(self) -> None:
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.kv_channels is None and self.multi_latent_attention:
            self.kv_channels = self.qk_head_dim + self.qk_pos_emb_head_dim
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(f"model.hidden_size ({self.hidden_size}) must be divisible by "
                                 f"model.num_attention_heads ({self.num_attention_heads}) "
                                 f"unless model.kv_channels is set")
            self.kv_channels = self.hidden_size // self.num_attention_heads
        self.validate()

    def validate(self) -> None:
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(f"model.num_attention_heads ({self.num_attention_heads}) must be "
                             f"divisible by model.num_query_groups ({self.num_query_groups})")
        if self.normalization != "RMSNorm":
            raise ValueError(f"model.normalization: {self.normalization!r} is not supported "
                             f"(only 'RMSNorm')")
        if self.position_embedding_type not in ("rope", "yarn"):
            raise ValueError("model.position_embedding_type must be 'rope' or 'yarn'")
        validate_mixers(self)    # model.layer_types and each token mixer's own keys
        if not 0 < self.rotary_percent <= 1.0 or self.rotary_dim % 2:
            raise ValueError(f"model.rotary_percent ({self.rotary_percent}) must be in (0, 1] "
                             f"and rotate an even number of head dims")
        if self.mtp_num_layers is not None and self.mtp_num_layers < 0:
            raise ValueError(f"model.mtp_num_layers ({self.mtp_num_layers}) must be >= 0")
        if self.mtp_loss_scaling_factor < 0:
            raise ValueError(f"model.mtp_loss_scaling_factor ({self.mtp_loss_scaling_factor}) "
                             f"must be >= 0")
        if self.position_embedding_type == "yarn":
            self._validate_yarn()
        if self.activation_func not in ("silu", "gelu"):
            raise ValueError(f"model.activation_func: {self.activation_func!r} is not supported")
        if self.mlp_type not in ("dense", "moe"):
            raise ValueError(f"model.mlp_type: {self.mlp_type!r} is not supported "
                             f"('dense' or 'moe')")
        if self.mlp_type == "moe":
            self._validate_moe()
        if self.attention_dropout != 0.0:
            raise ValueError("model.attention_dropout: only 0.0 is supported (fused attention "
                             "kernels here have no dropout); use model.hidden_dropout")
        if self.kv_channels % 2:
            raise ValueError(f"model.kv_channels ({self.kv_channels}) must be even for RoPE")

    def _validate_yarn(self) -> None:
        factor = self.yarn_rotary_scaling_factor
        original = self.yarn_original_max_position_embeddings
        if factor is not None and factor <= 0:
            raise ValueError(f"model.yarn_rotary_scaling_factor ({factor}) must be > 0")
        if original is not None and original < 1:
            raise ValueError(f"model.yarn_original_max_position_embeddings ({original}) must "
                             f"be >= 1")
        if factor is None and original is None:
            raise ValueError("model.position_embedding_type 'yarn' needs "
                             "model.yarn_rotary_scaling_factor or "
                             "model.yarn_original_max_position_embeddings")
        if self.yarn_beta_fast <= 0 or self.yarn_beta_slow <= 0:
            raise ValueError(f"model.yarn_beta_fast ({self.yarn_beta_fast}) and "
                             f"model.yarn_beta_slow ({self.yarn_beta_slow}) must be > 0")

    def _validate_moe(self) -> None:
        e, k = self.num_moe_experts, self.moe_router_topk
        if not e or e < 1:
            raise ValueError("model.num_moe_experts must be set (>= 1) when model.mlp_type is 'moe'")
        if not 1 <= k <= e:
            raise ValueError(f"model.moe_router_topk ({k}) must be in [1, num_moe_experts={e}]")
        if not self.swiglu:
            raise ValueError("model.mlp_type 'moe': experts are SwiGLU only "
                             "(gated_linear_unit true, activation_func 'silu')")
        if self.add_bias_linear:
            raise ValueError("model.mlp_type 'moe': expert linears have no bias "
                             "(add_bias_linear must be false)")
        if self.moe_router_score_function not in ("softmax", "sigmoid"):
            raise ValueError(f"model.moe_router_score_function: "
                             f"{self.moe_router_score_function!r} is not 'softmax' or 'sigmoid'")
        if self.moe_router_load_balancing_type not in ("aux_loss", "seq_aux_loss", "none"):
            raise ValueError(f"model.moe_router_load_balancing_type: "
                             f"{self.moe_router_load_balancing_type!r} is not supported "
                             f"('aux_loss', 'seq_aux_loss' or 'none')")
        g, gk = self.moe_router_num_groups, self.moe_router_group_topk
        if g is not None and g > 1:
            if e % g or not gk or not 1 <= gk <= g or e // g < 2:
                raise ValueError(f"model.moe_router_num_groups ({g}) must divide "
                                 f"num_moe_experts ({e}) into groups of >= 2 experts and "
                                 f"moe_router_group_topk ({gk}) must be in [1, {g}]")
            if k > gk * (e // g):
                raise ValueError(f"model.moe_router_topk ({k}) exceeds the experts of "
                                 f"moe_router_group_topk ({gk}) groups")
        if self.moe_router_enable_expert_bias and self.moe_router_score_function != "sigmoid":
            raise ValueError("model.moe_router_enable_expert_bias needs "
                             "moe_router_score_function 'sigmoid' (as in Megatron-Core)")
        if self.moe_layer_freq < 1:
            raise ValueError(f"model.moe_layer_freq ({self.moe_layer_freq}) must be >= 1")
        pat = self.moe_layer_pattern
        if pat is not None and (len(pat) != self.num_layers or any(v not in (0, 1) for v in pat)):
            raise ValueError(f"model.moe_layer_pattern {pat} must hold one 0/1 per layer "
                             f"(num_layers={self.num_layers})")

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Megatron's ``--moe-layer-freq``: an int N makes layers 0, N, 2N, ... MoE; the list form
        (``moe_layer_pattern``) says it per layer. Indices from ``num_layers`` on are the
        multi-token prediction layers, built like the last decoder layer (Megatron-Core's MTP
        block spec takes the decoder's layer spec)."""
        if self.mlp_type != "moe":
            return False
        if layer_idx >= self.num_layers:    # an MTP layer is built like the last decoder layer
            layer_idx = self.num_layers - 1
        if self.moe_layer_pattern is not None:
            return bool(self.moe_layer_pattern[layer_idx])
        return layer_idx % self.moe_layer_freq == 0

    def replace(self, **changes) -> "TransformerConfig":
        return dataclasses.replace(self, **changes)
