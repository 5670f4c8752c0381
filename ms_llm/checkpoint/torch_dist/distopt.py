"""The distributed optimizer's state in a Megatron-Core ``torch_dist`` checkpoint
(``--use-distributed-optimizer``), read back onto ms-llm's per-parameter names.

Why several layouts: ``DistributedOptimizer.sharded_state_dict`` (megatron-core 0.16) writes
the one its ``metadata['distrib_optim_sharding_type']`` names, and Megatron-LM picks it from
its flags (``dp_reshardable`` by default, ``fully_reshardable`` under
``--dist-ckpt-optim-fully-reshardable``; older Megatron-LM / MindSpeed wrote
``fully_sharded_model_space`` or ``dp_zero_gather_scatter``). The sharding type is recorded in
``common.pt`` as ``optimizer.param_state_sharding_type``.

  ``fully_reshardable``   per parameter, model shapes: ``optimizer.state.{param,exp_avg,
                          exp_avg_sq}.<model key>`` (``param`` is the fp32 main copy)
  ``dp_reshardable``      the grad buffer's flat buckets,
                          ``optimizer.distributed.dp_group_idx_G.gbuf_idx_B.dtype_(..).bucket_idx_K.
                          {param,exp_avg,exp_avg_sq}`` of the bucket's unpadded length; the
                          parameters lie in it in reverse ``named_parameters`` order, each start
                          padded to 64 elements (``_ParamAndGradBuffer``), so the layout is
                          rebuilt from the model's shapes and checked against every chunk edge
Written (``model.distributed_common``): ``fully_reshardable``, with the ``content_metadata``
Megatron-LM reads back to choose the layout it loads with; the flat-bucket layouts depend on
the loading run's bucket sizes and dp size, so they are not written.
Refused with one line naming the type: ``dp_zero_gather_scatter`` (a pickled object per
rank), ``fully_sharded_model_space`` (flattened ranges megatron-core 0.16 no longer writes),
several grad buffers or data-parallel groups (MoE / expert parameters).
"""
from __future__ import annotations

import re
import tempfile
from typing import Dict, List, Optional, Tuple

import numpy as np

from .io import TorchDistReader
from .model import MOMENTS, read_state
from ..torch_pickle.reader import load as load_torch_file

STATES = ("param", *MOMENTS)
_BUCKET = re.compile(r"^optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(.+)"
                     r"\.bucket_idx_(\d+)\.([a-z_]+)$")
# Per-layer parameter order of megatron-core's GPT layer (``named_parameters``): the local spec
# keeps the input norm as the layer's first module; the TransformerEngine spec fuses it into
# ``linear_qkv`` (created after ``linear_proj``) and the pre-MLP norm into ``linear_fc1``.
_LOCAL = ("input_layernorm.weight", "self_attention.linear_proj.weight",
          "self_attention.linear_proj.bias", "self_attention.linear_qkv.weight",
          "self_attention.linear_qkv.bias", "self_attention.q_layernorm.weight",
          "self_attention.k_layernorm.weight", "pre_mlp_layernorm.weight",
          "mlp.linear_fc1.weight", "mlp.linear_fc1.bias", "mlp.linear_fc2.weight",
          "mlp.linear_fc2.bias")
_TE = ("self_attention.linear_proj.weight", "self_attention.linear_proj.bias",
       "input_layernorm.weight", *_LOCAL[3:7], "pre_mlp_layernorm.weight", *_LOCAL[8:])
_TOP = ("embedding.word_embeddings.weight", None, "decoder.final_layernorm.weight",
        "output_layer.weight")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def sharding_type(reader: TorchDistReader) -> Optional[str]:
    """The distributed optimizer's layout recorded in ``common.pt``, or None (none saved)."""
    opt = reader.common.get("optimizer")
    return opt.get("param_state_sharding_type") if isinstance(opt, dict) else None


def named_order(names, layer_order=_LOCAL) -> List[str]:
    """``names`` in megatron-core GPTModel's ``named_parameters`` order (dense models)."""
    def key(n: str):
        m = _LAYER.match(n)
        if m is not None and m.group(2) in layer_order:
            return (1, int(m.group(1)), layer_order.index(m.group(2)))
        if n in _TOP:
            return (_TOP.index(n), 0, 0)
        raise ValueError(f"{n}: no place in megatron-core's parameter order (dense GPT only)")
    return sorted(names, key=key)


def _step(reader: TorchDistReader, where: str) -> Optional[int]:
    """Adam's step: the param groups' ``step`` (the distributed optimizer keeps it there)."""
    opt = reader.common.get("optimizer") or {}
    inner = opt.get("optimizer")
    if inner is None:   # dp_reshardable: the param groups are a ShardedObject
        key = next((k for k in reader.objects
                    if re.match(r"^optimizer\.distributed\.dp_group_idx_\d+\.optimizer/", k)),
                   None)
        if key is None:
            return None
        with tempfile.NamedTemporaryFile(suffix=".pt") as tmp:
            tmp.write(reader.object_bytes(key))
            tmp.flush()
            inner = load_torch_file(tmp.name)
        if isinstance(inner, list) and len(inner) == 1:   # saved as the list of local objects
            inner = inner[0]
    steps = {int(g["step"]) for g in inner.get("param_groups", []) if "step" in g}
    if len(steps) > 1:
        raise ValueError(f"{where}: param groups at different steps {sorted(steps)}")
    return steps.pop() if steps else None


