"""Apply tensor (+ sequence) parallelism to a GPTModel from outside (torchtitan's discipline).

Every rank builds the same full model (same seed), then ``parallelize`` swaps each linear and the
embedding for its tensor-parallel version holding this rank's shard, so a tp run starts from
exactly the single-process weights.
"""
from __future__ import annotations

import functools

from mindspore import Tensor

from ms_llm import ops as hot
from ms_llm.compat import float32
from ms_llm.models.gpt import GPTModel
from . import autograd as pa
from .state import ParallelState
from .tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                              glu_rows, vocab_parallel_cross_entropy)


def validate_tp(config, tp: int) -> None:
    checks = (("model.num_attention_heads", config.num_attention_heads),
              ("model.num_query_groups", config.num_query_groups),
              ("model.ffn_hidden_size", config.ffn_hidden_size),
              ("model.padded_vocab_size", config.padded_vocab_size))
    for key, value in checks:
        if value % tp:
            raise ValueError(f"{key} ({value}) is not divisible by "
                             f"parallel.tensor_model_parallel_size ({tp})")


def _tp_logits(h: Tensor, weight: Tensor, group, sequence_parallel: bool) -> Tensor:
    if sequence_parallel:
        h = pa.gather_from_sequence_parallel(h, group, 1)
    else:
        h = pa.copy_to_group(h, group)
    return hot.linear(h, weight).astype(float32)


def _mark_partial(module) -> None:
    for _, p in module.parameters_and_names():
        p.tp_partial_grad = True


def parallelize(model: GPTModel, state: ParallelState, sequence_parallel: bool = False
                ) -> GPTModel:
    group = state.group("tp")
    tp = group.size
    if tp == 1:
        if sequence_parallel:
            raise ValueError("parallel.sequence_parallel needs tensor_model_parallel_size > 1")
        return model
    c = model.config
    validate_tp(c, tp)
    sp = sequence_parallel
    emb = VocabParallelEmbedding(model.embedding.word_embeddings, group, sequence_parallel=sp)
    model.embedding.word_embeddings = emb
    for layer in model.decoder.layers:
        attn = layer.self_attention
        attn.linear_qkv = ColumnParallelLinear(attn.linear_qkv, group, sequence_parallel=sp)
        attn.linear_proj = RowParallelLinear(attn.linear_proj, group, sequence_parallel=sp)
        attn.nh, attn.ng = attn.nh // tp, attn.ng // tp
        if attn.q_layernorm is not None:  # each rank sees only its heads
            _mark_partial(attn.q_layernorm)
            _mark_partial(attn.k_layernorm)
        mlp = layer.mlp
        rows = glu_rows(mlp.linear_fc1.out_features, group.rank, tp) \
            if c.gated_linear_unit else None
        mlp.linear_fc1 = ColumnParallelLinear(mlp.linear_fc1, group, sequence_parallel=sp,
                                              rows=rows)
        mlp.linear_fc2 = RowParallelLinear(mlp.linear_fc2, group, sequence_parallel=sp)
        if sp:
            _mark_partial(layer.input_layernorm)
            _mark_partial(layer.pre_mlp_layernorm)
    if sp:
        _mark_partial(model.decoder.final_layernorm)
    if model.output_layer is not None:
        model.output_layer = ColumnParallelLinear(model.output_layer, group, sequence_parallel=sp)
    model.compute_logits = functools.partial(_tp_logits, group=group, sequence_parallel=sp)
    model.finalize_logits = functools.partial(pa.gather_from_group, group=group, dim=-1)
    model.loss_fn = functools.partial(vocab_parallel_cross_entropy, group=group,
                                      vocab_start=emb.vocab_start)
    model.sequence_parallel_group = group if sp else None
    return model
