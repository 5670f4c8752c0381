"""Activation recompute, applied from outside the model (torchtitan's ``apply_ac``) with
Megatron's knobs: ``training.recompute_granularity`` (``full``: whole transformer layers;
``selective``: the attention core, Megatron's ``core_attention``: the [s, s] scores and softmax,
the largest activations at long sequence for the least compute), ``training.recompute_method``
(``uniform``: every layer; ``block``: the first ``recompute_num_layers`` layers of each pipeline
stage / model chunk) and MindSpeed's ``training.recompute_norm`` (the RMSNorms).

A recomputed module keeps only its inputs in forward and runs again in backward
(``Cell.recompute``; MindSpore 2.10's non-reentrant form fails in PyNative with "Stack
input_args_info_stack_ is empty", and ``mindspore.recompute`` on a wrapper loses the
parameters' gradients). Names and state-dict keys do not change. Routing is a deterministic
function of the same inputs and weights, so the re-run makes the same decisions; the routers'
token counts are collected once per forward by the training loop, so the re-run does not count
them twice.

Under context parallel the re-run includes the cp attention's collectives (ring exchanges,
Ulysses all-to-alls, inside hand-written backward functions): every cp rank recomputes the same
layers in the same backward order, so the re-run exchanges match up, and ``Cell.recompute`` in
PyNative re-runs them like any other op (tests/parallel/test_context_parallel_training.py counts the
attention forwards).

``uniform`` with ``recompute_num_layers`` N > 1 recomputes every layer on its own (each layer's
input is kept, not only every N-th), which keeps module names unchanged at the cost of N - 1
more stored hidden states per group.
"""
from __future__ import annotations

from typing import Iterable, List

from ms_llm.models.layers import TransformerLayer

GRANULARITIES = (None, "full", "selective")
METHODS = (None, "uniform", "block")


def recompute_module(module) -> None:
    """Make ``module`` recompute its forward in backward (``Cell.recompute``: its parameters
    keep their gradients and names)."""
    module.recompute()


def _layers(root) -> List[TransformerLayer]:
    return [c for _, c in root.cells_and_names() if isinstance(c, TransformerLayer)]


def _full_recompute_parts(layer: TransformerLayer) -> list:
    """What full recompute marks in ``layer``: the layer, or, when its MoE router adds an
    auxiliary loss, every part but the router. Why: PyNative's recompute runs the first forward
    without gradient, and the router's aux loss is a side result the trainer adds to the loss,
    not an output of the layer, so a recomputed router would leave that loss without a graph
    (its gradient to the router lost). The router runs once; the attention, norms and experts
    are recomputed. Cost: each part keeps its own input (the experts: their permuted tokens)
    instead of only the layer's input."""
    router = getattr(layer.mlp, "router", None)
    c = getattr(router, "config", None)
    if c is None or not (c.moe_aux_loss_coeff or c.moe_z_loss_coeff):
        return [layer]
    parts = [layer.input_layernorm, layer.self_attention, layer.pre_mlp_layernorm,
             layer.mlp.experts, getattr(layer.mlp, "shared_experts", None)]
    return [p for p in parts if p is not None]


def apply_recompute(roots: Iterable, granularity=None, method=None, num_layers=None,
                    norm: bool = False, mark=recompute_module) -> List[str]:
    """Mark the recomputed modules of every root (a model, or each pipeline chunk: ``block``
    counts layers per chunk, as Megatron counts them per stage). Returns their names.
    ``mark``: how a module is made to recompute (under FSDP: ``fsdp.recompute``'s marker)."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"training.recompute_granularity must be full, selective or null, "
                         f"got {granularity!r}")
    if method not in METHODS:
        raise ValueError(f"training.recompute_method must be uniform, block or null, "
                         f"got {method!r}")
    if granularity == "full" and method == "block" and not num_layers:
        raise ValueError("training.recompute_method block needs training.recompute_num_layers")
    names = []
    for root in roots:
        layers = _layers(root)
        full = []
        if granularity == "full":
            full = layers[:num_layers] if method == "block" else layers
        marked = [part for layer in full for part in _full_recompute_parts(layer)]
        if granularity == "selective":      # the attention core: scores, softmax, weighted sum
            chosen = layers[:num_layers] if method == "block" else layers
            marked += [layer.self_attention.core_attention for layer in chosen]
        if norm:
            marked += [cell for layer in layers if layer not in full
                       for cell in (layer.input_layernorm, layer.pre_mlp_layernorm)]
        for cell in marked:
            mark(cell)
        ids = {id(c) for c in marked}
        names += [n for n, c in root.cells_and_names() if id(c) in ids]
    return names


