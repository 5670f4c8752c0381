"""Qwen3.5 dense (the text model of HF ``Qwen3_5ForCausalLM``, ``model_type`` "qwen3_5_text").

Against Qwen3-Next (``qwen3_next``): the same hybrid layer layout (Gated DeltaNet layers and a
gated full-attention layer every ``full_attention_interval``), the same gated attention (output
gate, partial rotary, QK-norm), zero-centred RMSNorms and gated RMSNorm; the differences are

* the DeltaNet input projections are stored split and flat (``in_proj_qkv`` / ``in_proj_z`` /
  ``in_proj_b`` / ``in_proj_a``), a row permutation of Qwen3-Next's grouped ``in_proj_qkvz`` /
  ``in_proj_ba`` (layer kind ``gated_delta_net_split``, ``layouts``, registered here);
  the model is Qwen3-Next's module;
* the MLP is dense SwiGLU in every layer (``qwen35-moe`` is the MoE model);
* rotary is multimodal RoPE (``mrope_section``, interleaved); for text every one of its three
  position ids is the token index, so it is plain partial RoPE;
* the published checkpoints are ``Qwen3_5ForConditionalGeneration`` (keys under
  ``model.language_model.``, a ``model.visual.`` tower): reading that folder layout is not
  built; ``Qwen3_5ForCausalLM`` folders (``model.layers.``, and ``mtp.*`` as Qwen3-Next's
  one multi-token prediction layer) are.
"""
from ...layouts import register_layer_kind
from ...registry import register_family
from .layouts import GATED_DELTA_NET_SPLIT
from .spec import SPEC

register_layer_kind("gated_delta_net_split", GATED_DELTA_NET_SPLIT)
register_family(SPEC)
