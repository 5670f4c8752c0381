"""Megatron "legacy" torch checkpoint folders (``--ckpt-format torch``), read and written lazily.

Layout::

    <dir>/latest_checkpointed_iteration.txt              "1" (or an iteration, or "release")
    <dir>/iter_0000001/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt

``_PPP`` appears when pp > 1 and ``_EEE`` when ep > 1. Each file is a ``torch.save`` dict
``{"args", "checkpoint_version": 3.0, "iteration", "model"}`` (``model0..`` with virtual
pipeline stages). The ``args`` Namespace records the parallel layout and the architecture; the
reader takes the layout from it (and falls back to the folder's contents when ``args`` is None).

ms-llm also writes the Hugging Face ``config.json`` beside ``latest_checkpointed_iteration.txt``:
mg -> hf uses it when present and otherwise rebuilds it from ``args`` (``hf_config_from_args``).
"""
from __future__ import annotations

import argparse
import json
import os
import re
from collections import OrderedDict
from typing import Dict, List, Optional, Tuple

import numpy as np

from ms_llm.models.layouts import ModelSpec, ParallelLayout, family_of
from ms_llm.models.registry import get_family

from ..torch_pickle import GlobalRef, LazyTensor, TorchCheckpoint, TorchZipWriter, torch_dtype

TRACKER = "latest_checkpointed_iteration.txt"
FILE = "model_optim_rng.pt"
_DTYPE_NAMES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def rank_dir(t: int, p: int, e: int, pp: int, ep: int) -> str:
    name = f"mp_rank_{t:02d}"
    if pp > 1:
        name += f"_{p:03d}"
    if ep > 1:
        name += f"_{e:03d}"
    return name


def is_megatron_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, TRACKER))


def iteration_dir(path: str) -> Tuple[str, object]:
    tracker = os.path.join(path, TRACKER)
    if not os.path.isfile(tracker):
        raise FileNotFoundError(f"{tracker}: missing (not a Megatron checkpoint folder)")
    text = open(tracker).read().strip()
    if text == "release":
        return os.path.join(path, "release"), "release"
    if not text.isdigit():
        raise ValueError(f"{tracker}: expected an iteration number or 'release', got {text!r}")
    d = os.path.join(path, f"iter_{int(text):07d}")
    if not os.path.isdir(d):
        raise FileNotFoundError(f"{d}: missing (named by {tracker})")
    return d, int(text)


# --------------------------------------------------------------------------------------------
# args
# --------------------------------------------------------------------------------------------

def make_args(spec: ModelSpec, lay: ParallelLayout, hf_cfg: dict, dtype: np.dtype,
              model_type_hf: str, iteration: int = 1) -> argparse.Namespace:
    """The ``args`` Namespace the PyTorch lane reads when loading (Megatron argument names)."""
    dname = np.dtype(dtype).name
    moe = spec.num_experts > 0
    fam = get_family(spec.family)
    c = spec.config or fam.from_hf(hf_cfg, "config.json")   # None: a spec built by hand
    norm_topk = (not c.moe_router_pre_softmax if c.moe_router_score_function == "softmax"
                 else c.moe_router_norm_topk_prob)
    return argparse.Namespace(
        num_layers=spec.num_layers + len(lay.noop_layers), hidden_size=spec.hidden,
        ffn_hidden_size=spec.ffn, num_attention_heads=spec.heads,
        group_query_attention=spec.groups != spec.heads, num_query_groups=spec.groups,
        kv_channels=spec.head_dim, padded_vocab_size=lay.padded_vocab, vocab_size=spec.vocab,
        max_position_embeddings=int(c.max_position_embeddings),
        seq_length=int(c.max_position_embeddings),
        normalization="RMSNorm", norm_epsilon=float(c.layernorm_epsilon),
        swiglu=True, position_embedding_type="rope",
        rotary_base=float(c.rotary_base),
        untie_embeddings_and_output_weights=not spec.tied, add_qkv_bias=spec.qkv_bias,
        add_bias_linear=False, qk_layernorm=spec.qk_norm,
        tensor_model_parallel_size=lay.tp, pipeline_model_parallel_size=lay.pp,
        expert_model_parallel_size=lay.ep, expert_tensor_parallel_size=lay.tp,
        virtual_pipeline_model_parallel_size=lay.vpp if lay.vpp_layers else None,
        num_layers_per_virtual_pipeline_stage=lay.vpp_layers,
        num_layer_list=",".join(map(str, lay.num_layer_list)) if lay.num_layer_list else None,
        noop_layers=",".join(map(str, lay.noop_layers)) if lay.noop_layers else None,
        params_dtype=torch_dtype(dname) if dname in _DTYPE_NAMES else torch_dtype("float32"),
        bf16=dname == "bfloat16", fp16=dname == "float16",
        num_experts=spec.num_experts if moe else None,
        moe_router_topk=spec.moe_topk if moe else 2,
        moe_ffn_hidden_size=spec.moe_ffn if moe else None,
        moe_grouped_gemm=lay.grouped_gemm,
        moe_layer_freq=[int(x) for x in spec.moe_layers] if moe else 1,
        moe_norm_topk_prob=bool(norm_topk) if moe else False,
        model_type_hf=model_type_hf, transformer_impl="local", use_mcore_models=True,
        ckpt_format="torch", iteration=iteration, consumed_train_samples=0,
        consumed_valid_samples=0, mtp_num_layers=spec.mtp_layers or None,
        # the family's own (MLA, the DeepSeek router; none for the others)
        **fam.megatron_args(c))