def read_distributed(reader: TorchDistReader, model: Dict[str, np.ndarray]
                     ) -> Tuple[Dict[str, np.ndarray], Dict[str, np.ndarray]]:
    """``(fp32 params, {"exp_avg.<name>": ..., "exp_avg_sq.<name>": ..., "step": n})`` of a
    distributed-optimizer torch_dist save; ``model`` (per-layer names) gives the shapes."""
    kind, where = sharding_type(reader), reader.path
    if kind == "fully_reshardable":
        got = read_state(reader, tuple(f"optimizer.state.{s}." for s in STATES))
        params = {k[len("optimizer.state.param."):]: v for k, v in got.items()
                  if k.startswith("optimizer.state.param.")}
        optim = {k[len("optimizer.state."):]: v for k, v in got.items()
                 if not k.startswith("optimizer.state.param.")}
    elif kind == "dp_reshardable":
        params, optim = _read_buckets(reader, model)
    else:
        raise ValueError(f"{where}: the distributed optimizer's {kind!r} layout is not built "
                         f"(read: fully_reshardable, dp_reshardable)")
    step = _step(reader, where)
    if step is None:
        raise ValueError(f"{where}: no Adam step in the distributed optimizer's param groups")
    optim["step"] = np.array(step, np.int64)
    for name, w in model.items():
        for m in ("param", *MOMENTS):
            have = params.get(name) if m == "param" else optim.get(f"{m}.{name}")
            if have is None or have.shape != w.shape:
                raise ValueError(f"{where}: distributed optimizer {m} of {name}: "
                                 f"{None if have is None else have.shape}, model {w.shape}")
    return params, optim


def _read_buckets(reader: TorchDistReader, model: Dict[str, np.ndarray]):
    buckets: Dict[Tuple[int, int, str, int], Dict[str, str]] = {}
    for key in reader.tensors:
        m = _BUCKET.match(key)
        if m is not None:
            g, b, dtype, k, state = m.groups()
            buckets.setdefault((int(g), int(b), dtype, int(k)), {})[state] = key
    groups = sorted({(g, b, d) for g, b, d, _ in buckets})
    if len(groups) != 1:
        raise ValueError(f"{reader.path}: distributed optimizer buckets of {len(groups)} grad "
                         f"buffers / dp groups {groups}: only one (dense models) is built")
    ordered = [buckets[k] for k in sorted(buckets, key=lambda t: t[3])]
    if sorted(buckets) != [(*groups[0], i) for i in range(len(ordered))]:
        raise ValueError(f"{reader.path}: distributed optimizer bucket indices "
                         f"{[k[3] for k in sorted(buckets)]} are not 0..{len(ordered) - 1}")
    sizes = [reader.tensors[b["param"]].shape[0] for b in ordered]
    edges = [{e for c in reader.tensors[b["param"]].chunks for e in
              (c.offsets[0], c.offsets[0] + c.sizes[0])} for b in ordered]
    layout = None
    for layer_order in (_LOCAL, _TE):
        layout = _layout(named_order(model, layer_order)[::-1], model, sizes, edges)
        if layout is not None:
            break
    if layout is None:
        raise ValueError(f"{reader.path}: the distributed optimizer's buckets (sizes {sizes}) "
                         f"match no megatron-core parameter order of this model")
    params: Dict[str, np.ndarray] = {}
    optim: Dict[str, np.ndarray] = {}
    for state in STATES:
        flat = [reader.tensor(b[state]) for b in ordered]
        for name, (k, start) in layout.items():
            w = model[name]
            v = np.asarray(flat[k][start:start + w.size], np.float32).reshape(w.shape)
            if state == "param":
                params[name] = v
            else:
                optim[f"{state}.{name}"] = v
    return params, optim


def _layout(names: List[str], model, sizes: List[int], edges) -> Optional[Dict[str, tuple]]:
    """``{name: (bucket, start)}`` of ``names`` laid out as ``_ParamAndGradBuffer`` lays them
    (each start padded to 64; a bucket's unpadded size ends at a parameter's end), or None when
    a parameter would straddle a bucket or miss a stored chunk edge (the order is not this)."""
    out, k, pos = {}, 0, 0
    for name in names:
        n = int(model[name].size)
        pos = -(-pos // 64) * 64
        if k >= len(sizes) or pos + n > sizes[k] or pos not in edges[k] or \
                pos + n not in edges[k]:
            return None
        out[name] = (k, pos)
        pos += n
        if pos == sizes[k]:
            k, pos = k + 1, 0
    return out if k == len(sizes) and pos == 0 else None

