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
model. A skipped step (``training.nan_policy skip``) clips nothing.
"""
from __future__ import annotations

from typing import List, Optional

import numpy as np
from mindspore import Tensor

from ms_llm.compat import F
from ms_llm.models.layers import SelfAttention
from ms_llm.parallel import comm
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
    (``clip``) clips W_q/W_k after each optimizer step. ``main_of(param)``: the fp32 tensor
    the optimizer updates for ``param`` (itself, or its main copy)."""

    def __init__(self, model, main_of, group, threshold: float, alpha: float, clip: bool):
        self.layers: List[SelfAttention] = [c for _, c in model.cells_and_names()
                                            if isinstance(c, SelfAttention)]
        if not self.layers:
            raise ValueError("model.qk_clip / model.log_max_attention_logit: the model has no "
                             "GQA self-attention layer to clip")
        self.main_of, self.group = main_of, group
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
        self.max_logit = best

    def _clip(self, layer: SelfAttention, logits: np.ndarray) -> None:
        eta = group_eta(logits, layer.heads_per_group, self.threshold)
        if eta is None:
            return
        w = layer.linear_qkv.weight
        scales = Tensor(qkv_row_scales(eta, layer.heads_per_group, layer.d, self.alpha))
        main = self.main_of(w)
        if main is None or tuple(main.shape) != tuple(w.shape):
            raise ValueError("model.qk_clip: the optimizer holds a shard of linear_qkv's weight "
                             "(FSDP / distributed optimizer): not built")
        F.copy_(main, main * scales.reshape(-1, 1))
        if main is not w:
            F.copy_(w, main.astype(w.dtype))

    def on_step_end(self, step: int, out: dict) -> None:
        if self.max_logit is not None:
            out["metrics"] = {**out["metrics"], "max_attention_logit": self.max_logit}
