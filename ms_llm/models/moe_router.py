"""The MoE router (Megatron-Core's ``TopKRouter``): scores, top-k (group-limited for DeepSeek-V3 /
GLM-4.5), the aux-loss-free expert bias and the load-balancing losses. ``ms_llm.models.moe``
builds the layer around it."""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import numpy as np
from mindspore import Tensor

from ms_llm.compat import F, float32, int32, nn
from ms_llm.compat.autograd import is_recomputing
from .config import TransformerConfig


class LocalTokens:
    """The router's view of where the tokens of its sequences live: all of them on this rank.

    Why: a load-balancing loss pools routed counts over whole sequences. When a parallel layout
    spreads each sequence over ``pieces`` ranks (context parallel), it installs an object with the
    same interface on the router (``TopKRouter.token_partition``) whose ``sum_counts`` sums the
    counts over those ranks; the model itself stays parallelism-free."""

    pieces = 1

    def sum_counts(self, counts: Tensor) -> Tensor:
        """``counts`` (routed slots, no gradient) summed over the ranks holding the sequences."""
        return counts

    def whole_loss(self, share: Tensor) -> Tensor:
        """The loss a rank reports for its ``share``: the share itself where the trainer sums
        the ranks' losses (context parallel); a layout whose ranks each report the whole loss
        (tensor parallel) gives the sum's value with the share's gradient."""
        return share