def _int_list(value) -> Optional[List[int]]:
    if value is None or value == "" or value == []:
        return None
    if isinstance(value, str):
        return [int(x) for x in value.replace(" ", "").split(",") if x]
    return [int(x) for x in value]


def config_from_args(args: argparse.Namespace, model_type_hf: str):
    """The TransformerConfig Megatron ``args`` describe, for a family whose architecture they
    can hold (grouped-query attention, dense or softmax-routed MoE MLPs); the family's fixed
    switches (QK-norm, QKV bias) come from its registry record."""
    from ms_llm.models.config import TransformerConfig
    fam = family_of(model_type_hf)
    d = fam.defaults
    if d.get("multi_latent_attention") or d.get("moe_router_score_function", "softmax") != \
            "softmax":
        raise ValueError(f"--model-type-hf {model_type_hf}: rebuilding config.json from Megatron "
                         f"args is not built for this family; pass --hf-cfg-dir with its "
                         f"config.json")
    a = vars(args)
    layers = a["num_layers"] - len(_int_list(a.get("noop_layers")) or [])
    heads = a["num_attention_heads"]
    dt = a.get("params_dtype")
    fields = dict(
        num_layers=layers, hidden_size=a["hidden_size"], ffn_hidden_size=a["ffn_hidden_size"],
        num_attention_heads=heads,
        num_query_groups=a.get("num_query_groups") if a.get("group_query_attention") else heads,
        kv_channels=a.get("kv_channels") or a["hidden_size"] // heads,
        padded_vocab_size=a.get("vocab_size") or a["padded_vocab_size"],
        max_position_embeddings=a.get("max_position_embeddings", 4096),
        layernorm_epsilon=a.get("norm_epsilon", 1e-6), rotary_base=a.get("rotary_base", 10000.0),
        untie_embeddings_and_output_weights=a.get("untie_embeddings_and_output_weights", True),
        params_dtype=dt.name if isinstance(dt, GlobalRef) else (
            "bfloat16" if a.get("bf16") else "float16" if a.get("fp16") else "float32"))
    if d.get("mlp_type") == "moe":
        # Megatron: an int N makes layers 0, N, 2N, ... MoE; spelled out per layer.
        freq = a.get("moe_layer_freq", 1)
        pattern = [int(x) for x in freq] if isinstance(freq, list) else \
            [int(i % int(freq) == 0) for i in range(layers)]
        fields.update(num_moe_experts=a["num_experts"],
                      moe_router_topk=a.get("moe_router_topk", 2),
                      moe_ffn_hidden_size=a.get("moe_ffn_hidden_size") or a["ffn_hidden_size"],
                      moe_router_pre_softmax=not bool(a.get("moe_norm_topk_prob", False)),
                      moe_aux_loss_coeff=a.get("moe_aux_loss_coeff", 0.001),
                      moe_layer_pattern=pattern)
    return fam, TransformerConfig(**dict(d, **fields))


def hf_config_from_args(args: argparse.Namespace, model_type_hf: str) -> dict:
    """Rebuild an HF ``config.json`` from Megatron ``args`` (used when no config.json was
    carried beside the checkpoint): ``config_from_args`` then the family's ``to_hf``.
    ``vocab_size`` falls back to the padded size."""
    fam, config = config_from_args(args, model_type_hf)
    return fam.to_hf(config)


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------

