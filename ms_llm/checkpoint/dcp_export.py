"""Export a distributed checkpoint (``dcp``) to a Hugging Face folder or a Megatron legacy folder.

Why here and not in the converter: a dcp checkpoint stores GPTModel (Megatron-Core local-spec)
keys in pieces; this module assembles one layer at a time through ``DCPReader`` and hands the
full tensors to the converter's own sinks (``convert.HFSink`` / ``convert.MegatronSink``), so the
QKV / gate-up / vocab-padding rules live in one place (``layouts``). Optimizer tensors and the
training state are not exported. Output is written to ``<out>.tmp-<pid>`` and renamed at the end.
"""
from __future__ import annotations

import argparse
import os
import shutil
from typing import Dict, Optional, Tuple

import numpy as np

from . import layouts as L
from .convert import DTYPES, HFSink, MegatronSink, stream_to_sink
from .dcp import DCPError, DCPReader
from .megatron import hf_config_from_args

__all__ = ["export_hf", "export_megatron", "hf_config_from_transformer_config"]

_MODEL_ROOTS = ("embedding.", "decoder.", "output_layer.")


def hf_config_from_transformer_config(config, model_type_hf: Optional[str] = None
                                      ) -> Tuple[dict, str]:
    """HF ``config.json`` for a ``TransformerConfig`` (family guessed from its switches:
    QK-norm -> qwen3, QKV bias -> qwen25, else llama2, unless ``model_type_hf`` says)."""
    c = config
    if c.mlp_type != "dense":
        raise DCPError("export: MoE checkpoints cannot be exported yet (only dense models); "
                       "the training checkpoint itself resumes under any ep/fsdp layout")
    mt = model_type_hf or ("qwen3" if c.qk_layernorm else "qwen25" if c.add_qkv_bias
                           else "llama2")
    if not c.swiglu or c.add_bias_linear:
        raise DCPError("export: only SwiGLU models without linear biases map to HF Llama/Qwen")
    family = L.MODEL_TYPES.get(mt, (None,))[0]
    if family == "qwen25" and c.kv_channels * c.num_attention_heads != c.hidden_size:
        raise DCPError(f"export: Qwen2 config.json has no head_dim; kv_channels {c.kv_channels} "
                       f"must equal hidden_size / heads")
    args = argparse.Namespace(
        num_layers=c.num_layers, hidden_size=c.hidden_size, ffn_hidden_size=c.ffn_hidden_size,
        num_attention_heads=c.num_attention_heads,
        group_query_attention=c.num_query_groups != c.num_attention_heads,
        num_query_groups=c.num_query_groups, kv_channels=c.kv_channels,
        vocab_size=c.padded_vocab_size, padded_vocab_size=c.padded_vocab_size,
        max_position_embeddings=c.max_position_embeddings, norm_epsilon=c.layernorm_epsilon,
        rotary_base=c.rotary_base,
        untie_embeddings_and_output_weights=c.untie_embeddings_and_output_weights,
        params_dtype=None, bf16=c.params_dtype == "bfloat16", fp16=c.params_dtype == "float16")
    return hf_config_from_args(args, mt), mt


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

    def layer(self, i: int) -> Dict[str, np.ndarray]:
        pre = f"{self.prefix}decoder.layers.{i}."
        return {n[len(pre):]: self._get(n[len(self.prefix):]) for n in self.layers[i]}

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
            mt = L.HF_MODEL_TYPE_DEFAULTS.get(hf_config.get("model_type"))
            if mt is None:
                raise DCPError(f"export: cannot infer model_type_hf from model_type "
                               f"{hf_config.get('model_type')!r}; pass it")
            model_type_hf = mt
        spec = L.spec_from_hf_config(hf_config, model_type_hf)
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
    TransformerConfig), else the checkpoint state's ``hf_config`` / ``model_config``."""
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
                    model_type_hf: Optional[str] = None, tp: int = 1, pp: int = 1,
                    dtype: Optional[str] = None,
                    make_vocab_size_divisible_by: Optional[int] = None,
                    prefix: str = "") -> str:
    """Write the model weights as a Megatron legacy torch folder (``iter_0000001/mp_rank_*``,
    the conversion issue's layout) at tensor-parallel ``tp`` and pipeline ``pp``."""
    reader, spec, hf_cfg, mt, out = _prepare(path, out_dir, hf_config, config, model_type_hf)
    tmp = f"{out.rstrip(os.sep)}.tmp-{os.getpid()}"
    sink = None
    try:
        src = _Source(reader, spec, prefix)
        lay = L.ParallelLayout(tp=tp, pp=pp, padded_vocab=L.padded_vocab_size(
            spec.vocab, make_vocab_size_divisible_by, tp))
        lay.validate(spec, where="export_megatron")
        cast = DTYPES[dtype] if dtype else None
        out_dtype = _out_dtype(reader, prefix, dtype)
        os.makedirs(tmp)
        sink = MegatronSink(tmp, spec, lay, hf_cfg, out_dtype, cast, mt)
    except BaseException:
        reader.close()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _run(reader, src, sink, tmp, out)
