"""Export a distributed checkpoint (``dcp``) to a Hugging Face folder or a Megatron legacy folder.

Why here and not in the converter: a dcp checkpoint stores GPTModel (Megatron-Core local-spec)
keys in pieces; this module assembles one layer at a time through ``DCPReader`` and hands the
full tensors to the converter's own sinks (``convert.HFSink`` / ``convert.MegatronSink``), so the
QKV / gate-up / vocab-padding / expert rules live in one place (``ms_llm.models.layouts``).
Optimizer tensors and the training state are not exported. Output is written to
``<out>.tmp-<pid>`` and renamed at the end.

What the training checkpoint stores differently from the converter's full layer form (and is
undone in ``_Source.layer``):

* a gated ``linear_fc1`` as ``<name>:gate`` / ``<name>:up`` (``training/checkpointing.py``), a
  Gated DeltaNet ``conv1d.weight`` as ``:q`` / ``:k`` / ``:v`` (placement layout ``row_parts``);
* grouped experts (``moe_grouped_gemm``): ``mlp.experts.weight1`` as rows of 2F, global shape
  ``[E*H, 2F]`` (memory view ``[E, H, 2F]`` = expert e's ``linear_fc1.T``), ``weight2``
  ``[E*F, H]`` (view ``[E, F, H]`` = ``linear_fc2.T``); per-expert weights are already under
  their global expert index;
* the router's ``mlp.router.expert_bias`` buffer (aux-loss-free balancing). Qwen3-MoE routes
  with softmax and has no bias, so an all-zero bias is dropped (top-k of ``s + 0`` is top-k of
  ``s``: nothing is lost) and a non-zero one is refused (it changes which experts are chosen).
"""
from __future__ import annotations

import os
import shutil
from collections import OrderedDict
from typing import Dict, Optional, Tuple

import numpy as np

from ms_llm.models import layouts as L

from ..convert import DTYPES, HFSink, MegatronSink, stream_to_sink
from .format import DCPError
from .load import DCPReader

__all__ = ["export_hf", "export_megatron", "hf_config_from_transformer_config"]

_MODEL_ROOTS = ("embedding.", "decoder.", "output_layer.", "mtp.")
_EXPERTS = "mlp.experts.local_experts."
# the named dim-0 parts a stored tensor may be cut into, in their order in the full tensor
PART_ORDERS = (("gate", "up"), ("q", "k", "v"))


def hf_config_from_transformer_config(config, model_type_hf: Optional[str] = None
                                      ) -> Tuple[dict, str]:
    """HF ``config.json`` for a ``TransformerConfig`` and its ``--model-type-hf`` name: the
    family is the registry's guess (``family_for_config``: each family's ``claims`` in
    ``claim_order``), unless ``model_type_hf`` names one; the family's ``to_hf`` says what HF
    cannot express."""
    try:
        fam, mt = L.export_family(config, model_type_hf)
        return fam.to_hf(config), mt
    except ValueError as e:
        raise DCPError(str(e)) from None


def _layer_shapes(spec: L.ModelSpec, i: int) -> Dict[str, tuple]:
    """Full-layer keys (converter form, relative to ``decoder.layers.{i}.``) and shapes."""
    H, d = spec.hidden, spec.head_dim
    if spec.kind(i) != "attention" or spec.expert_bias:   # the shapes the layouts make
        shapes = dict(L.hf_layer_names(spec, i))
        full = L.hf_layer_to_full(spec, lambda n: np.empty(shapes[n], np.uint8), i)
        return {k: tuple(v.shape) for k, v in full.items()}
    out = {"input_layernorm.weight": (H,),
           "self_attention.linear_qkv.weight": ((spec.heads + 2 * spec.groups) * d, H),
           "self_attention.linear_proj.weight": (H, spec.heads * d),
           "pre_mlp_layernorm.weight": (H,)}
    if spec.qkv_bias:
        out["self_attention.linear_qkv.bias"] = ((spec.heads + 2 * spec.groups) * d,)
    if spec.qk_norm:
        out["self_attention.q_layernorm.weight"] = (d,)
        out["self_attention.k_layernorm.weight"] = (d,)
    if spec.is_moe(i):
        F = spec.moe_ffn
        out["mlp.router.weight"] = (spec.num_experts, H)
        for e in range(spec.num_experts):
            out[f"{_EXPERTS}{e}.linear_fc1.weight"] = (2 * F, H)
            out[f"{_EXPERTS}{e}.linear_fc2.weight"] = (H, F)
    else:
        out["mlp.linear_fc1.weight"] = (2 * spec.ffn, H)
        out["mlp.linear_fc2.weight"] = (H, spec.ffn)
    return out


