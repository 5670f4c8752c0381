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
from ms_llm.compat import F, nn
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


from .moe_router import (LocalTokens, TopKRouter, group_limited_scores,  # noqa: F401,E402
                         seq_aux_loss)


class MoELocalTokenDispatcher:
    """Single-rank dispatcher (expert-parallel size 1), with the interface of Megatron's
    ``MoEAlltoAllTokenDispatcher``: ``token_permutation`` sorts the routed rows by expert and
    returns them with the per-expert counts; ``token_unpermutation`` restores slot order and does
    the probability-weighted combine. State between the two calls lives on the dispatcher.

    An expert-parallel dispatcher overrides both: permute locally, exchange counts, all-to-all
    the rows to the ranks owning the experts (and regroup by local expert); the reverse on the
    way back before calling this class's combine."""

    # Subclasses that exchange the block sizes between ranks need them as a host list; this
    # class keeps them an int32 device tensor on the fused CPU path (no host sync in the step).
    host_counts = False

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
                          top_indices: Tensor) -> Tuple[Tensor, moe_ops.Sizes]:
        """``(rows in expert order, tokens_per_expert)``; the sizes are a host list, or an int32
        tensor on the fused CPU path when ``host_counts`` is False."""
        self._probs = probs
        if moe_ops.fused_available(hidden_states):
            sorted_slots, restore, counts = moe_ops.sort_by_expert_device(top_indices,
                                                                          self.num_experts)
            self._restore = restore
            permuted = moe_ops.permute_rows(hidden_states, sorted_slots, restore)
            return permuted, (moe_ops.host_sizes(counts) if self.host_counts else counts)
        sorted_slots, restore, tokens_per_expert = moe_ops.sort_by_expert(top_indices,
                                                                          self.num_experts)
        self._restore = restore
        return moe_ops.permute(hidden_states, sorted_slots, self.topk), tokens_per_expert

    def token_unpermutation(self, expert_output: Tensor) -> Tensor:
        if self._restore is None:
            raise RuntimeError("token_unpermutation called without token_permutation")
        out = moe_ops.unpermute(expert_output, self._restore, self._probs)
        self._restore = self._probs = None
        return out


def use_fused_ffn(impl: str, *tensors: Tensor) -> bool:
    """Whether the experts run as one fused FFN op (``ms_llm.ops.moe.expert_ffn``): ``impl``
    "auto" where it applies (CPU, fp32, BLAS kernels), "fused" to require it; any
    ``grouped_matmul`` form (``loop``, ``padded_bmm``, ``native``) keeps the composed path."""
    if impl not in ("auto", "fused"):
        return False
    ok = moe_ops.fused_available(*tensors)
    if impl == "fused" and not ok:
        raise RuntimeError("experts gmm_impl 'fused' needs the CPU BLAS kernels and fp32 "
                           "tensors; use 'auto' or 'loop'")
    return ok


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
        self.gmm_impl = "auto"   # "fused" or a form of ms_llm.ops.moe.grouped_matmul

    def forward(self, x: Tensor, tokens_per_expert: moe_ops.Sizes) -> Tensor:
        if not self.plain_linears():
            return self._module_loop(x, moe_ops.host_sizes(tokens_per_expert))
        fc1, fc2, _ = self.expert_weights()
        if use_fused_ffn(self.gmm_impl, x, fc1[0], fc2[0]):
            return moe_ops.expert_ffn(x, fc1, fc2, tokens_per_expert, transpose_b=True)
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

    def forward(self, x: Tensor, tokens_per_expert: moe_ops.Sizes) -> Tensor:
        w1, w2, _ = self.expert_weights()
        if use_fused_ffn(self.gmm_impl, x, w1, w2):
            return moe_ops.expert_ffn(x, w1, w2, tokens_per_expert, transpose_b=False)
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
            # the per-token gate broadcast explicitly: a broadcasting product's backward sums
            # in the input dtype, which has no bf16 kernel on CPU (F.broadcast_to sums in fp32)
            out = out * F.broadcast_to(F.sigmoid(F.linear(x, self.gate_weight)), out.shape)
        return out


class WholeSequence:
    """Where the routed path of a MoE layer takes its tokens from: the layer's input as is.

    Why: under tensor parallel without sequence parallel every tensor rank holds the whole
    sequence, but each rank must route only its own piece of it (the routed tokens of the
    tp x ep group are exchanged once, as Megatron-Core does); a parallel layout installs an
    object with this interface (``MoELayer.sequence_shard``) that keeps this rank's piece on the
    way in and gathers the pieces on the way out. The model itself stays parallelism-free."""

    @staticmethod
    def enter(hidden_states: Tensor) -> Tensor:
        return hidden_states

    leave = enter     # the whole sequence back out, as is


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
        self.sequence_shard = WholeSequence()   # replaced from outside under tensor parallel
        self.last_top_indices: Optional[Tensor] = None

    def forward(self, hidden_states: Tensor) -> Tensor:
        if _run_in_jit():
            raise RuntimeError(JIT_UNSUPPORTED)
        tokens = self.sequence_shard.enter(hidden_states)
        shape = tokens.shape
        x = tokens.reshape(-1, shape[-1])
        self.router.seq_length = shape[1] if len(shape) == 3 else None
        probs, top_indices = self.router(x)
        self.last_top_indices = top_indices
        y = self.token_dispatcher.run(x, probs, top_indices, self.experts)
        y = self.sequence_shard.leave(y.reshape(shape))
        if self.shared_experts is not None:
            y = y + self.shared_experts(hidden_states)
        return y


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
