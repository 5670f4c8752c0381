"""``GPTModel``: Megatron-Core's module tree and state-dict keys, parallelism-free.

Activations are batch-first ``[b, s, h]`` (torchtitan's layout); Megatron's ``[s, b, h]`` only
matters inside its kernels, never in state dicts. Tensor/sequence/data parallelism and FSDP are
applied from outside by ``ms_llm.parallel`` (they replace or wrap these modules).
"""
from __future__ import annotations

from typing import Callable, Optional

from mindspore import Tensor, ops

from ms_llm import ops as hot
from ms_llm.compat import float32, nn
from .config import TransformerConfig
from .fused_decode import layer_step as fused_layer_step
from .kv_cache import KVCache
from .layers import TransformerLayer, norm
from .mixers import layer_mixer
from .moe import aux_loss as moe_aux_loss, moe_mlp_factory
from .mtp import MultiTokenPredictionBlock, MultiTokenPredictionLayer, mtp_loss
from .mtp import roll_left as mtp_roll
from .yarn import rope_frequencies

MLPFactory = Callable[[TransformerConfig, int], nn.Module]


class LanguageModelEmbedding(nn.Module):
    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.word_embeddings = hot.Embedding(config.padded_vocab_size, config.hidden_size,
                                             init_std=config.init_method_std,
                                             dtype=config.params_dtype)

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.word_embeddings(input_ids)


def layer_parts(config: TransformerConfig, mlp_factory: Optional[MLPFactory], i: int):
    """The MLP and token mixer of layer ``i`` (``i >= num_layers``: an MTP layer); the mixer is
    the layer's registered kind (``ms_llm.models.mixers``)."""
    return mlp_factory(config, i) if mlp_factory else None, layer_mixer(config, i).make(config)


class TransformerBlock(nn.Module):
    def __init__(self, config: TransformerConfig, mlp_factory: Optional[MLPFactory] = None):
        super().__init__()
        self.layers = nn.ModuleList([TransformerLayer(config, *layer_parts(config, mlp_factory, i))
                                     for i in range(config.num_layers)])
        self.final_layernorm = norm(config, config.hidden_size)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor,
                attention_mask: Optional[Tensor] = None,
                kv_cache: Optional[KVCache] = None) -> Tensor:
        for i, layer in enumerate(self.layers):
            if kv_cache is None:
                x = layer(x, cos, sin, attention_mask)
            else:   # one new token: the fused decode kernels when they cover the layer
                y = fused_layer_step(layer, x, cos, sin, attention_mask, kv_cache[i])
                x = layer(x, cos, sin, attention_mask, kv_cache=kv_cache[i]) if y is None else y
        return self.final_layernorm(x)


