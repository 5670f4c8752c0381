"""``ms-llm convert``: HF <-> Megatron (legacy torch format) and Megatron re-sharding, torch-free.

Flags follow MindSpeed-LLM's ``convert_ckpt_v2.py`` so commands carry over::

    ms-llm convert --load-model-type hf --save-model-type mg --model-type-hf qwen3 \\
        --load-dir IN --save-dir OUT --target-tensor-parallel-size 2 \\
        --target-pipeline-parallel-size 1 --target-expert-parallel-size 1 [--moe-grouped-gemm] \\
        [--num-layers-per-virtual-pipeline-stage N] [--num-layer-list a,b] [--noop-layers i,j] \\
        [--params-dtype bf16] [--make-vocab-size-divisible-by N] [--max-shard-size 5GB]

Conversion streams one decoder layer at a time (source tensors are read lazily, every output
file is written as it goes), so ``--save-layer-by-layer`` is the only mode and the flag is
accepted for compatibility. The output goes to ``<save-dir>.tmp-<pid>`` and is renamed to
``--save-dir`` at the end: a failed run leaves no folder that looks complete.

mg -> hf needs the HF ``config.json``: hf -> mg stores it beside the Megatron checkpoint, and
without it the config is rebuilt from the checkpoint's ``args`` (``megatron.hf_config_from_args``).
``--hf-cfg-dir ORIGINAL_HF`` (MindSpeed's) takes it from the original HF folder instead, checked
against the checkpoint, and copies that folder's tokenizer and generation files beside the
weights. ``--lora-load DIR`` merges LoRA adapters (an ms-llm LoRA checkpoint or a PEFT folder)
into the weights as they stream (``W + alpha/r B A``; also hf -> hf). MindSpeed flags with no
counterpart here (MLA, dualpipev, Mamba, TE names...) parse and are refused with one line;
unknown flags are refused naming them.
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
from typing import Dict, List, Optional

import ml_dtypes
import numpy as np

from ms_llm.models import layouts as L
from ms_llm.models.layouts import mtp as MTP

from .args import (DTYPES, ConvertError, _check_num_layers,  # noqa: F401 (re-exported)
                           _int_list, _refuse_unsupported, build_parser)
from .stream import stream_to_sink  # noqa: F401 (re-exported: native.export, adapters)
from ..hf.io import HFReader, HFWriter, copy_hf_side_files, read_hf_config
from ..megatron.io import (MegatronReader, MegatronWriter, check_hf_template, hf_config_from_args,
                           make_args, write_hf_config)
from ..torch_pickle import ForbiddenGlobalError, TorchFormatError

log = logging.getLogger("ms_llm.checkpoint")

# --------------------------------------------------------------------------------------------
# Sources: full (tp = ep = 1) tensors, one layer at a time
# --------------------------------------------------------------------------------------------

class HFSource:
    def __init__(self, path: str, model_type_hf: Optional[str]):
        self.reader = HFReader(path)
        self.config = self.reader.config
        self.model_type = model_type_hf or _infer_type(self.config, path)
        self.spec = L.spec_from_hf_config(self.config, self.model_type,
                                          os.path.join(path, "config.json"))
        self._used = set()
        names = set(self.reader.names())
        self.spec.mtp_layers = MTP.present_depths(
            self.spec, lambda j: MTP.hf_marker(self.spec, j) in names, path)
        expected = {n: s for n, s in L.hf_names(self.spec)}
        for name, shape in expected.items():
            if name not in self.reader:
                raise ConvertError(f"{path}: missing tensor {name!r} for --model-type-hf "
                                   f"{self.model_type}")
            if tuple(self.reader.shape(name)) != shape:
                raise ConvertError(f"{path}: tensor {name!r} has shape "
                                   f"{list(self.reader.shape(name))}, config.json implies "
                                   f"{list(shape)}")
        self.path = path
        extra = [n for n in self.reader.names() if n not in expected
                 and not n.endswith("rotary_emb.inv_freq")
                 and not (self.spec.tied and n == "lm_head.weight")]
        if extra:
            raise ConvertError(f"{path}: tensors {sorted(extra)[:3]} do not belong to a "
                               f"{self.model_type} model (wrong --model-type-hf?)")

    def dtype(self) -> np.dtype:
        return self.reader.dtype("model.embed_tokens.weight")

    def embedding(self) -> np.ndarray:
        return self.reader.get("model.embed_tokens.weight")

    def final_norm(self) -> np.ndarray:
        return self.reader.get("model.norm.weight")

    def output(self) -> Optional[np.ndarray]:
        return None if self.spec.tied else self.reader.get("lm_head.weight")

    def layer(self, i: int) -> Dict:
        return L.hf_layer_to_full(self.spec, self.reader.get, i)

    def mtp_layer(self, j: int) -> Dict:
        return MTP.mtp_hf_to_full(self.spec, self.reader.get, j, L.hf_layer_to_full, self.path)

    def close(self) -> None:
        pass


def _infer_type(cfg: dict, path: str) -> str:
    mt = cfg.get("model_type")
    name = L.default_megatron_name(mt)
    if name is None:
        raise ConvertError(f"{path}: cannot infer --model-type-hf from model_type {mt!r}; pass it")
    return name


class MegatronSource:
    """A Megatron folder read one full layer at a time. ``hf_cfg_dir`` (``--hf-cfg-dir``): an
    HF folder whose ``config.json`` describes the output instead of the checkpoint's own (kept
    whole: token ids, rope scaling and the other fields Megatron ``args`` cannot express, and
    the unpadded vocabulary), after checking it describes these weights."""

    def __init__(self, path: str, model_type_hf: Optional[str],
                 hf_cfg_dir: Optional[str] = None):
        self.reader = MegatronReader(path)
        try:
            cfg_path = os.path.join(path, "config.json")
            template = read_hf_config(hf_cfg_dir) if hf_cfg_dir else None
            self.config, self.model_type = self._own_config(path, model_type_hf, template,
                                                             hf_cfg_dir)
            self.spec = L.spec_from_hf_config(self.config, self.model_type, cfg_path)
            self.lay = self.reader.layout(self.spec)
            if template is not None and not isinstance(self.reader.args, argparse.Namespace):
                self._check_template_shapes(path, hf_cfg_dir)
            elif template is not None:
                spec = L.spec_from_hf_config(template, self.model_type,
                                             os.path.join(hf_cfg_dir, "config.json"))
                check_hf_template(self.spec, spec, self.lay.padded_vocab, hf_cfg_dir, path)
                self.spec, self.config = spec, template
            self._mg_of_hf = [m for p, c, ids in self.lay.chunks() for m in ids
                              if self.lay.hf_layer(m) is not None]
            self._where = {m: (p, c, j) for p, c, ids in self.lay.chunks()
                           for j, m in enumerate(ids)}
            self.spec.mtp_layers = MTP.present_depths(self.spec, self._has_mtp, path)
        except BaseException:
            self.reader.close()
            raise

    def _check_template_shapes(self, path: str, template_dir: str) -> None:
        """No ``args``: the tensors are all that confirms the template (megatron.template)."""
        from ..megatron.template import check_template
        r = self.reader
        layers = sum(1 + max((int(k.split(".")[2]) for k in sd if k.startswith("decoder.layers.")),
                             default=-1)
                     for p in range(r.pp) for sd in r.models[(0, p, 0)])
        try:
            check_template(self.spec, self.lay, lambda key: r.models[(0, 0, 0)][0][key].shape,
                           layers, os.path.join(template_dir, "config.json"), path)
        except ValueError as e:
            raise ConvertError(str(e)) from None

    def _own_config(self, path: str, model_type_hf: Optional[str], template: Optional[dict],
                    template_dir: Optional[str]):
        """The checkpoint's HF config (``config.json`` beside it, else rebuilt from ``args``)
        and its ``--model-type-hf``."""
        if os.path.isfile(os.path.join(path, "config.json")):
            config = read_hf_config(path)
            return config, model_type_hf or _infer_type(config, path)
        a = self.reader.args
        if not isinstance(a, argparse.Namespace) and template is not None:
            return dict(template), model_type_hf or _infer_type(template, template_dir)
        if not isinstance(a, argparse.Namespace):
            raise ConvertError(f"{path}: no config.json beside the checkpoint and no args "
                               f"in it to rebuild one from; pass --hf-cfg-dir ORIGINAL_HF")
        model_type = model_type_hf or getattr(a, "model_type_hf", None) or \
            (_infer_type(template, template_dir) if template is not None else None)
        if not model_type:
            raise ConvertError(f"{path}: pass --model-type-hf or --hf-cfg-dir (no config.json "
                               f"here)")
        return hf_config_from_args(a, model_type), model_type

    def dtype(self) -> np.dtype:
        return self.reader.dtype()

    def _vocab(self, key: str, p: int, c: int, padded: bool) -> np.ndarray:
        parts = [self.reader.tensor(t, p, 0, c, key) for t in range(self.lay.tp)]
        full = np.concatenate(parts, axis=0)
        return full if padded else full[: self.spec.vocab]

    def embedding(self, padded: bool = False) -> np.ndarray:
        return self._vocab("embedding.word_embeddings.weight", 0, 0, padded)

    def final_norm(self) -> np.ndarray:
        p, c = self.lay.last_chunk()
        return self.reader.tensor(0, p, 0, c, "decoder.final_layernorm.weight")

    def output(self, padded: bool = False) -> Optional[np.ndarray]:
        if self.spec.tied:
            return None
        p, c = self.lay.last_chunk()
        return self._vocab("output_layer.weight", p, c, padded)

    def layer(self, i: int) -> Dict:
        p, c, j = self._where[self._mg_of_hf[i]]
        pre = f"decoder.layers.{j}."
        return L.merge_layer(self.spec, self.lay,
                             lambda t, e, key: self.reader.tensor(t, p, e, c, pre + key), i)

    def _has_mtp(self, j: int) -> bool:
        p, c = self.lay.last_chunk()
        try:
            self.reader.tensor(0, p, 0, c, f"mtp.layers.{j}.enorm.weight")
        except KeyError:
            return False
        return True

    def mtp_layer(self, j: int) -> Dict:
        """MTP depth ``j`` from the last pipeline stage (``mtp.layers.{j}.``; the inner layer
        under ``transformer_layer.``, or ``mtp_model_layer.`` as newer Megatron-Core names it)."""
        p, c = self.lay.last_chunk()
        pre = f"mtp.layers.{j}."
        try:
            self.reader.tensor(0, p, 0, c, pre + "transformer_layer.input_layernorm.weight")
            inner = None
        except KeyError:
            inner = (pre + "transformer_layer.", pre + "mtp_model_layer.")

        def read(t: int, e: int, key: str) -> np.ndarray:
            name = pre + key
            if inner is not None and name.startswith(inner[0]):
                name = inner[1] + name[len(inner[0]):]
            return self.reader.tensor(t, p, e, c, name)
        return MTP.mtp_merge(self.spec, self.lay, read, j, L.merge_layer)

    def check(self) -> None:
        """After streaming: every stored tensor was read (a ``config.json`` listing fewer
        layers or no MTP depth than the checkpoint holds must not drop them silently). The last
        stage's copy of a tied embedding is Megatron's duplicate, not a weight of its own."""
        dup = {"embedding.word_embeddings.weight"} | ({"output_layer.weight"}
                                                      if self.spec.tied else set())
        left = [u for u in self.reader.unread() if u.rsplit(": ", 1)[1] not in dup]
        if left:
            raise ConvertError(f"{self.reader.path}: {len(left)} stored tensor(s) were not "
                               f"converted, e.g. {left[0]} (config.json num_hidden_layers "
                               f"{self.spec.num_layers}: does it describe this checkpoint?)")

    def close(self) -> None:
        self.reader.close()


# --------------------------------------------------------------------------------------------
# Sinks
# --------------------------------------------------------------------------------------------

def _cast(x: np.ndarray, dtype: Optional[np.dtype]) -> np.ndarray:
    """Round floating tensors to ``dtype`` once (via float32, which holds fp16/bf16 exactly)."""
    if dtype is None or x.dtype == dtype:
        return x
    if x.dtype not in (np.float32, np.float16, np.float64, ml_dtypes.bfloat16):
        return x
    return (x if x.dtype in (np.float32, np.float64) else x.astype(np.float32)).astype(dtype)


class MegatronSink:
    def __init__(self, path: str, spec: L.ModelSpec, lay: L.ParallelLayout, hf_cfg: dict,
                 dtype: np.dtype, cast: Optional[np.dtype], model_type_hf: str):
        self.spec, self.lay, self.cast = spec, lay, cast
        args = make_args(spec, lay, hf_cfg, dtype, model_type_hf)
        self.w = MegatronWriter(path, lay, args)
        write_hf_config(path, hf_cfg)
        self._where = {}
        for p, c, ids in lay.chunks():
            for j, m in enumerate(ids):
                h = lay.hf_layer(m)
                if h is not None:
                    self._where[h] = (p, c, j)
        self._emb = None

    def _all(self, p: int, c: int, key: str, shards: List[Optional[np.ndarray]]) -> None:
        for t in range(self.lay.tp):
            for e in range(self.lay.ep):
                self.w.add(t, p, e, c, key, None if shards is None else _cast(shards[t],
                                                                             self.cast))

    def embedding(self, w: np.ndarray) -> None:
        shards = L.vocab_shards(w, self.lay)
        self._all(0, 0, "embedding.word_embeddings.weight", shards)
        if self.lay.last_chunk() != (0, 0) and (self.spec.tied or self.spec.mtp_layers):
            # Megatron's last stage keeps its own copy: as output_layer.weight when tied, and
            # as embedding.word_embeddings.weight for the MTP block
            self._emb = shards

    def mtp_layer(self, j: int, full: Dict, output: Optional[np.ndarray]) -> None:
        p, c = self.lay.last_chunk()
        if j == 0 and self._emb is not None:
            self._all(p, c, "embedding.word_embeddings.weight", self._emb)
        for (t, e), sd in MTP.mtp_shard(self.spec, self.lay, full, j, L.shard_layer).items():
            for key, v in sd.items():
                self.w.add(t, p, e, c, f"mtp.layers.{j}.{key}",
                           None if v is None else _cast(v, self.cast))

    def layer(self, i: int, full: Dict) -> None:
        p, c, j = self._where[i]
        for (t, e), sd in L.shard_layer(self.spec, self.lay, full, i).items():
            for key, v in sd.items():
                self.w.add(t, p, e, c, f"decoder.layers.{j}.{key}",
                           None if v is None else _cast(v, self.cast))

    def final(self, norm: np.ndarray, output: Optional[np.ndarray]) -> None:
        p, c = self.lay.last_chunk()
        self._all(p, c, "decoder.final_layernorm.weight", [norm] * self.lay.tp)
        if output is not None:
            self._all(p, c, "output_layer.weight", L.vocab_shards(output, self.lay))
        elif self._emb is not None and self.spec.tied:
            self._all(p, c, "output_layer.weight", self._emb)
        self._all(p, c, "output_layer._extra_state", None)

    def close(self) -> None:
        self.w.close()

    def abort(self) -> None:
        self.w.abort()


class HFSink:
    def __init__(self, path: str, spec: L.ModelSpec, hf_cfg: dict, dtype: np.dtype,
                 max_shard_size: str):
        self.spec, self.dtype = spec, dtype
        cfg = dict(hf_cfg)
        cfg["torch_dtype"] = dtype.name
        self.w = HFWriter(path, [(n, s, dtype) for n, s in L.hf_names(spec)], max_shard_size,
                          cfg)

    def _add(self, name: str, x: np.ndarray) -> None:
        if x.dtype != self.dtype:
            x = _cast(x, self.dtype)
        if x.dtype != self.dtype:
            raise ConvertError(f"tensor {name} is {x.dtype}, the output is {self.dtype}")
        self.w.add(name, x)

    def embedding(self, w: np.ndarray) -> None:
        self._add("model.embed_tokens.weight", w)
        self._emb = w if self.spec.mtp_layers else None   # the MTP depths' copies

    def mtp_layer(self, j: int, full: Dict, output: Optional[np.ndarray]) -> None:
        head = output if output is not None else self._emb
        for name, x in MTP.mtp_full_to_hf(self.spec, full, j, L.full_layer_to_hf, self._emb,
                                          head).items():
            self._add(name, x)

    def layer(self, i: int, full: Dict) -> None:
        for name, x in L.full_layer_to_hf(self.spec, full, i).items():
            self._add(name, x)

    def final(self, norm: np.ndarray, output: Optional[np.ndarray]) -> None:
        self._add("model.norm.weight", norm)
        if output is not None:
            self._add("lm_head.weight", output)

    def close(self) -> None:
        self.w.close()

    def abort(self) -> None:
        self.w.abort()


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------

def convert(opts: argparse.Namespace, progress=None) -> str:
    """Run one conversion described by parsed CLI options; returns the output folder."""
    _refuse_unsupported(opts, build_parser())
    if opts.expert_tensor_parallel_size not in (None, opts.target_tensor_parallel_size):
        raise ConvertError("--expert-tensor-parallel-size: only the default (= tensor-parallel "
                           "size) is supported")
    if opts.save_model_type == "hf" and opts.load_model_type == "hf" and not opts.lora_load:
        raise ConvertError("hf -> hf is not a conversion; copy the folder")
    if not os.path.isdir(opts.load_dir):
        raise ConvertError(f"--load-dir {opts.load_dir}: no such directory")
    save = os.path.abspath(opts.save_dir)
    if os.path.exists(save) and (not os.path.isdir(save) or os.listdir(save)):
        raise ConvertError(f"--save-dir {opts.save_dir}: exists and is not empty")
    if os.path.realpath(opts.load_dir) == os.path.realpath(save):
        raise ConvertError("--save-dir must differ from --load-dir")

    src = HFSource(opts.load_dir, opts.model_type_hf) if opts.load_model_type == "hf" else \
        MegatronSource(opts.load_dir, opts.model_type_hf, opts.hf_cfg_dir)
    tmp = f"{save.rstrip(os.sep)}.tmp-{os.getpid()}"
    sink = None
    try:
        if opts.lora_load:     # W + alpha/r B A, one layer at a time (adapters.merge)
            from ..adapters.merge import merged_source
            src = merged_source(src, opts, opts.load_dir)
        spec = src.spec
        _check_num_layers(opts, spec)
        _select_mtp(opts, src)
        cast = DTYPES[opts.params_dtype] if opts.params_dtype else None
        out_dtype = cast or src.dtype()
        if opts.save_model_type == "mg":
            lay = L.ParallelLayout(
                tp=opts.target_tensor_parallel_size, pp=opts.target_pipeline_parallel_size,
                ep=opts.target_expert_parallel_size,
                vpp_layers=opts.num_layers_per_virtual_pipeline_stage,
                num_layer_list=_int_list(opts.num_layer_list, "--num-layer-list"),
                noop_layers=tuple(_int_list(opts.noop_layers, "--noop-layers") or ()),
                grouped_gemm=opts.moe_grouped_gemm,
                padded_vocab=L.padded_vocab_size(spec.vocab, opts.make_vocab_size_divisible_by,
                                                 opts.target_tensor_parallel_size))
            if opts.moe_grouped_gemm and not spec.num_experts:
                raise ConvertError("--moe-grouped-gemm needs a MoE model")
            lay.validate(spec, where="target layout")
            os.makedirs(tmp)
            sink = MegatronSink(tmp, spec, lay, src.config, out_dtype, cast, src.model_type)
        else:
            os.makedirs(tmp)
            if opts.hf_cfg_dir:   # tokenizer, generation_config...: as MindSpeed copies them
                copy_hf_side_files(opts.hf_cfg_dir, tmp)
            elif opts.load_model_type == "hf":    # hf -> hf merging LoRA adapters
                copy_hf_side_files(opts.load_dir, tmp)
            sink = HFSink(tmp, spec, src.config, out_dtype, opts.max_shard_size)
        return stream_to_sink(src, sink, tmp, save, progress=progress,
                              check=getattr(src, "check", None),
                              allow_nonfinite=opts.allow_non_finite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        src.close()


def _select_mtp(opts: argparse.Namespace, src) -> None:
    """``--mtp-num-layers`` (MindSpeed's): unset or the checkpoint's count converts every MTP
    depth; 0 drops them (said), as MindSpeed does without the flag."""
    want, have = opts.mtp_num_layers, src.spec.mtp_layers
    if want is None or want == have:
        return
    if want != 0:
        raise ConvertError(f"--mtp-num-layers {want}: the checkpoint has {have} MTP layer(s) "
                           f"(config.json num_nextn_predict_layers); pass {have} or 0")
    log.warning("--mtp-num-layers 0: dropping the checkpoint's %d MTP layer(s)", have)
    src.spec.mtp_layers = 0
    src.config = dict(src.config, num_nextn_predict_layers=0)


def main(argv: Optional[List[str]] = None) -> int:
    """CLI entry (``ms-llm convert``): 0 on success; one ``ms-llm convert: ...`` line and 2 on
    bad input."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if any(a in ("-h", "--help") for a in argv):
        parser.print_help()
        return 0
    try:
        opts = parser.parse_args(argv)
        out = convert(opts)
    except (ConvertError, ValueError, KeyError, FileNotFoundError, NotADirectoryError,
            TorchFormatError, ForbiddenGlobalError, RuntimeError, OSError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        print(f"ms-llm convert: {' '.join(str(msg).split())}", file=sys.stderr)
        return 2
    print(f"ms-llm convert: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