class _Source:
    """Full Megatron-Core tensors of a dcp checkpoint, one layer at a time."""

    def __init__(self, reader: DCPReader, spec: L.ModelSpec, prefix: str):
        self.r, self.spec, self.prefix = reader, spec, prefix
        self.used = set()
        self.layers: Dict[int, list] = {}
        for n in reader.names():
            rest = n[len(prefix):] if n.startswith(prefix) else None
            if rest and rest.startswith("decoder.layers."):
                self.layers.setdefault(int(rest.split(".")[2]), []).append(n)
        if sorted(self.layers) != list(range(spec.num_layers)):
            raise DCPError(f"{reader.path}: checkpoint holds layers {sorted(self.layers)}, the "
                           f"config has {spec.num_layers}")

    def _get(self, key: str) -> np.ndarray:
        name = self.prefix + key
        self.used.add(name)
        return self.r.read(name)

    def _vocab(self, key: str) -> np.ndarray:
        w = self._get(key)
        if w.shape[0] < self.spec.vocab:
            raise DCPError(f"{self.r.path}: {self.prefix + key} has {w.shape[0]} rows, "
                           f"config.json vocab_size is {self.spec.vocab}")
        return w[: self.spec.vocab]

    def embedding(self) -> np.ndarray:
        return self._vocab("embedding.word_embeddings.weight")

    def has_grouped_experts(self) -> bool:
        return any(n.endswith(".mlp.experts.weight1") for ns in self.layers.values() for n in ns)

    def mtp_layer(self, j: int) -> Dict[str, np.ndarray]:
        """MTP depth ``j`` (``mtp.layers.{j}.``) in the converter's full form."""
        pre = f"mtp.layers.{j}."
        inner = pre + "transformer_layer."
        names = [n for n in self.r.names() if n.startswith(self.prefix + inner)]
        full = OrderedDict((k, self._get(pre + k))
                           for k in ("enorm.weight", "hnorm.weight", "eh_proj.weight"))
        for k, v in self.layer(self.spec.num_layers + j, inner, names).items():
            full["transformer_layer." + k] = v
        full["final_layernorm.weight"] = self._get(pre + "final_layernorm.weight")
        return full

    def layer(self, i: int, pre: Optional[str] = None,
              names: Optional[list] = None) -> Dict[str, np.ndarray]:
        """Decoder layer ``i`` (or, given ``pre`` and its tensor ``names``, the layer an MTP
        depth holds)."""
        pre = pre or f"decoder.layers.{i}."
        where = f"{self.r.path}: {self.prefix}{pre}"
        raw = {n[len(self.prefix) + len(pre):]: self._get(n[len(self.prefix):])
               for n in (self.layers[i] if names is None else names)}
        full = OrderedDict()
        parts: Dict[str, Dict[str, np.ndarray]] = {}
        for key in sorted(raw):
            base, colon, part = key.partition(":")
            if colon:
                parts.setdefault(base, {})[part] = raw[key]
            else:
                full[key] = raw[key]
        for base, got in parts.items():
            order = next((o for o in PART_ORDERS if set(o) == set(got)), None)
            if order is None:
                want = " or ".join("/".join(":" + p for p in o) for o in PART_ORDERS)
                raise DCPError(f"{where}{base}: parts {sorted(':' + p for p in got)} are not "
                               f"one of {want}")
            full[base] = np.concatenate([got[p] for p in order], axis=0)
        self._ungroup(full, where)
        bias = None if self.spec.expert_bias else full.pop("mlp.router.expert_bias", None)
        if bias is not None and np.any(np.asarray(bias, dtype=np.float32) != 0):
            raise DCPError(f"{where}mlp.router.expert_bias is non-zero (max |b| "
                           f"{float(np.abs(np.asarray(bias, np.float32)).max()):.3g}): HF "
                           f"Qwen3-MoE / the exported qwen3_moe layout have no router bias")
        want = _layer_shapes(self.spec, i)
        missing = [k for k in want if k not in full]
        extra = [k for k in full if k not in want]
        if missing or extra:
            what = (f"lacks {missing[:3]}" if missing else "") + \
                   (" and " if missing and extra else "") + \
                   (f"has {extra[:3]} with no place in the exported layout" if extra else "")
            raise DCPError(f"{where}*: layer {what} (config does not match the checkpoint?)")
        for k, shape in want.items():
            if tuple(full[k].shape) != shape:
                raise DCPError(f"{where}{k}: shape {list(full[k].shape)}, the config implies "
                               f"{list(shape)}")
        return OrderedDict((k, full[k]) for k in want)

    def _ungroup(self, full: Dict[str, np.ndarray], where: str) -> None:
        """Grouped-GEMM experts -> per-expert ``local_experts.{e}`` (global ids) in place."""
        if "mlp.experts.weight1" not in full and "mlp.experts.weight2" not in full:
            return
        s = self.spec
        E, H, F = s.num_experts, s.hidden, s.moe_ffn
        if not E:
            raise DCPError(f"{where}mlp.experts.weight1: grouped experts in a model the config "
                           f"says is dense")
        for key, shape in (("mlp.experts.weight1", (E * H, 2 * F)),
                           ("mlp.experts.weight2", (E * F, H))):
            if key not in full:
                raise DCPError(f"{where}{key}: missing (the other grouped expert weight is "
                               f"present)")
            if tuple(full[key].shape) != shape:
                raise DCPError(f"{where}{key}: shape {list(full[key].shape)}, the config "
                               f"implies {list(shape)} ({E} experts, hidden {H}, expert ffn {F})")
        w1 = full.pop("mlp.experts.weight1").reshape(E, H, 2 * F)
        w2 = full.pop("mlp.experts.weight2").reshape(E, F, H)
        for e in range(E):
            full[f"{_EXPERTS}{e}.linear_fc1.weight"] = np.ascontiguousarray(w1[e].T)
            full[f"{_EXPERTS}{e}.linear_fc2.weight"] = np.ascontiguousarray(w2[e].T)

    def final_norm(self) -> np.ndarray:
        return self._get("decoder.final_layernorm.weight")

    def output(self) -> Optional[np.ndarray]:
        return None if self.spec.tied else self._vocab("output_layer.weight")

    def check_all_used(self) -> None:
        left = sorted(n for n in self.r.names() if n.startswith(self.prefix)
                      and n[len(self.prefix):].startswith(_MODEL_ROOTS) and n not in self.used)
        if left:
            raise DCPError(f"{self.r.path}: model tensors {left[:3]} have no place in the "
                           f"exported layout (config does not match the checkpoint?)")


