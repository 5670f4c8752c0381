"""Multi-token prediction (DeepSeek-V3 §2.2; Megatron-Core's ``MultiTokenPredictionBlock``).

``mtp.layers.{k}`` (depth ``k + 1``) holds Megatron-Core's modules: ``enorm`` and ``hnorm``
(RMSNorms of the shifted token embedding and of the previous depth's hidden states),
``eh_proj`` ``[H, 2H]`` (applied to ``[enorm(emb); hnorm(h)]``, embedding first),
``transformer_layer`` (a decoder layer like the last one of the decoder: MLA / MoE when it is;
full (gated) attention in a hybrid model, whose MTP layer is never a Gated DeltaNet)
and ``final_layernorm`` before the shared output head. The embedding and the output head are
the main model's (HF's per-layer ``embed_tokens`` / ``shared_head.head`` copies are not kept).

Depth ``k`` at position ``i`` sees the embedding of token ``i + k`` and predicts token
``i + k + 1``: input ids, labels and the loss mask are rolled left once per depth with the
vacated positions zero-filled (Megatron-Core's ``roll_tensor``), so those positions are masked.
Depth 1 reads the decoder's output after its final layernorm, as in Megatron-Core.

The loss (``mtp_loss``) follows Megatron-Core's ``calculate_per_token_loss`` form, which is how
the trainer normalises the main loss (per token of the global batch): depth ``k`` adds
``scale / D * sum(mask_k * ce_k) * (N / N_k)`` before the global ``1 / tokens`` factor, with
``N`` the micro-batch's loss tokens and ``N_k`` those left after rolling, ``scale`` =
``mtp_loss_scaling_factor`` and ``D`` = ``mtp_num_layers``.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

from mindspore import Tensor

from ms_llm import ops as hot
from ms_llm.compat import F, nn
from .config import TransformerConfig
from .layers import TransformerLayer, norm


def roll_left(x: Tensor) -> Tensor:
    """``x[:, 1:]`` followed by one zero column (Megatron-Core's ``roll_tensor(x, -1)``)."""
    return F.cat([x[:, 1:], F.zeros_like(x[:, :1])], 1)


class MultiTokenPredictionLayer(nn.Module):
    def __init__(self, config: TransformerConfig, mlp: Optional[nn.Module] = None,
                 attention: Optional[nn.Module] = None):
        super().__init__()
        c = config
        # the config's RMSNorm: zero-centred (1 + weight) in Qwen3-Next / Qwen3.5, whose MTP
        # norms are the decoder's kind
        self.enorm = norm(c, c.hidden_size)
        self.hnorm = norm(c, c.hidden_size)
        self.eh_proj = hot.Linear(2 * c.hidden_size, c.hidden_size, bias=False,
                                  init_std=c.init_method_std, dtype=c.params_dtype)
        self.transformer_layer = TransformerLayer(c, mlp, attention)
        self.final_layernorm = norm(c, c.hidden_size)

    def forward(self, hidden: Tensor, embedded: Tensor, cos: Tensor, sin: Tensor,
                attention_mask: Optional[Tensor] = None) -> Tensor:
        x = self.eh_proj(F.cat([self.enorm(embedded), self.hnorm(hidden)], -1))
        x = self.transformer_layer(x, cos, sin, attention_mask)
        return self.final_layernorm(x)


class MultiTokenPredictionBlock(nn.Module):
    """``mtp_num_layers`` sequential depths; ``forward`` returns each depth's hidden states."""

    def __init__(self, config: TransformerConfig,
                 make_layer: Callable[[int], MultiTokenPredictionLayer]):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList([make_layer(config.num_layers + k)
                                     for k in range(config.mtp_num_layers)])
        self.last_per_token: List[Tensor] = []   # per-depth cross entropy of the last forward

    def forward(self, hidden: Tensor, input_ids: Tensor, embed: Callable[[Tensor], Tensor],
                cos: Tensor, sin: Tensor, attention_mask: Optional[Tensor] = None
                ) -> List[Tensor]:
        out = []
        for layer in self.layers:
            input_ids = roll_left(input_ids)
            hidden = layer(hidden, embed(input_ids), cos, sin, attention_mask)
            out.append(hidden)
        return out


def mtp_loss(config: TransformerConfig, per_token: List[Tensor], loss_mask: Tensor
             ) -> Tuple[Tensor, List[Tensor]]:
    """``(loss term, per-depth mean losses for logging)`` of one micro-batch, the term still to
    be multiplied by the global ``1 / loss tokens`` (see the module docstring). ``per_token``:
    depth ``k``'s cross entropy ``[b, s]`` against labels rolled ``k`` times."""
    scale = config.mtp_loss_scaling_factor / config.mtp_num_layers
    mask = loss_mask.astype(per_token[0].dtype)
    n = mask.sum()
    total, means = None, []
    for ce in per_token:
        mask = roll_left(mask)
        n_k = F.clamp(mask.sum(), min=1.0)
        summed = (ce * mask).sum()
        means.append(summed / n_k)
        term = summed * (n / n_k) * scale
        total = term if total is None else total + term
    return total, means
