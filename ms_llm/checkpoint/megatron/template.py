"""A Megatron folder with no ``args`` (a bare training checkpoint) described by ``--hf-cfg-dir``.

MindSpeed-trained folders often carry no ``config.json`` and, saved without ``args``, nothing to
rebuild one from; the original HF folder's ``config.json`` then describes the architecture.
Nothing in the checkpoint confirms it except the tensors, so before converting, the shapes that
pin the architecture are checked against it (hidden size, attention rows, FFN width, layer count
across stages, vocabulary rows): a template of another model stops with one line.
"""
from __future__ import annotations

from typing import Callable, List, Tuple

from ms_llm.models.layouts import ModelSpec, ParallelLayout


def expected_shapes(spec: ModelSpec, lay: ParallelLayout) -> List[Tuple[str, tuple]]:
    """``(key in the first stage's first chunk, shape per tensor-parallel rank)`` to check."""
    tp, h = lay.tp, spec.hidden
    out = [("embedding.word_embeddings.weight", (lay.padded_vocab // tp, h)),
           ("decoder.layers.0.input_layernorm.weight", (h,))]
    if not spec.mla:
        qkv = (spec.heads + 2 * spec.groups) * spec.head_dim // tp
        out += [("decoder.layers.0.self_attention.linear_qkv.weight", (qkv, h)),
                ("decoder.layers.0.self_attention.linear_proj.weight",
                 (h, spec.heads * spec.head_dim // tp))]
    if not spec.is_moe(0):
        out += [("decoder.layers.0.mlp.linear_fc1.weight", (2 * spec.ffn // tp, h)),
                ("decoder.layers.0.mlp.linear_fc2.weight", (h, spec.ffn // tp))]
    return out


def check_template(spec: ModelSpec, lay: ParallelLayout, shape_of: Callable[[str], tuple],
                   layers_in_files: int, template: str, path: str) -> None:
    """Raise ``ValueError`` naming the first disagreement between the template and the files.
    ``shape_of(key)``: the shape stored at tp rank 0, stage 0, chunk 0 (KeyError if absent)."""
    want_layers = spec.num_layers + len(lay.noop_layers)
    if layers_in_files != want_layers:
        raise ValueError(f"--hf-cfg-dir {template}: num_hidden_layers is {spec.num_layers} but "
                         f"the Megatron checkpoint {path} holds {layers_in_files} layers")
    for key, want in expected_shapes(spec, lay):
        try:
            got = tuple(shape_of(key))
        except KeyError:
            raise ValueError(f"--hf-cfg-dir {template}: the Megatron checkpoint {path} has no "
                             f"{key} (another architecture?)") from None
        if got != want:
            raise ValueError(f"--hf-cfg-dir {template}: {key} would be {want} per tensor-"
                             f"parallel rank, the Megatron checkpoint {path} has {got}")
