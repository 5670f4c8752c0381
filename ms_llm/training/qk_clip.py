"""QK-clip (Kimi K2's MuonClip; Megatron-Core's ``qk_clip``, ``qk_clip_alpha``,
``qk_clip_threshold``, ``log_max_attention_logit``) as a trainer callback.

Every training forward records each attention layer's per-head max logit
(``CoreAttention.current_max_attn_logits``). After the optimizer step the per-head maxima are
reduced (max) over the data-parallel x context-parallel replicas, the largest is logged as
``max_attention_logit``, and with ``qk_clip`` each layer's query groups whose max (over the
group's heads, as Megatron-Core's GQA ``clip_qk`` takes it) exceeds the threshold ``t`` are
rescaled with ``eta = min(t / max, 1)``: that group's W_q rows by ``eta^alpha`` and its W_k rows
by ``eta^(1 - alpha)``, so its logits shrink by ``eta`` (without QK-norm and QKV bias, which,
as in Megatron, are left as they are). The fp32 main copy is clipped and rounded into a bf16
model. Sharded mains are clipped on their rows: an FSDP shard of the weight (its rows of the
per-row scales), and under the distributed optimizer this rank's main shard together with the
whole model weight (already gathered for this step). Under pipeline parallel the logged max is
reduced over the stages too. A skipped step (``training.nan_policy skip``) clips nothing.
"""
from __future__ import annotations

from typing import List, Optional

import numpy as np
from mindspore import Tensor

from ms_llm.compat import F, float32
from ms_llm.models.layers import SelfAttention
from ms_llm.parallel import comm
from ms_llm.parallel.placement import RowShard, placement_of
from .callbacks import TrainerCallback


def group_eta(max_logits: np.ndarray, heads_per_group: int, threshold: float
              ) -> Optional[np.ndarray]:
    """Per query group ``min(threshold / max logit of its heads, 1)``, or None when no group
    exceeds the threshold (nothing to clip)."""
    grouped = np.asarray(max_logits, np.float64).reshape(-1, heads_per_group).max(axis=1)
    if not np.any(grouped > threshold):
        return None
    return np.minimum(threshold / grouped, 1.0)


def qkv_row_scales(eta: np.ndarray, heads_per_group: int, head_dim: int, alpha: float
                   ) -> np.ndarray:
    """Per row of the fused ``linear_qkv`` weight (``[q | k | v]`` per group): ``eta^alpha`` on
    the group's query rows, ``eta^(1-alpha)`` on its key rows, 1 on its value rows."""
    r, d = heads_per_group, head_dim
    per_group = [np.concatenate([np.full(r * d, e ** alpha), np.full(d, e ** (1.0 - alpha)),
                                 np.ones(d)]) for e in eta]
    return np.concatenate(per_group).astype(np.float32)


class QKClip(TrainerCallback):
    """Records the max attention logits of ``model``'s GQA attention layers, logs them and
    (``clip``) clips W_q/W_k after each optimizer step. ``optimizer``: what it updates for a
    parameter (``checkpoint_tensor``: itself or its fp32 main copy; a distributed optimizer's
    ``main_shard``); ``pstate``: the groups of FSDP cuts; ``pp_group``: the stages whose maxima
    the log reduces."""

    def __init__(self, model, optimizer, pstate, group, threshold: float, alpha: float,
                 clip: bool, pp_group=None):
        self.layers: List[SelfAttention] = [c for _, c in model.cells_and_names()
                                            if isinstance(c, SelfAttention)]
        if not self.layers:
            raise ValueError("model.qk_clip / model.log_max_attention_logit: the model has no "
                             "GQA self-attention layer to clip")
        self.optimizer, self.pstate, self.group, self.pp_group = optimizer, pstate, group, pp_group
        self.threshold, self.alpha, self.clip = threshold, alpha, clip
        self.max_logit: Optional[float] = None
        self.layer_logits: List[np.ndarray] = []     # the last step's, per layer (reduced)
        for layer in self.layers:
            layer.core_attention.record_max_logit = True

    def on_update(self, step: int, skipped: bool) -> None:
        best, self.layer_logits = None, []
        for layer in self.layers:
            core = layer.core_attention
            m, core.current_max_attn_logits = core.current_max_attn_logits, None
            if m is None:
                continue
            comm.all_reduce(m, op="max", group=self.group)
            logits = m.asnumpy()
            self.layer_logits.append(logits)
            best = float(logits.max()) if best is None else max(best, float(logits.max()))
            if self.clip and not skipped:
                self._clip(layer, logits)
        if self.pp_group is not None and self.pp_group.size > 1:   # every stage's layers
            t = Tensor(np.array([-np.inf if best is None else best], np.float32))
            comm.all_reduce(t, op="max", group=self.pp_group)
            best = None if not np.isfinite(t.asnumpy()[0]) else float(t.asnumpy()[0])
        self.max_logit = best

    def _clip(self, layer: SelfAttention, logits: np.ndarray) -> None:
        eta = group_eta(logits, layer.heads_per_group, self.threshold)
        if eta is None:
            return
        w = layer.linear_qkv.weight
        scales = qkv_row_scales(eta, layer.heads_per_group, layer.d, self.alpha)
        main, start = self._main_rows(w, len(scales))
        if main is not None:
            rows = Tensor(scales[start:start + main.shape[0]]).reshape(-1, 1)
            F.copy_(main, main * rows)
        if main is w:
            return
        if w.shape[0] == len(scales) and (main is None or main.shape[0] != len(scales)):
            # distributed optimizer: the whole model weight was gathered before this callback
            F.copy_(w, (w.astype(float32) * Tensor(scales).reshape(-1, 1)).astype(w.dtype))
        elif main is not None:
            F.copy_(w, main.astype(w.dtype))

    def _main_rows(self, w, rows: int) -> tuple:
        """(the fp32 tensor the optimizer updates for ``w``, or None: an empty shard here; the
        first of the ``rows`` rows of the layer's weight it holds)."""
        shard = getattr(self.optimizer, "main_shard", None)
        if shard is not None:                           # distributed optimizer
            return shard(w)
        main = self.optimizer.checkpoint_tensor(w)
        cut = placement_of(w).dp_cut
        if cut is None:
            return main, 0
        g = self.pstate.group(cut)                       # FSDP: w is this rank's rows
        return main, RowShard(rows, g.size, g.rank).start

    def on_step_end(self, step: int, out: dict) -> None:
        if self.max_logit is not None:
            out["metrics"] = {**out["metrics"], "max_attention_logit": self.max_logit}