def _prepare(path: str, out_dir: str, hf_config, config, model_type_hf):
    reader = DCPReader(path)
    try:
        if hf_config is None:
            if config is None:
                st = reader.state
                if isinstance(st.get("hf_config"), dict):
                    hf_config = st["hf_config"]
                elif isinstance(st.get("model_config"), dict):
                    from ms_llm.models.config import TransformerConfig
                    config = TransformerConfig(**st["model_config"])
                else:
                    raise DCPError(f"{path}: pass hf_config or config (the checkpoint state "
                                   f"has neither 'hf_config' nor 'model_config')")
            if config is not None:
                hf_config, model_type_hf = hf_config_from_transformer_config(config,
                                                                             model_type_hf)
        if model_type_hf is None:
            mt = L.default_megatron_name(hf_config.get("model_type"))
            if mt is None:
                raise DCPError(f"export: cannot infer model_type_hf from model_type "
                               f"{hf_config.get('model_type')!r}; pass it")
            model_type_hf = mt
        try:
            spec = L.spec_from_hf_config(hf_config, model_type_hf, source="export hf_config")
        except ValueError as e:
            raise DCPError(str(e)) from None
        out = os.path.abspath(out_dir)
        if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
            raise DCPError(f"export: {out_dir} exists and is not empty")
        return reader, spec, hf_config, model_type_hf, out
    except BaseException:
        reader.close()
        raise


