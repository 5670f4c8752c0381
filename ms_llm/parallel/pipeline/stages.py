"""Cutting a ``GPTModel`` into pipeline stages (Megatron's layer assignment, MindSpeed's
``--num-layer-list`` and ``--noop-layers``).

With ``pp`` ranks and ``vpp`` model chunks per rank there are ``pp * vpp`` virtual stages; virtual
stage (``v = chunk * pp + rank``, Megatron's interleaving, or the schedule's ``placement``) holds a
contiguous range of global layer indices. Noop layers (MindSpeed) count in that assignment but are
not built: they pass activations through unchanged and exist only to balance stages. The embedding
lives on virtual stage 0, the final norm, output layer, multi-token prediction block and loss on
the last one; with tied embeddings or MTP (which embeds the shifted tokens) the last stage keeps
its own copy of the embedding weight, tied to the first stage's by summing the two gradients over
the embedding group (``Placement.partial`` over ``emb``), as Megatron does.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

from mindspore import Tensor

from ms_llm.compat import F, nn
from ms_llm.compat.autograd import Function
from ms_llm.models.moe import MoELayer
from ..placement import add_partial, add_shard, placement_of, set_placement, update_placement
from .schedules import ROUND_ROBIN, StagePlacement


def layer_ranges(num_layers: int, pp: int, vpp: int = 1,
                 num_layer_list: Optional[Sequence[int]] = None) -> List[range]:
    """Global layer indices of every virtual stage (``pp * vpp`` ranges, in pipeline order)."""
    stages = pp * vpp
    if num_layer_list:
        counts = [int(c) for c in num_layer_list]
        if len(counts) != stages:
            raise ValueError(f"parallel.num_layer_list has {len(counts)} entries; it needs one "
                             f"per pipeline stage ({stages} = pipeline x virtual pipeline size)")
        if any(c < 1 for c in counts):
            raise ValueError(f"parallel.num_layer_list {counts}: every stage needs >= 1 layer")
        if sum(counts) != num_layers:
            raise ValueError(f"parallel.num_layer_list {counts} sums to {sum(counts)}, but "
                             f"model.num_layers is {num_layers}")
    else:
        if num_layers % stages:
            raise ValueError(f"model.num_layers ({num_layers}) is not divisible by pipeline x "
                             f"virtual pipeline size ({pp} x {vpp}); set parallel.num_layer_list "
                             f"for uneven stages")
        counts = [num_layers // stages] * stages
    out, start = [], 0
    for c in counts:
        out.append(range(start, start + c))
        start += c
    return out


def check_noop_layers(noop_layers: Sequence[int], num_layers: int) -> List[int]:
    bad = [i for i in noop_layers if not 0 <= int(i) < num_layers]
    if bad:
        raise ValueError(f"parallel.noop_layers {bad} out of range: model.num_layers is "
                         f"{num_layers} (indices 0..{num_layers - 1})")
    return sorted({int(i) for i in noop_layers})


class AttachAuxLoss(Function):
    """Identity on the hidden states whose backward also gives the chunk's MoE auxiliary loss its
    gradient (``scale``), so a stage that does not end in the loss still trains its routers
    (Megatron's ``MoEAuxLossAutoScaler``)."""

    @staticmethod
    def forward(ctx, scale, h, aux):
        ctx.scale, ctx.aux_shape, ctx.aux_dtype = scale, aux.shape, aux.dtype
        return h * 1

    @staticmethod
    def backward(ctx, dh):
        return None, dh, F.full(ctx.aux_shape, ctx.scale, dtype=ctx.aux_dtype)


class NoopLayer(nn.Module):
    """A transformer layer that passes its input through (MindSpeed's noop layers)."""

    def forward(self, x: Tensor, *args) -> Tensor:
        return x


def apply_noop_layers(model, noop_layers: Sequence[int]) -> None:
    """Replace the listed layers by ``NoopLayer`` (any layout, also without pipeline)."""
    noop = set(check_noop_layers(noop_layers, model.config.num_layers))
    if noop:
        model.decoder.layers = nn.ModuleList([NoopLayer() if i in noop else layer
                                              for i, layer in enumerate(model.decoder.layers)])


class PipelineChunk(nn.Module):
    """One virtual stage of a ``GPTModel``: the model's own sub-modules (so tensor parallel,
    quantization and checkpoint names apply unchanged), run from the stage's input (token ids on
    the first stage, hidden states elsewhere) to its output (hidden states, or on the last stage
    the per-token loss)."""

    def __init__(self, model, layers: Sequence[int], first: bool, last: bool, tied_copy: bool):
        super().__init__()
        self.config = model.config
        self.first, self.last = first, last
        self.global_layers = list(layers)
        self.embedding = model.embedding if (first or tied_copy) else None
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleList([model.decoder.layers[i] for i in layers])
        self.decoder.final_layernorm = model.decoder.final_layernorm if last else None
        self.output_layer = model.output_layer if last else None
        self.mtp = model.mtp if last else None
        self._model = [model]          # the head functions (tensor parallel swaps them)
        own = list(self.decoder.layers) + ([m.transformer_layer for m in self.mtp.layers]
                                           if self.mtp is not None else [])
        self.moe_layers = [layer.mlp for layer in own
                           if isinstance(getattr(layer, "mlp", None), MoELayer)]
        self.aux_loss_scale = 1.0      # the trainer's per-micro-batch weight of the aux loss
        self.last_aux_loss: Optional[Tensor] = None   # its weighted value in the last forward

    def forward(self, x: Tensor, seq_len: int, labels: Optional[Tensor] = None,
                attention_mask: Optional[Tensor] = None,
                position_ids: Optional[Tensor] = None,
                tokens: Optional[Tensor] = None) -> Tensor:
        """``seq_len`` is the full sequence (sequence parallel splits hidden states over tp);
        ``tokens``: the micro-batch's input ids, which the last stage's MTP block embeds
        shifted (its per-depth losses are left in ``model.mtp.last_per_token``, as
        ``GPTModel.forward`` leaves them)."""
        model = self._model[0]
        cos, sin = model.rotary_cos_sin(seq_len, position_ids)
        h = self.embedding(x) if self.first else x
        for layer in self.decoder.layers:
            h = layer(h, cos, sin, attention_mask)
        if not self.last:
            return self._attach_aux_loss(h)
        h = self.decoder.final_layernorm(h)
        if self.output_layer is not None:
            logits = self.output_layer(h)
        else:
            logits = model.compute_logits(h, self.embedding.word_embeddings.weight)
        if self.mtp is not None:
            model.mtp.last_per_token = model._mtp_per_token(h, tokens, labels, cos, sin,
                                                            attention_mask)
        # after the MTP block, whose MoE routers add their aux losses too
        return self._attach_aux_loss(model.loss_fn(logits, labels))

    def _attach_aux_loss(self, out: Tensor) -> Tensor:
        aux = self._aux_loss()
        self.last_aux_loss = None if aux is None else aux * self.aux_loss_scale
        return out if aux is None else AttachAuxLoss.apply(self.aux_loss_scale, out, aux)

    def _aux_loss(self) -> Optional[Tensor]:
        total = None
        for mlp in self.moe_layers:
            loss = mlp.router.aux_loss
            if loss is not None:
                total = loss if total is None else total + loss
        return total


def split_model(model, pstate, vpp: int = 1, num_layer_list: Optional[Sequence[int]] = None,
                noop_layers: Sequence[int] = (),
                placement: StagePlacement = ROUND_ROBIN) -> List[PipelineChunk]:
    """This rank's model chunks (``vpp`` of them), each recording the global index of its layers
    in every parameter's ``Placement`` (checkpoints store layers under their global index).
    ``placement``: the schedule's virtual stage of each chunk; where it puts the first and the
    last stage on one rank (a V), that rank keeps one embedding for both (nothing to tie across
    ranks)."""
    pp, rank = pstate.sizes.pp, pstate.pp_rank
    n = model.config.num_layers
    ranges = layer_ranges(n, pp, vpp, num_layer_list)
    noop = set(check_noop_layers(noop_layers, n))    # already NoopLayer: nothing to keep
    tied = model.output_layer is None
    # the last stage's copy of the embedding (tied head, or the MTP block's shifted tokens)
    copy = tied or getattr(model, "mtp", None) is not None
    chunks = []
    for c in range(vpp):
        v = placement.virtual_stage(rank, c, pp)
        keep = [i for i in ranges[v] if i not in noop]
        first, last = v == 0, v == pp * vpp - 1
        chunk = PipelineChunk(model, keep, first, last, tied_copy=last and copy and pp * vpp > 1)
        for local, glob in enumerate(keep):
            for _, p in chunk.decoder.layers[local].parameters_and_names():
                pl = placement_of(p)
                update_placement(p, global_index=pl.global_index + (("layers", local, glob),))
        chunks.append(chunk)
    if pp > 1:
        for chunk in chunks:
            for _, p in chunk.parameters_and_names():
                if not placement_of(p).sharded_over("pp"):
                    set_placement(p, add_shard(p, p.shape, "pp", None))
        # a copy to tie only where the first and the last stage are on different ranks (not in
        # a V, whose rank 0 holds both and so the one module)
        apart = placement.stage_of(0, pp)[0] != placement.stage_of(pp * vpp - 1, pp)[0]
        if copy and apart:
            for chunk in chunks:
                if chunk.embedding is not None:
                    add_partial(chunk.embedding.word_embeddings.weight, "emb")
    return chunks
