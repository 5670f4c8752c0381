"""``TransformerConfig`` with Megatron-Core's field names, so its users' argument names carry over."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional


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
    position_embedding_type: str = "rope"
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0
    untie_embeddings_and_output_weights: bool = True
    add_bias_linear: bool = False
    add_qkv_bias: bool = False                     # Qwen2.5
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    init_method_std: float = 0.02
    params_dtype: str = "float32"                  # storage dtype of parameters
    mlp_type: str = "dense"                        # pluggable MLP slot; "moe" comes later

    @property
    def swiglu(self) -> bool:
        return self.gated_linear_unit and self.activation_func == "silu"

    def __post_init__(self) -> None:
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
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
        if self.position_embedding_type != "rope" or self.rotary_percent != 1.0:
            raise ValueError("model.position_embedding_type must be 'rope' with "
                             "rotary_percent 1.0")
        if self.activation_func not in ("silu", "gelu"):
            raise ValueError(f"model.activation_func: {self.activation_func!r} is not supported")
        if self.mlp_type != "dense":
            raise ValueError(f"model.mlp_type: {self.mlp_type!r} is not available yet "
                             f"(mixture of experts is issue 7)")
        if self.attention_dropout != 0.0:
            raise ValueError("model.attention_dropout: only 0.0 is supported (fused attention "
                             "kernels here have no dropout); use model.hidden_dropout")
        if self.kv_channels % 2:
            raise ValueError(f"model.kv_channels ({self.kv_channels}) must be even for RoPE")

    def replace(self, **changes) -> "TransformerConfig":
        return dataclasses.replace(self, **changes)