class TopKRouter(nn.Module):
    """Linear router + top-k (Megatron's ``TopKRouter``; names ``weight`` / ``expert_bias``).

    Scores (``moe_router_score_function``):

    * softmax, ``moe_router_pre_softmax`` false: top-k of the logits, softmax over those k
      (identical to HF's softmax -> top-k -> renormalise, ``norm_topk_prob: true``);
    * softmax, pre-softmax true: softmax over all experts, then top-k, no renormalisation
      (HF ``norm_topk_prob: false``);
    * sigmoid: sigmoid scores, top-k chosen on ``score + expert_bias``, weights are the unbiased
      scores renormalised over the k (DeepSeek-V3 style).

    ``probs`` are fp32 whatever the parameter dtype (the router's precision decides routing).
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()
        c = config
        self.config = c
        self.num_experts, self.topk = c.num_moe_experts, c.moe_router_topk
        self.weight = nn.new_parameter((self.num_experts, c.hidden_size), std=c.init_method_std,
                                       dtype=c.params_dtype)
        if c.moe_router_enable_expert_bias:
            self.expert_bias = nn.new_parameter((self.num_experts,), fill=0.0,
                                                requires_grad=False)
        else:
            self.expert_bias = None
        # Routed-token counts since the last ``update_expert_bias`` (host side, training only).
        self.local_tokens_per_expert = np.zeros(self.num_experts, dtype=np.float64)
        self.pending_counts: Optional[Tensor] = None
        self.aux_loss: Optional[Tensor] = None
        self.seq_length: Optional[int] = None    # set by MoELayer: tokens are [b*s] batch-first
        self.token_partition = LocalTokens()      # replaced from outside under context parallel
        # (sum over tokens of the aux-loss scores [E], routed counts [E], tokens) of the last call.
        self.stats: Optional[Tuple[Tensor, Tensor, int]] = None

    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        """``x`` ``[T, H]`` -> ``(probs [T, k] fp32, top_indices [T, k] int32)``."""
        c, k = self.config, self.topk
        logits = F.linear(x.astype(float32), self.weight.astype(float32))       # [T, E]
        if c.moe_router_score_function == "softmax":
            if c.moe_router_pre_softmax:
                probs, idx = F.topk(F.softmax(logits, -1), k, -1)
            else:
                top_logits, idx = F.topk(logits, k, -1)
                probs = F.softmax(top_logits, -1)
            aux_scores = F.softmax(logits, -1)
        else:
            scores = F.sigmoid(logits)
            choice = scores
            if self.expert_bias is not None:
                choice = scores + F.stop_gradient(self.expert_bias.astype(float32))
            if c.moe_router_num_groups and c.moe_router_num_groups > 1:
                choice = group_limited_scores(choice, c.moe_router_num_groups,
                                              c.moe_router_group_topk)
            _, idx = F.topk(F.stop_gradient(choice), k, -1)
            probs = F.gather(scores, 1, idx)
            if k > 1 and c.moe_router_norm_topk_prob:
                probs = probs / (F.sum(probs, -1, keepdim=True) + 1e-20)
            aux_scores = scores / (F.sum(scores, -1, keepdim=True) + 1e-20)
        if c.moe_router_topk_scaling_factor:
            probs = probs * c.moe_router_topk_scaling_factor
        idx = idx.astype(int32)
        self._record(logits, aux_scores, idx)
        return probs, idx

    def _record(self, logits: Tensor, aux_scores: Tensor, idx: Tensor) -> None:
        """The auxiliary losses of this forward. When the sequences are spread over
        ``token_partition.pieces`` ranks, each rank's loss is its share: the routed counts are
        summed over those ranks (no gradient flows through counts), token totals are global, and
        the scores stay local. Every loss is linear in the scores given the counts, so the shares
        add up to the loss of the whole sequences and each share's gradient is exactly that
        loss's gradient with respect to this rank's scores (Megatron's scheme over its tp x cp
        group); the trainer sums gradients and losses over those ranks."""
        c, n_tok = self.config, logits.shape[0]
        part = self.token_partition
        counts = F.stop_gradient(F.sum(F.one_hot(idx.reshape(-1), self.num_experts), 0))
        score_sum = F.sum(aux_scores, 0)
        self.stats = (score_sum, counts, n_tok)
        n_all = n_tok * part.pieces
        loss = None
        if c.moe_router_load_balancing_type == "seq_aux_loss" and c.moe_aux_loss_coeff:
            loss = seq_aux_loss(aux_scores, idx, self.num_experts, self.topk,
                                self.seq_length or n_tok, part) * c.moe_aux_loss_coeff
        if c.moe_router_load_balancing_type == "aux_loss" and c.moe_aux_loss_coeff:
            # Megatron's switch_load_balancing_loss_func: E / (k T^2) * sum_e P_e * C_e.
            scale = c.moe_aux_loss_coeff * self.num_experts / (self.topk * n_all * n_all)
            loss = F.sum(score_sum * part.sum_counts(counts)) * scale
        if c.moe_z_loss_coeff:
            # Megatron's z_loss_func: mean over tokens of logsumexp(logits)^2 (this rank's
            # share: its tokens' sum over the global token count).
            # logsumexp = x_0 - log_softmax(x)_0 (mint.logsumexp has no CPU kernel).
            lse = (logits - F.log_softmax(logits, -1))[:, 0]
            z = F.sum(lse * lse) * (c.moe_z_loss_coeff / n_all)
            loss = z if loss is None else loss + z
        whole = getattr(part, "whole_loss", None)
        self.aux_loss = whole(loss) if whole is not None and loss is not None else loss
        if self.training and self.expert_bias is not None and not is_recomputing():
            # Kept until the loop collects it once per forward: a forward that runs again in
            # backward (activation recompute) overwrites it with the same counts.
            self.pending_counts = counts

    def collect_counts(self, keep: bool = True) -> None:
        """Add the last forward's routed counts to the ones the next bias update uses (or drop
        them, ``keep=False``, when that forward only rebuilt a backward)."""
        if self.pending_counts is not None and keep:
            self.local_tokens_per_expert += self.pending_counts.asnumpy().astype(np.float64)
        self.pending_counts = None

    def update_expert_bias(self, reduce_counts: Optional[Callable[[np.ndarray], np.ndarray]]
                           = None) -> None:
        """Megatron's ``get_updated_expert_bias``: ``bias += rate * sign(mean(count) - count)``
        over the tokens routed since the last update; call after each optimizer step.
        ``reduce_counts`` sums the counts over the ranks that share this router (data parallel),
        so every replica applies the same update."""
        if self.expert_bias is None:
            return
        self.collect_counts()
        counts = self.local_tokens_per_expert
        if reduce_counts is not None:
            counts = reduce_counts(counts)
        step = np.sign(counts.mean() - counts) * self.config.moe_router_bias_update_rate
        bias = self.expert_bias.asnumpy().astype(np.float64) + step
        self.expert_bias.set_data(Tensor(bias.astype(np.float32)).astype(self.expert_bias.dtype))
        self.local_tokens_per_expert = np.zeros_like(counts)


_MASKED = -1e30


def group_limited_scores(choice: Tensor, num_groups: int, group_topk: int) -> Tensor:
    """DeepSeek-V3's node-limited routing (HF ``DeepseekV3TopkRouter``): a group's score is the
    sum of its two best experts' choice scores; experts outside the ``group_topk`` best groups
    get a score no top-k picks. (Megatron sums the best ``topk / group_topk`` instead; DeepSeek-V3
    has 8 / 4 = 2, and the released checkpoints define the rule, so HF's is followed.)"""
    t, e = choice.shape
    grouped = choice.reshape(t, num_groups, e // num_groups)
    best, _ = F.topk(grouped, min(2, e // num_groups), -1)
    _, top_groups = F.topk(F.sum(best, -1), group_topk, -1)                     # [T, gk]
    keep = F.sum(F.one_hot(top_groups.astype(int32), num_groups), 1)             # [T, G] 0/1
    keep = keep.expand_dims(-1).broadcast_to(grouped.shape).reshape(t, e)
    return F.where(keep > 0.5, choice, F.full_like(choice, _MASKED))


def seq_aux_loss(scores: Tensor, idx: Tensor, num_experts: int, topk: int,
                 seq_length: int, partition: Optional[LocalTokens] = None) -> Tensor:
    """DeepSeek-V3's complementary sequence-wise balance loss (without its coefficient): per
    sequence ``sum_e f_e P_e`` with ``f_e = E / (k s) * count_e`` and ``P_e`` the mean over the
    sequence of the normalised scores, averaged over sequences. Rows are ``[b*s]`` batch-first,
    ``seq_length`` this rank's piece of each sequence. With a ``partition`` over several ranks
    the per-sequence counts are summed over them and this rank's scores give its share of
    ``P_e`` (see ``TopKRouter._record``)."""
    partition = partition or LocalTokens()
    t = scores.shape[0]
    b = t // seq_length
    s_all = seq_length * partition.pieces
    counts = F.sum(F.one_hot(idx.reshape(b, -1), num_experts), 1)               # [b, E]
    counts = partition.sum_counts(F.stop_gradient(counts))
    f = counts * (num_experts / (topk * s_all))
    p = F.sum(scores.reshape(b, seq_length, num_experts), 1) / s_all
    return F.mean(F.sum(f * p, -1))
