"""The config rules of context parallel, checked before any process starts (``config/``
calls ``check_context_parallel`` when ``parallel.context_parallel_size`` > 1)."""
from __future__ import annotations

from typing import Callable

from .apply import ulysses_degree
from .ulysses import check_heads

_CP = "parallel.context_parallel_size"


def check_context_parallel(cfg, fail: Callable) -> None:
    """``fail(cfg, keys, message)`` raises the one-line ConfigError naming the keys' source."""
    p, m, d = cfg.parallel, cfg.model, cfg.data
    cp = p.context_parallel_size
    algo_keys = (_CP, "parallel.context_parallel_algo", "parallel.ulysses_degree_in_cp")
    try:
        u = ulysses_degree(cp, p.context_parallel_algo, p.ulysses_degree_in_cp)
    except ValueError as e:
        fail(cfg, algo_keys, str(e))
    if d.seq_length % (2 * cp):
        fail(cfg, (_CP, "data.seq_length"),
             f"data.seq_length ({d.seq_length}) must be divisible by 2 x "
             f"{_CP} ({2 * cp}): the sequence is cut into 2*cp chunks")
    if p.fsdp_size > 1 and p.fsdp_size % cp:
        # FSDP shards over data x context parallel (Megatron's dp_cp group), so its size is
        # dp x cp; the exact value is checked at start, when the world size is known
        fail(cfg, ("parallel.fsdp_size", _CP),
             f"parallel.fsdp_size ({p.fsdp_size}) must be a multiple of {_CP} ({cp}): FSDP "
             f"shards over data x context parallel, fsdp_size = dp x cp")
    tp = p.tensor_model_parallel_size
    if p.sequence_parallel and (d.seq_length // cp) % tp:
        fail(cfg, (_CP, "data.seq_length", "parallel.tensor_model_parallel_size"),
             f"data.seq_length / {_CP} ({d.seq_length // cp}) must be divisible by "
             f"parallel.tensor_model_parallel_size ({tp}) under sequence parallel")
    if d.seq_length > m.max_position_embeddings:
        fail(cfg, (_CP, "data.seq_length", "model.max_position_embeddings"),
             f"{_CP} > 1 needs data.seq_length ({d.seq_length}) <= "
             f"model.max_position_embeddings ({m.max_position_embeddings}) (the RoPE table)")
    if u > 1:
        try:
            check_heads(m.num_attention_heads // tp, m.num_query_groups // tp, u)
        except ValueError as e:
            fail(cfg, algo_keys + ("model.num_attention_heads", "model.num_query_groups"),
                 f"parallel.context_parallel_algo {p.context_parallel_algo}: {e}")