class MegatronReader:
    """All rank files of a Megatron folder, opened lazily (pickles parsed, tensors on disk)."""

    def __init__(self, path: str):
        self.path = path
        self.iter_dir, self.iteration = iteration_dir(path)
        names = sorted(n for n in os.listdir(self.iter_dir) if n.startswith("mp_rank_"))
        if not names:
            raise FileNotFoundError(f"{self.iter_dir}: no mp_rank_* folders")
        parsed = []
        for n in names:
            m = re.fullmatch(r"mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?", n)
            if not m:
                raise ValueError(f"{os.path.join(self.iter_dir, n)}: unexpected folder name")
            parsed.append(tuple(int(x) if x is not None else None for x in m.groups()))
        first = os.path.join(self.iter_dir, names[0], FILE)
        if not os.path.isfile(first):
            raise FileNotFoundError(f"{first}: missing")
        head = TorchCheckpoint(first)
        self.args = head.obj.get("args") if isinstance(head.obj, dict) else None
        head.close()
        a = vars(self.args) if isinstance(self.args, argparse.Namespace) else {}
        tp = a.get("tensor_model_parallel_size") or 1 + max(x[0] for x in parsed)
        if a:
            pp = a.get("pipeline_model_parallel_size") or 1
            ep = a.get("expert_model_parallel_size") or 1
        else:
            pp, ep = self._infer_pp_ep(names, parsed)
        self.tp, self.pp, self.ep = int(tp), int(pp), int(ep)
        self.files: Dict[Tuple[int, int, int], TorchCheckpoint] = {}
        try:
            for t in range(self.tp):
                for p in range(self.pp):
                    for e in range(self.ep):
                        f = os.path.join(self.iter_dir, rank_dir(t, p, e, self.pp, self.ep), FILE)
                        if not os.path.isfile(f):
                            raise FileNotFoundError(f"{f}: missing shard (tp={self.tp}, "
                                                    f"pp={self.pp}, ep={self.ep})")
                        self.files[(t, p, e)] = TorchCheckpoint(f)
        except BaseException:
            self.close()
            raise
        self.models = {k: self._models(k, c) for k, c in self.files.items()}
        self.read_keys: set = set()   # (pp stage, chunk, key) read at least once (any tp/ep copy)

    def _infer_pp_ep(self, names, parsed) -> Tuple[int, int]:
        three = [x for x in parsed if x[2] is not None]
        if three:
            return 1 + max(x[1] for x in three), 1 + max(x[2] for x in three)
        two = [x[1] for x in parsed if x[1] is not None]
        if not two:
            return 1, 1
        # mp_rank_TT_XXX without args: pipeline stages differ in holding the embedding.
        n = 1 + max(two)
        ck = TorchCheckpoint(os.path.join(self.iter_dir, names[-1], FILE))
        try:
            keys = list(self._models(None, ck)[0])
        finally:
            ck.close()
        has_emb = "embedding.word_embeddings.weight" in keys
        return (1, n) if has_emb else (n, 1)

    def _models(self, key, ck: TorchCheckpoint) -> List[Dict[str, LazyTensor]]:
        obj = ck.obj
        where = ck.archive.path
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: expected a dict with 'model', got {type(obj).__name__}")
        if "model" in obj:
            return [obj["model"]]
        chunks = sorted((k for k in obj if re.fullmatch(r"model\d+", str(k))),
                        key=lambda k: int(k[5:]))
        if not chunks:
            raise ValueError(f"{where}: no 'model' or 'model0' entry")
        return [obj[k] for k in chunks]

    def layout(self, spec: ModelSpec) -> ParallelLayout:
        """The parallel layout, from ``args`` when present, else from the files' contents."""
        a = vars(self.args) if isinstance(self.args, argparse.Namespace) else {}
        m0 = self.models[(0, 0, 0)]
        emb = m0[0].get("embedding.word_embeddings.weight")
        if emb is None:
            raise ValueError(f"{self.files[(0, 0, 0)].archive.path}: no "
                             f"embedding.word_embeddings.weight in the first pipeline stage")
        keys = [k for sd in m0 for k in sd]
        lay = ParallelLayout(tp=self.tp, pp=self.pp, ep=self.ep,
                             grouped_gemm=any(k.endswith("mlp.experts.weight1") for k in keys)
                             or any(k.endswith("mlp.experts.weight1")
                                    for sd in self.models[(0, self.pp - 1, 0)] for k in sd),
                             padded_vocab=emb.shape[0] * self.tp)
        lay.noop_layers = tuple(_int_list(a.get("noop_layers")) or ())
        nll = _int_list(a.get("num_layer_list"))
        n_chunks = len(m0)
        if n_chunks > 1:
            lay.vpp_layers = a.get("num_layers_per_virtual_pipeline_stage") or \
                (spec.num_layers + len(lay.noop_layers)) // (self.pp * n_chunks)
        elif nll:
            lay.num_layer_list = nll
        elif not a:
            counts = [1 + max((int(k.split(".")[2]) for k in self.models[(0, p, 0)][0]
                               if k.startswith("decoder.layers.")), default=-1)
                      for p in range(self.pp)]
            if len(set(counts)) > 1:
                lay.num_layer_list = counts
        lay.validate(spec, where=self.path)
        if lay.vpp != n_chunks:
            raise ValueError(f"{self.path}: files hold {n_chunks} model chunks, the layout "
                             f"implies {lay.vpp}")
        return lay

    def tensor(self, t: int, p: int, e: int, chunk: int, key: str) -> np.ndarray:
        sd = self.models[(t, p, e)][chunk]
        if key not in sd or sd[key] is None:
            raise KeyError(f"{self.files[(t, p, e)].archive.path}: missing tensor {key!r}"
                           + (f" in model{chunk}" if len(self.models[(t, p, e)]) > 1 else ""))
        v = sd[key]
        self.read_keys.add((p, chunk, key))
        return v.numpy() if isinstance(v, LazyTensor) else np.asarray(v)

    def unread(self) -> List[str]:
        """Stored tensors no ``tensor()`` call has read (``_extra_state`` placeholders aside),
        as ``mp_rank_*/model_optim_rng.pt: key``: what a conversion would silently drop."""
        out = []
        for (t, p, e), chunks in self.models.items():
            for c, sd in enumerate(chunks):
                for key, v in sd.items():
                    if v is None or key.endswith("_extra_state") or (p, c, key) in self.read_keys:
                        continue
                    out.append(f"{self.files[(t, p, e)].archive.path}: {key}")
        return sorted(set(out))

    def dtype(self) -> np.dtype:
        return self.models[(0, 0, 0)][0]["embedding.word_embeddings.weight"].dtype

    def close(self) -> None:
        for ck in self.files.values():
            ck.close()
        self.files = {}


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------

