"""Context parallel applied from outside the model: the attention swap and the batch split.

``apply_context_parallel`` applies every layer's mixer plan (``parallel.mixer_plans``): softmax
attention's ``core_attention`` (the model's own parameter-free module) becomes
``ContextParallelAttention``, a Gated DeltaNet layer's conv and delta rule their state-passing
forms (``delta_rule``); it also gives every MoE router the cp
partition of its tokens (``sequence_sums``); the trainer gives the model this rank's
part of each micro-batch (``ContextParallel.micro_batch``): tokens, labels and loss mask of
its two chunks, the global RoPE positions of those tokens, and, in place of the attention mask
tensor, a ``CPBatch`` carrying the block plan of the whole sequence (its packed-document mask),
which the swapped attention reads. The model code does not change.

Pipeline parallel: every stage's micro-batch is split the same way (the executor hands each
stage the same dict: positions and the ``CPBatch`` on every stage, labels and loss mask on the
last), and the pipeline group of a rank holds the same cp rank on every stage, so activations
of ``seq / cp`` tokens travel between matching chunk owners.

Groups: the cp group in cp-rank order is cut into Ulysses groups of ``ulysses_degree``
consecutive cp ranks; the ring runs over the ranks at the same place of every Ulysses group
(``megatron_cp_algo``: degree 1; ``ulysses_cp_algo``: degree cp; ``hybrid_cp_algo``: in between).
"""
from __future__ import annotations

from typing import Dict, List, Optional

import numpy as np
from mindspore import Tensor

from ms_llm.compat import nn
from ms_llm.models.mixers import mixer_of
from .. import comm
from ..mixer_plans import plan_for
from .layout import ChunkMask, local_token_index, rank_chunks, split_sequence
from .ring import RingExchange, RingPlan, ring_attention
from .sequence_sums import install_router_partition
from .ulysses import check_heads, heads_to_seq, replicate_kv, seq_to_heads

ALGOS = ("megatron_cp_algo", "ulysses_cp_algo", "hybrid_cp_algo")


def ulysses_degree(cp: int, algo: str, degree_in_cp: Optional[int]) -> int:
    """The Ulysses group size of ``algo`` (1: pure ring; cp: pure Ulysses)."""
    if degree_in_cp is not None and algo != "hybrid_cp_algo":
        raise ValueError(f"parallel.ulysses_degree_in_cp is only used with "
                         f"context_parallel_algo hybrid_cp_algo, not {algo}")
    if algo == "megatron_cp_algo":
        return 1
    if algo == "ulysses_cp_algo":
        return cp
    if algo == "hybrid_cp_algo":
        if not degree_in_cp or cp % degree_in_cp:
            raise ValueError(f"parallel.context_parallel_algo hybrid_cp_algo needs "
                             f"parallel.ulysses_degree_in_cp dividing context_parallel_size "
                             f"({cp}), got {degree_in_cp}")
        return degree_in_cp
    raise ValueError(f"parallel.context_parallel_algo must be one of {', '.join(ALGOS)}, "
                     f"got {algo!r}")


class CPBatch:
    """The attention mask of one micro-batch under context parallel: the block plan of the
    global sequence (shared by all layers, so bias blocks are built once per micro-batch)."""

    def __init__(self, masks: ChunkMask):
        self.masks = masks
        # no packed-document mask: one causal sequence per row (what recurrent layers accept)
        self.causal = masks.mask is None