class GPTModel(nn.Module):
    """Decoder-only LM. ``forward(input_ids, labels=None)`` returns fp32 logits ``[b, s, V]``, or,
    given ``labels``, the per-token cross entropy ``[b, s]`` (Megatron's convention: the caller
    applies the loss mask and reduction). ``mlp_factory(config, layer_idx)`` plugs in another MLP
    (the MoE layer) without touching this file."""

    def __init__(self, config: TransformerConfig, mlp_factory: Optional[MLPFactory] = None):
        super().__init__()
        self.config = config
        if mlp_factory is None and config.mlp_type == "moe":
            mlp_factory = moe_mlp_factory
        self.embedding = LanguageModelEmbedding(config)
        self.decoder = TransformerBlock(config, mlp_factory)
        if config.untie_embeddings_and_output_weights:
            self.output_layer = hot.Linear(config.hidden_size, config.padded_vocab_size, bias=False,
                                          init_std=config.init_method_std,
                                          dtype=config.params_dtype)
        else:
            self.output_layer = None
        # Multi-token prediction (ms_llm.models.mtp); built last, so the main model's initial
        # weights for a seed are the same with or without it.
        self.mtp = MultiTokenPredictionBlock(config, lambda i: MultiTokenPredictionLayer(
            config, *layer_parts(config, mlp_factory, i))) if config.mtp_num_layers else None
        self._rope_cache = {}
        self._table_rows, self._table = 0, None   # the inference table (_cached_cos_sin)
        # The LM head as swappable steps (tied logits, logits post-processing, loss);
        # ms_llm.parallel.parallelize replaces them with vocabulary-parallel versions, so the model
        # itself stays parallelism-free.
        self.compute_logits = lm_logits
        self.finalize_logits = identity
        self.loss_fn = hot.cross_entropy      # (logits in the head's dtype, labels) -> fp32 loss

    def aux_loss(self) -> Optional[Tensor]:
        """The MoE routers' auxiliary losses of the last forward (``None`` for a dense model);
        the trainer adds it to the language-model loss inside the differentiated function."""
        if self.config.mlp_type != "moe":
            return None
        return moe_aux_loss(self)

    def mtp_loss(self, loss_mask: Tensor):
        """``(loss term, per-depth mean losses)`` of the last forward with labels, or ``None``
        without multi-token prediction; the term still takes the caller's ``1 / tokens``."""
        if self.mtp is None or not self.mtp.last_per_token:
            return None
        return mtp_loss(self.config, self.mtp.last_per_token, loss_mask)

    def rotary_cos_sin(self, seq_len: int, position_ids: Optional[Tensor] = None):
        """cos, sin ``[s, d]`` for positions ``0..s-1``, or ``[b, 1, s, d]`` at ``position_ids``
        ``[b, s]`` (packed documents restart their positions; every head shares them). The
        tables carry the config's RoPE scaling (YaRN)."""
        # Positions may lie beyond the input's length (one context-parallel shard of a longer
        # sequence): with position_ids the table covers max_position_embeddings.
        rows = seq_len if position_ids is None else max(seq_len,
                                                          self.config.max_position_embeddings)
        if rows not in self._rope_cache:
            self._rope_cache[rows] = self._rope_tables(rows)
        cos, sin = self._rope_cache[rows]
        if position_ids is None:
            return cos, sin
        return (ops.gather(cos, position_ids, 0).expand_dims(1),
                ops.gather(sin, position_ids, 0).expand_dims(1))

    def _cached_cos_sin(self, seq_len: int, position_ids: Optional[Tensor], offset: int,
                        rows: int):
        """Inference (PyNative only): cos, sin for positions ``offset..offset+s-1`` or at
        ``position_ids``, all below ``rows``, from one table that grows as the cache does.
        The table is kept on the host and sliced there: a decode step then dispatches no
        slicing or gather op for it (the same fp32 values)."""
        cos, sin = self.rope_table(rows)
        if position_ids is None:
            return Tensor(cos[offset:offset + seq_len]), Tensor(sin[offset:offset + seq_len])
        idx = position_ids.asnumpy()
        return Tensor(cos[idx][:, None]), Tensor(sin[idx][:, None])

    def rope_table(self, rows: int):
        """Inference: host (NumPy) cos, sin ``[>= rows, rotary_dim]`` fp32 for positions from 0,
        one table grown by doubling (the decode steps slice it, or read it from C)."""
        if self._table_rows < rows:
            self._table_rows = max(rows, 2 * self._table_rows)
            self._table = tuple(t.asnumpy() for t in self._rope_tables(self._table_rows))
        return self._table

    def plain_head_weight(self) -> Optional[Tensor]:
        """The LM head's ``[V, H]`` weight when the logits are a plain ``h @ W^T`` (tied embedding
        or a bias-free ``hot.Linear``, not replaced by tensor parallel / LoRA), else None: what a
        fused decode step may compute the logits with (``fused_decode.model_step``)."""
        if self.compute_logits is not lm_logits or self.finalize_logits is not identity:
            return None
        if self.output_layer is None:
            return self.embedding.word_embeddings.weight
        if type(self.output_layer) is hot.Linear and self.output_layer.bias is None:
            return self.output_layer.weight
        return None

    def _rope_tables(self, rows: int):
        c = self.config
        inv_freq, attention_factor = rope_frequencies(c)
        return hot.rope_cos_sin(rows, c.rotary_dim, c.rotary_base, inv_freq=inv_freq,
                                attention_factor=attention_factor)

    def forward(self, input_ids: Tensor, labels: Optional[Tensor] = None,
                attention_mask: Optional[Tensor] = None,
                position_ids: Optional[Tensor] = None,
                kv_cache: Optional[KVCache] = None, logits_to_keep: int = 0) -> Tensor:
        """``kv_cache`` (inference): the tokens continue what the cache holds; their K/V are
        appended to it and they attend over every cached slot. Positions default to the cache's
        fill point onwards; ``attention_mask`` defaults to ``kv_cache.attention_mask(s)``
        (causal, minus padding and unfilled slots; a mask given here must have its shape).
        ``logits_to_keep`` > 0 computes the logits of the last that many positions only (HF's
        name; a prefill needs only the last one)."""
        s = input_ids.shape[1]
        if kv_cache is None:
            cos, sin = self.rotary_cos_sin(s, position_ids)
        else:
            if attention_mask is None:
                attention_mask = kv_cache.attention_mask(s)   # also reserves the slots
            cos, sin = self._cached_cos_sin(s, position_ids, kv_cache.length,
                                            max(kv_cache.max_capacity, kv_cache.length + s))
        h = self.embedding(input_ids)
        if kv_cache is None:
            h = self.decoder(h, cos, sin, attention_mask)
        else:
            h = self.decoder(h, cos, sin, attention_mask, kv_cache=kv_cache)
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        if labels is None:
            return self.finalize_logits(self._head(h))
        if self.mtp is not None and kv_cache is None and not logits_to_keep:
            self.mtp.last_per_token = self._mtp_per_token(h, input_ids, labels, cos, sin,
                                                          attention_mask)
        return self._head_loss(h, labels)

    def _head_loss(self, h: Tensor, labels: Tensor) -> Tensor:
        """Per-token cross entropy of the head: logits then ``loss_fn``, or with
        ``cross_entropy_loss_fusion`` both in chunks of tokens (``hot.fused_linear_cross_entropy``)."""
        if not self.config.cross_entropy_loss_fusion:
            return self.loss_fn(self._head(h, for_loss=True), labels)
        if self.output_layer is None:
            return hot.fused_linear_cross_entropy(h, self.embedding.word_embeddings.weight, labels)
        if type(self.output_layer) is not hot.Linear:
            raise ValueError(f"model.cross_entropy_loss_fusion needs the plain output layer, not "
                             f"{type(self.output_layer).__name__} (tensor parallel, FSDP, LoRA on "
                             f"output_layer are not built for it)")
        return hot.fused_linear_cross_entropy(h, self.output_layer.weight, labels)

    def _head(self, h: Tensor, for_loss: bool = False) -> Tensor:
        if self.output_layer is not None:
            # Through the module, so whatever wraps or replaces it (TP, FSDP) takes part.
            logits = self.output_layer(h)
        else:
            logits = self.compute_logits(h, self.embedding.word_embeddings.weight)
        # a loss reads the head's logits in their dtype and computes in fp32 itself (Megatron's
        # fp32 cross entropy; ms-llm's CPU kernel widens bf16 on load: no pass over [tokens, V])
        return logits if for_loss else logits.astype(float32)

    def _mtp_per_token(self, h, input_ids, labels, cos, sin, attention_mask):
        """Each depth's cross entropy ``[b, s]`` against the labels rolled once per depth,
        through the shared embedding and output head."""
        out = []
        for hk in self.mtp(h, input_ids, self.embedding, cos, sin, attention_mask):
            labels = mtp_roll(labels)
            out.append(self._head_loss(hk, labels))
        return out


def lm_logits(h: Tensor, weight: Tensor) -> Tensor:
    return hot.linear(h, weight)


def identity(x: Tensor) -> Tensor:
    return x
