"""Dropless mixture-of-experts MLP with Megatron-Core's module tree and state-dict keys.

``decoder.layers.{i}.mlp`` of a MoE layer holds

* ``router.weight`` ``[E, H]`` (HF ``mlp.gate.weight``) and, for aux-loss-free balancing,
  ``router.expert_bias`` ``[E]`` (not trained by the optimizer; see ``update_expert_bias``);
* ``experts.local_experts.{j}.linear_fc1.weight`` ``[2F, H]`` (``[gate; up]``) and
  ``...linear_fc2.weight`` ``[H, F]`` (Megatron's ``SequentialMLP``), or with
  ``moe_grouped_gemm`` ``experts.weight1`` ``[H, E*2F]`` / ``experts.weight2`` ``[E*F, H]``
  whose memory is viewed ``[E, H, 2F]`` / ``[E, F, H]`` (Megatron's ``GroupedMLP``);
* optionally ``shared_experts.linear_fc1/linear_fc2.weight`` and ``shared_experts.gate_weight``
  ``[1, H]`` (Megatron's ``SharedExpertMLP``; HF Qwen2-MoE's ``shared_expert_gate``).

The forward is Megatron's: route -> ``token_dispatcher.token_permutation`` -> experts ->
``token_dispatcher.token_unpermutation`` (+ shared experts). The dispatcher is the extension point
for expert parallelism: an all-to-all dispatcher replaces those two steps and nothing else.

Auxiliary losses are not part of the model output (``GPTModel`` returns per-token losses); each
router keeps the differentiable loss of its last forward, and ``aux_loss(model)``
(``GPTModel.aux_loss()``) sums them so the trainer adds them to the loss inside the same
``value_and_grad`` call. PyNative only: the expert block sizes are data dependent.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import numpy as np
from mindspore import Tensor
from mindspore.ops import constexpr

from ms_llm import ops as hot
from ms_llm.compat import F, float32, int32, nn
from ms_llm.compat.autograd import is_recomputing
from ms_llm.ops import moe as moe_ops
from .config import TransformerConfig
from .layers import MLP, output_init_std


JIT_UNSUPPORTED = ("mlp_type 'moe' runs in PyNative only: the dropless expert blocks have "
                   "data-dependent sizes that mindspore.jit cannot compile "
                   "(set training.jit false)")


def _probe() -> int:
    return 0


@constexpr(check=False)
def _is_none(func) -> bool:
    return func is None


def _run_in_jit() -> bool:
    """True while mindspore.jit compiles the caller: a Python function passed to a constexpr
    arrives as None in graph mode (the mechanism of MindSpore's private ``_run_in_jit``)."""
    return _is_none(_probe)


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
        self.aux_loss = loss
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


class MoELocalTokenDispatcher:
    """Single-rank dispatcher (expert-parallel size 1), with the interface of Megatron's
    ``MoEAlltoAllTokenDispatcher``: ``token_permutation`` sorts the routed rows by expert and
    returns them with the per-expert counts; ``token_unpermutation`` restores slot order and does
    the probability-weighted combine. State between the two calls lives on the dispatcher.

    An expert-parallel dispatcher overrides both: permute locally, exchange counts, all-to-all
    the rows to the ranks owning the experts (and regroup by local expert); the reverse on the
    way back before calling this class's combine."""

    def __init__(self, num_experts: int, topk: int):
        self.num_experts, self.topk = num_experts, topk
        self._restore: Optional[Tensor] = None
        self._probs: Optional[Tensor] = None

    def run(self, hidden_states: Tensor, probs: Tensor, top_indices: Tensor,
            experts: nn.Module) -> Tensor:
        """Megatron's MoELayer body: permute -> experts -> unpermute. A fused dispatcher
        (MegaMoE) overrides this to interleave communication with the experts' compute."""
        permuted, tokens_per_expert = self.token_permutation(hidden_states, probs, top_indices)
        return self.token_unpermutation(experts(permuted, tokens_per_expert))

    def token_permutation(self, hidden_states: Tensor, probs: Tensor,
                          top_indices: Tensor) -> Tuple[Tensor, List[int]]:
        sorted_slots, restore, tokens_per_expert = moe_ops.sort_by_expert(top_indices,
                                                                          self.num_experts)
        self._restore, self._probs = restore, probs
        return moe_ops.permute(hidden_states, sorted_slots, self.topk), tokens_per_expert

    def token_unpermutation(self, expert_output: Tensor) -> Tensor:
        if self._restore is None:
            raise RuntimeError("token_unpermutation called without token_permutation")
        out = moe_ops.unpermute(expert_output, self._restore, self._probs)
        self._restore = self._probs = None
        return out


class ExpertMLP(nn.Module):
    """One expert: ``linear_fc2(silu(gate) * up)``, ``linear_fc1 = [gate; up]``, no bias."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        c, f = config, config.moe_ffn_hidden_size
        self.linear_fc1 = hot.Linear(c.hidden_size, 2 * f, bias=False, init_std=c.init_method_std,
                                     dtype=c.params_dtype)
        self.linear_fc2 = hot.Linear(f, c.hidden_size, bias=False, init_std=output_init_std(c),
                                     dtype=c.params_dtype)


class SequentialMLP(nn.Module):
    """Megatron's ``SequentialMLP`` parameters (``local_experts.{j}``), computed as two grouped
    matmuls over the expert-sorted rows (no per-expert module calls)."""

    def __init__(self, config: TransformerConfig, num_local_experts: Optional[int] = None):
        super().__init__()
        self.num_local_experts = num_local_experts or config.num_moe_experts
        self.local_experts = nn.ModuleList([ExpertMLP(config)
                                            for _ in range(self.num_local_experts)])
        self.gmm_impl = "auto"   # see ms_llm.ops.moe.grouped_matmul

    def forward(self, x: Tensor, tokens_per_expert: List[int]) -> Tensor:
        if not self.plain_linears():
            return self._module_loop(x, tokens_per_expert)
        fc1, fc2, _ = self.expert_weights()
        h = moe_ops.grouped_matmul(x, fc1, tokens_per_expert, transpose_b=True, impl=self.gmm_impl)
        h = hot.swiglu(h)
        return moe_ops.grouped_matmul(h, fc2, tokens_per_expert, transpose_b=True,
                                      impl=self.gmm_impl)

    def plain_linears(self) -> bool:
        """False once a converter replaced the experts' linears (e.g. MXFP8): their own forward
        must then run, not a grouped matmul over their raw weights."""
        return all(type(m) is hot.Linear for e in self.local_experts
                   for m in (e.linear_fc1, e.linear_fc2))

    def _module_loop(self, x: Tensor, tokens_per_expert: List[int]) -> Tensor:
        outs = [e.linear_fc2(hot.swiglu(e.linear_fc1(xe)))
                for e, xe, n in zip(self.local_experts, F.split(x, list(tokens_per_expert), 0),
                                    tokens_per_expert) if n]
        if not outs:
            return F.zeros(0, x.shape[-1], dtype=x.dtype)
        return outs[0] if len(outs) == 1 else F.cat(outs, 0)

    def expert_weights(self) -> Tuple[List[Tensor], List[Tensor], bool]:
        """Per local expert ``(fc1 [2F, H], fc2 [H, F], transpose_b=True)`` (Linear layout)."""
        return ([e.linear_fc1.weight for e in self.local_experts],
                [e.linear_fc2.weight for e in self.local_experts], True)

    def weight_params(self) -> List[Tensor]:
        fc1, fc2, _ = self.expert_weights()
        return fc1 + fc2



class GroupedMLP(nn.Module):
    """Megatron's ``GroupedMLP`` (``--moe-grouped-gemm``): ``weight1`` ``[H, E*2F]`` viewed
    ``[E, H, 2F]`` (expert e's ``linear_fc1.T``), ``weight2`` ``[E*F, H]`` viewed ``[E, F, H]``."""

    def __init__(self, config: TransformerConfig, num_local_experts: Optional[int] = None):
        super().__init__()
        c = config
        self.num_local_experts = num_local_experts or c.num_moe_experts
        e, f, h = self.num_local_experts, c.moe_ffn_hidden_size, c.hidden_size
        self.weight1 = nn.new_parameter((h, e * 2 * f), std=c.init_method_std, dtype=c.params_dtype)
        self.weight2 = nn.new_parameter((e * f, h), std=output_init_std(c), dtype=c.params_dtype)
        # Checkpoints store weight1 as rows of 2F ([E*H, 2F], the ``row_blocks`` placement set
        # by ``parallelize_model``): every expert, and every shard of experts, is a block of rows.
        self.gmm_impl = "auto"

    def forward(self, x: Tensor, tokens_per_expert: List[int]) -> Tensor:
        w1, w2, _ = self.expert_weights()
        h = moe_ops.grouped_matmul(x, w1, tokens_per_expert, impl=self.gmm_impl)
        h = hot.swiglu(h)
        return moe_ops.grouped_matmul(h, w2, tokens_per_expert, impl=self.gmm_impl)

    def expert_weights(self) -> Tuple[Tensor, Tensor, bool]:
        """``(w1 [E, H, 2F], w2 [E, F, H], transpose_b=False)`` views of the flat weights."""
        e, hdim = self.num_local_experts, self.weight1.shape[0]
        return self.weight1.reshape(e, hdim, -1), self.weight2.reshape(e, -1, hdim), False

    def weight_params(self) -> List[Tensor]:
        return [self.weight1, self.weight2]


class SharedExpertMLP(MLP):
    """Dense SwiGLU MLP every token passes through, optionally scaled per token by
    ``sigmoid(x . gate_weight)`` (Megatron's ``SharedExpertMLP``)."""

    def __init__(self, config: TransformerConfig):
        super().__init__(config.replace(ffn_hidden_size=config.moe_shared_expert_intermediate_size))
        c = config
        self.gate_weight = nn.new_parameter((1, c.hidden_size), std=c.init_method_std,
                                            dtype=c.params_dtype) if c.moe_shared_expert_gate \
            else None

    def forward(self, x: Tensor) -> Tensor:
        out = super().forward(x)
        if self.gate_weight is not None:
            out = out * F.sigmoid(F.linear(x, self.gate_weight))
        return out


class MoELayer(nn.Module):
    """The MLP of a MoE transformer layer (``decoder.layers.{i}.mlp``); ``[b, s, H] -> [b, s, H]``.
    ``last_top_indices`` holds the last forward's routing (``[b*s, k]`` expert ids)."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        c = config
        self.config = c
        self.router = TopKRouter(c)
        self.experts = GroupedMLP(c) if c.moe_grouped_gemm else SequentialMLP(c)
        self.shared_experts = SharedExpertMLP(c) if c.moe_shared_expert_intermediate_size else None
        self.token_dispatcher = MoELocalTokenDispatcher(c.num_moe_experts, c.moe_router_topk)
        self.last_top_indices: Optional[Tensor] = None

    def forward(self, hidden_states: Tensor) -> Tensor:
        if _run_in_jit():
            raise RuntimeError(JIT_UNSUPPORTED)
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        self.router.seq_length = shape[1] if len(shape) == 3 else None
        probs, top_indices = self.router(x)
        self.last_top_indices = top_indices
        y = self.token_dispatcher.run(x, probs, top_indices, self.experts)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y.reshape(shape)


def moe_mlp_factory(config: TransformerConfig, layer_idx: int) -> Optional[nn.Module]:
    """``GPTModel``'s ``mlp_factory`` for ``mlp_type: moe``: a MoELayer where
    ``config.is_moe_layer(i)``, ``None`` (the dense MLP) elsewhere."""
    return MoELayer(config) if config.is_moe_layer(layer_idx) else None


def moe_layers(model: nn.Module) -> List[MoELayer]:
    return [cell for _, cell in model.cells_and_names() if isinstance(cell, MoELayer)]


def aux_loss(model: nn.Module) -> Optional[Tensor]:
    """Sum of the routers' auxiliary losses (load balancing + z-loss) of the last forward, to be
    added to the language-model loss inside the differentiated function; ``None`` if there are
    none (dense model, or coefficients 0)."""
    total = None
    for layer in moe_layers(model):
        loss = layer.router.aux_loss
        if loss is not None:
            total = loss if total is None else total + loss
    return total


def hf_load_balancing_loss(model: nn.Module) -> Tensor:
    """Hugging Face's ``load_balancing_loss_func`` over the last forward (all MoE layers'
    tokens pooled, as HF concatenates the layers' router logits), without its coefficient:
    ``E * sum_e (C_e / N) * (P_e / N)`` with ``C_e`` the routed slots of expert e, ``P_e`` the
    summed softmax probabilities and ``N`` the tokens times layers. Megatron's per-layer form
    (``aux_loss``) differs from it by ``1/k`` and by pooling."""
    layers = moe_layers(model)
    if not layers or any(l.router.stats is None for l in layers):
        raise RuntimeError("hf_load_balancing_loss: run a forward through a MoE model first")
    score, counts, n = None, None, 0
    for layer in layers:
        s, c, t = layer.router.stats
        score = s if score is None else score + s
        counts = c if counts is None else counts + c
        n += t
    return F.sum(counts * score) * (layers[0].router.num_experts / float(n * n))


def collect_router_counts(model: nn.Module, keep: bool = True) -> None:
    """Once per forward that trains: every router's routed counts join the next bias update
    (``TopKRouter.collect_counts``)."""
    for _, cell in model.cells_and_names():
        if isinstance(cell, TopKRouter):
            cell.collect_counts(keep)


def update_expert_bias(model: nn.Module,
                       reduce_counts: Optional[Callable[[np.ndarray], np.ndarray]] = None) -> None:
    """Apply the aux-loss-free bias update of every router in ``model`` (a model, a layer or a
    router; no-op without expert bias); ``reduce_counts`` as in ``TopKRouter``."""
    for _, cell in model.cells_and_names():
        if isinstance(cell, TopKRouter):
            cell.update_expert_bias(reduce_counts)