class ContextParallel:
    """This rank's place in the context-parallel groups and the micro-batch split."""

    def __init__(self, pstate, algo: str, degree_in_cp: Optional[int], seq_length: int):
        cp_group = pstate.group("cp")
        self.cp, self.cp_rank = cp_group.size, cp_group.rank
        self.group = cp_group
        self.seq_length = seq_length
        local_token_index(seq_length, self.cp, 0)       # divisibility, one-line error
        self.u = ulysses_degree(self.cp, algo, degree_in_cp)
        ranks = list(cp_group.ranks)                    # cp-rank order (tp fastest, then cp)
        g, j = divmod(self.cp_rank, self.u)
        self.ulysses_group = comm.new_group(ranks[g * self.u:(g + 1) * self.u]) \
            if self.u > 1 else None
        ring_cp_ranks = list(range(j, self.cp, self.u))
        self.ring = RingExchange([ranks[c] for c in ring_cp_ranks])
        # chunks each ring member's (post-Ulysses) K/V block covers, and this rank's queries
        self.member_chunks: List[List[int]] = [
            [ch for c in range(m * self.u, (m + 1) * self.u) for ch in rank_chunks(self.cp, c)]
            for m in range(self.cp // self.u)]
        self.q_chunks = self.member_chunks[g]

    def micro_batch(self, b: Dict[str, np.ndarray], reset_position_ids: bool) -> Dict[str, object]:
        """A loader batch (the whole sequence) as this rank's model inputs."""
        s = b["tokens"].shape[1]
        if s != self.seq_length:
            raise ValueError(f"context parallel: batch sequence {s} != data.seq_length "
                             f"{self.seq_length}")
        mb = {k: Tensor(split_sequence(np.asarray(b[k]), self.cp, self.cp_rank))
              for k in ("tokens", "labels", "loss_mask")}
        if reset_position_ids and "position_ids" in b:
            pos = np.asarray(b["position_ids"])
        else:
            pos = np.broadcast_to(np.arange(s, dtype=np.int32), b["tokens"].shape)
        mb["position_ids"] = Tensor(split_sequence(pos.astype(np.int32), self.cp, self.cp_rank))
        mask = b.get("attention_mask")
        mb["attention_mask"] = CPBatch(ChunkMask(s, 2 * self.cp, mask))
        return mb


class ContextParallelAttention(nn.Module):
    """Replaces ``CoreAttention``: q ``[b, nh, s_local, d]``, k/v ``[b, ng, s_local, d]`` of this
    rank's two chunks; ``attention_mask`` is the micro-batch's ``CPBatch``."""

    def __init__(self, cp: ContextParallel):
        super().__init__()
        self.cp = cp

    def forward(self, q: Tensor, k: Tensor, v: Tensor, attention_mask=None) -> Tensor:
        if not isinstance(attention_mask, CPBatch):
            raise ValueError("context parallel attention needs the micro-batch from "
                             "ContextParallel.micro_batch (its attention_mask is a CPBatch)")
        cp = self.cp
        if cp.u > 1:
            check_heads(q.shape[1], k.shape[1], cp.u, "parallel.ulysses_degree_in_cp: ")
            k, v = replicate_kv(k, cp.u), replicate_kv(v, cp.u)
            q, k, v = (seq_to_heads(x, cp.ulysses_group) for x in (q, k, v))
        plan = RingPlan(cp.ring, cp.member_chunks, cp.q_chunks, attention_mask.masks)
        out = ring_attention(q, k, v, plan)
        if cp.u > 1:
            out = heads_to_seq(out, cp.ulysses_group)
        return out


def apply_context_parallel(model, cfg, pstate) -> Optional[ContextParallel]:
    """Swap every layer's core attention for the context-parallel one (cp > 1)."""
    p = cfg.parallel
    if pstate.sizes.cp == 1:
        return None
    if getattr(pstate, "plan_only", False):
        # ms-llm plan's communicator-free state (plan_shapes.plan_state): the swap holds no
        # parameters, and its ring / Ulysses groups would need a communicator
        return None
    cp = ContextParallel(pstate, p.context_parallel_algo, p.ulysses_degree_in_cp,
                         cfg.data.seq_length)
    if cp.u > 1:
        tp = pstate.sizes.tp
        check_heads(cfg.model.num_attention_heads // tp, cfg.model.num_query_groups // tp, cp.u,
                    "parallel.context_parallel_algo: ")
    for layer in model.decoder.layers:     # each mixer kind's own sequence split
        plan_for(mixer_of(layer.self_attention)).context_parallel(layer.self_attention, cp)
    # the routers' balancing losses pool their counts over the sequences' pieces
    install_router_partition(model, pstate.group("cp"))
    return cp