class MegatronWriter:
    """One streaming ``TorchZipWriter`` per (tp, pp, ep) rank; ``close`` writes the pickles and
    the tracker file."""

    def __init__(self, path: str, lay: ParallelLayout, args: argparse.Namespace,
                 iteration: int = 1):
        self.path, self.lay, self.args, self.iteration = path, lay, args, iteration
        it_dir = os.path.join(path, f"iter_{iteration:07d}")
        self.writers: Dict[Tuple[int, int, int], TorchZipWriter] = {}
        self.models: Dict[Tuple[int, int, int], List[OrderedDict]] = {}
        for t in range(lay.tp):
            for p in range(lay.pp):
                for e in range(lay.ep):
                    d = os.path.join(it_dir, rank_dir(t, p, e, lay.pp, lay.ep))
                    os.makedirs(d, exist_ok=True)
                    self.writers[(t, p, e)] = TorchZipWriter(os.path.join(d, FILE))
                    self.models[(t, p, e)] = [OrderedDict() for _ in range(lay.vpp)]

    def add(self, t: int, p: int, e: int, chunk: int, key: str,
            value: Optional[np.ndarray]) -> None:
        self.models[(t, p, e)][chunk][key] = (None if value is None
                                              else self.writers[(t, p, e)].add_tensor(value))

    def close(self) -> None:
        for k, w in self.writers.items():
            obj = OrderedDict(args=self.args, checkpoint_version=3.0, iteration=self.iteration)
            chunks = self.models[k]
            if len(chunks) == 1:
                obj["model"] = chunks[0]
            else:
                for c, sd in enumerate(chunks):
                    obj[f"model{c}"] = sd
            w.close(dict(obj))
        with open(os.path.join(self.path, TRACKER), "w") as f:
            f.write(str(self.iteration))

    def abort(self) -> None:
        for w in self.writers.values():
            w.abort()


def write_hf_config(path: str, cfg: dict) -> None:
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")


# ModelSpec field -> the config.json key that sets it (for messages).
_HF_KEY_OF = {"num_layers": "num_hidden_layers", "hidden": "hidden_size",
              "ffn": "intermediate_size", "heads": "num_attention_heads",
              "groups": "num_key_value_heads", "head_dim": "head_dim",
              "tied": "tie_word_embeddings", "num_experts": "num_experts",
              "moe_ffn": "moe_intermediate_size", "moe_topk": "num_experts_per_tok",
              "moe_layers": "mlp_only_layers / decoder_sparse_step"}


def check_hf_template(own: ModelSpec, template: ModelSpec, padded_vocab: int,
                      template_dir: str, path: str) -> None:
    """``--hf-cfg-dir``: the HF folder whose ``config.json`` will describe the converted weights
    must describe this Megatron checkpoint (same shapes; its vocabulary fits the checkpoint's
    padded embedding rows, the rest being Megatron's padding). A wrong folder would otherwise
    give an HF model that fails to load, or loads and computes garbage."""
    where = os.path.join(template_dir, "config.json")
    for name in _HF_KEY_OF:
        mine, theirs = getattr(own, name), getattr(template, name)
        if mine != theirs:
            raise ValueError(f"--hf-cfg-dir {where}: {_HF_KEY_OF[name]} is {theirs} but the "
                             f"Megatron checkpoint {path} has {mine}; pass the HF folder this "
                             f"checkpoint was converted from")
    if template.vocab > padded_vocab:
        raise ValueError(f"--hf-cfg-dir {where}: vocab_size {template.vocab} is larger than the "
                         f"{padded_vocab} embedding rows of the Megatron checkpoint {path}")