def _run(reader: DCPReader, src: "_Source", sink, tmp: str, out: str) -> str:
    try:
        return stream_to_sink(src, sink, tmp, out, check=src.check_all_used)
    finally:
        reader.close()


def _out_dtype(reader: DCPReader, prefix: str, dtype: Optional[str]) -> np.dtype:
    if dtype is None:
        return reader.dtype(prefix + "embedding.word_embeddings.weight")
    if dtype not in DTYPES:
        raise DCPError(f"export: dtype {dtype!r} is not one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def export_hf(path: str, out_dir: str, *, hf_config: Optional[dict] = None, config=None,
              model_type_hf: Optional[str] = None, dtype: Optional[str] = None,
              max_shard_size: str = "5GB", prefix: str = "") -> str:
    """Write the model weights of dcp checkpoint ``path`` as a HF folder (safetensors +
    ``config.json``). The architecture comes from ``hf_config``, else ``config`` (a
    TransformerConfig), else the checkpoint state's ``hf_config`` / ``model_config``.
    MoE checkpoints (either expert layout) export as Qwen3-MoE."""
    reader, spec, hf_cfg, _, out = _prepare(path, out_dir, hf_config, config, model_type_hf)
    tmp = f"{out.rstrip(os.sep)}.tmp-{os.getpid()}"
    sink = None
    try:
        src = _Source(reader, spec, prefix)
        os.makedirs(tmp)
        sink = HFSink(tmp, spec, hf_cfg, _out_dtype(reader, prefix, dtype), max_shard_size)
    except BaseException:
        reader.close()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _run(reader, src, sink, tmp, out)


def export_megatron(path: str, out_dir: str, *, hf_config: Optional[dict] = None, config=None,
                    model_type_hf: Optional[str] = None, tp: int = 1, pp: int = 1, ep: int = 1,
                    moe_grouped_gemm: Optional[bool] = None, dtype: Optional[str] = None,
                    make_vocab_size_divisible_by: Optional[int] = None,
                    prefix: str = "") -> str:
    """Write the model weights as a Megatron legacy torch folder (``iter_0000001/mp_rank_*``,
    what ``ms-llm convert`` writes) at tensor-parallel ``tp``, pipeline ``pp`` and expert
    parallel ``ep``. ``moe_grouped_gemm`` picks the expert layout (``weight1``/``weight2`` vs
    ``local_experts``); by default the checkpoint's own."""
    reader, spec, hf_cfg, mt, out = _prepare(path, out_dir, hf_config, config, model_type_hf)
    tmp = f"{out.rstrip(os.sep)}.tmp-{os.getpid()}"
    sink = None
    try:
        src = _Source(reader, spec, prefix)
        grouped = src.has_grouped_experts() if moe_grouped_gemm is None else moe_grouped_gemm
        if grouped and not spec.num_experts:
            raise DCPError("export_megatron: moe_grouped_gemm needs a MoE model")
        lay = L.ParallelLayout(tp=tp, pp=pp, ep=ep, grouped_gemm=bool(grouped),
                               padded_vocab=L.padded_vocab_size(
                                   spec.vocab, make_vocab_size_divisible_by, tp))
        try:
            lay.validate(spec, where="export_megatron")
        except ValueError as e:
            raise DCPError(str(e)) from None
        out_dtype = _out_dtype(reader, prefix, dtype)
        cast = out_dtype if dtype else None
        os.makedirs(tmp)
        sink = MegatronSink(tmp, spec, lay, hf_cfg, out_dtype, cast, mt)
    except BaseException:
        reader.close()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _run(reader, src, sink, tmp, out)
