"""HF <-> Megatron-Core layouts of the multi-token prediction layers (DeepSeek-V3, GLM-4.5).

HF keeps MTP depth ``j`` as decoder layer ``model.layers.{L + j}`` (``L`` =
``num_hidden_layers``, ``num_nextn_predict_layers`` depths): a normal decoder layer's tensors
plus ``embed_tokens``, ``enorm``, ``hnorm``, ``eh_proj`` and ``shared_head.{norm,head}``.
Megatron-Core (and MindSpeed-LLM) hold it as ``mtp.layers.{j}.``: ``enorm``, ``hnorm``,
``eh_proj`` (a column-parallel linear: tp rank r holds rows ``[r*H/tp, (r+1)*H/tp)``),
``transformer_layer.*`` (the decoder layer, split like any other) and ``final_layernorm``
(HF ``shared_head.norm``), on the last pipeline stage. The embedding and output head are shared
with the main model, so HF's per-layer copies are not stored; writing HF puts the main model's
back (DeepSeek's release stores the same values there, so HF -> Megatron -> HF is bit-exact).
With pipeline parallel the last stage also gets the word embedding (the MTP block embeds the
shifted tokens there), as Megatron-Core's MTP stage holds it.

Qwen3-Next / Qwen3.5 (``spec.mtp_hf == "mtp"``) keep one depth under ``mtp.``: ``fc`` (eh_proj),
``pre_fc_norm_embedding`` (enorm), ``pre_fc_norm_hidden`` (hnorm), ``layers.0.*`` (a full-
attention decoder layer, HF's per-layer names) and ``norm`` (final_layernorm), with no embedding
or head copies -- the names MindSpeed-LLM's ``qwen3-next`` converter maps to the same Megatron
keys (its ``remap_mtp_keys`` moves ``mtp.layers.j`` to ``model.layers.{L + j}``, as here).
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from .kinds import EXTRA

log = logging.getLogger("ms_llm.checkpoint")
_OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight")


_QWEN = {"enorm.weight": "mtp.pre_fc_norm_embedding.weight",
         "hnorm.weight": "mtp.pre_fc_norm_hidden.weight", "eh_proj.weight": "mtp.fc.weight"}
_QWEN_FINAL = "mtp.norm.weight"


def hf_prefix(spec, j: int) -> str:
    return f"model.layers.{spec.num_layers + j}."


def _qwen(spec) -> bool:
    return spec.mtp_hf == "mtp"


def is_mtp_tensor(spec, name: str) -> bool:
    """HF keeps DeepSeek's / GLM's MTP module as ``model.layers.{num_layers + j}.*``
    (Qwen3-Next's / Qwen3.5's as ``mtp.*``)."""
    if spec.mtp_hf == "mtp":
        return name.startswith("mtp.")
    if not spec.mtp_layers or not name.startswith("model.layers."):
        return False
    idx = name.split(".")[2]
    return idx.isdigit() and spec.num_layers <= int(idx) < spec.num_layers + spec.mtp_layers


def hf_marker(spec, j: int) -> str:
    """The HF tensor whose presence says a folder holds MTP depth ``j`` (Qwen's ``mtp.`` has
    one depth: a second is never present)."""
    if _qwen(spec):
        return "mtp.fc.weight" if j == 0 else f"mtp.{j}.fc.weight"
    return hf_prefix(spec, j) + "eh_proj.weight"


def _qwen_name(spec, j: int, name: str) -> str:
    """A decoder-layer HF name of MTP depth ``j`` (``model.layers.{L + j}.X``) -> ``mtp.layers.
    {j}.X``."""
    p = hf_prefix(spec, j)
    return f"mtp.layers.{j}." + name[len(p):] if name.startswith(p) else name


def mtp_hf_names(spec, j: int, layer_names: Callable[[object, int], List[Tuple[str, tuple]]]
                 ) -> List[Tuple[str, tuple]]:
    """HF tensor names and shapes of MTP depth ``j``; ``layer_names`` gives a decoder layer's."""
    p, H, V = hf_prefix(spec, j), spec.hidden, spec.vocab
    if _qwen(spec):
        return ([(_QWEN[k], (H, 2 * H) if k == "eh_proj.weight" else (H,)) for k in _OWN]
                + [(_qwen_name(spec, j, n), s) for n, s in layer_names(spec, spec.num_layers + j)]
                + [(_QWEN_FINAL, (H,))])
    return ([(p + "embed_tokens.weight", (V, H)), (p + "enorm.weight", (H,)),
             (p + "hnorm.weight", (H,)), (p + "eh_proj.weight", (H, 2 * H))]
            + layer_names(spec, spec.num_layers + j)
            + [(p + "shared_head.norm.weight", (H,)), (p + "shared_head.head.weight", (V, H))])


def mtp_hf_to_full(spec, get: Callable[[str], np.ndarray], j: int, layer_to_full,
                   where: str = "") -> Dict:
    """HF depth ``j`` -> full Megatron tensors relative to ``mtp.layers.{j}.``. The depth's
    embedding / head copies are checked against the main model's (a checkpoint whose copies
    differ cannot be expressed with Megatron's shared ones: said, then dropped)."""
    p = hf_prefix(spec, j)
    if _qwen(spec):
        full = OrderedDict((k, get(_QWEN[k])) for k in _OWN)
        inner = layer_to_full(spec, lambda n: get(_qwen_name(spec, j, n)), spec.num_layers + j)
        full.update(("transformer_layer." + k, v) for k, v in inner.items())
        full["final_layernorm.weight"] = get(_QWEN_FINAL)
        return full
    full = OrderedDict((k, get(p + k)) for k in _OWN)
    for k, v in layer_to_full(spec, get, spec.num_layers + j).items():
        full["transformer_layer." + k] = v
    full["final_layernorm.weight"] = get(p + "shared_head.norm.weight")
    main_head = "model.embed_tokens.weight" if spec.tied else "lm_head.weight"
    for copy, main in (("embed_tokens.weight", "model.embed_tokens.weight"),
                       ("shared_head.head.weight", main_head)):
        if not np.array_equal(get(p + copy), get(main)):
            log.warning("%s%s differs from %s: Megatron's MTP shares the main model's, so "
                        "the copy is dropped", where and where + ": ", p + copy, main)
    return full


def mtp_full_to_hf(spec, full: Dict, j: int, layer_to_hf, embedding: np.ndarray,
                   output: np.ndarray) -> Dict[str, np.ndarray]:
    p = hf_prefix(spec, j)
    inner = OrderedDict((k[len("transformer_layer."):], v) for k, v in full.items()
                        if k.startswith("transformer_layer."))
    if _qwen(spec):
        hf = {_QWEN[k]: full[k] for k in _OWN}
        hf.update((_qwen_name(spec, j, n), v)
                  for n, v in layer_to_hf(spec, inner, spec.num_layers + j).items())
        hf[_QWEN_FINAL] = full["final_layernorm.weight"]
        return hf
    hf = {p + "embed_tokens.weight": embedding}
    hf.update({p + k: full[k] for k in _OWN})
    hf.update(layer_to_hf(spec, inner, spec.num_layers + j))
    hf[p + "shared_head.norm.weight"] = full["final_layernorm.weight"]
    hf[p + "shared_head.head.weight"] = output
    return hf


def mtp_shard(spec, lay, full: Dict, j: int, shard_layer
              ) -> Dict[Tuple[int, int], "OrderedDict[str, Optional[np.ndarray]]"]:
    """Full depth -> ``{(tp_rank, ep_rank): keys relative to mtp.layers.{j}.}``."""
    inner = OrderedDict((k[len("transformer_layer."):], v) for k, v in full.items()
                        if k.startswith("transformer_layer."))
    layers = shard_layer(spec, lay, inner, spec.num_layers + j)
    out = {}
    for (t, e), sd in layers.items():
        o = OrderedDict()
        o["enorm.weight"], o["hnorm.weight"] = full["enorm.weight"], full["hnorm.weight"]
        o["eh_proj.weight"] = np.split(full["eh_proj.weight"], lay.tp, axis=0)[t]
        o["eh_proj." + EXTRA] = None
        for k, v in sd.items():
            o["transformer_layer." + k] = v
        o["final_layernorm.weight"] = full["final_layernorm.weight"]
        out[(t, e)] = o
    return out


def mtp_merge(spec, lay, part: Callable[[int, int, str], np.ndarray], j: int, merge_layer
              ) -> Dict:
    """Inverse of ``mtp_shard``; ``part(tp_rank, ep_rank, key relative to mtp.layers.{j}.)``."""
    full = OrderedDict()
    full["enorm.weight"], full["hnorm.weight"] = part(0, 0, "enorm.weight"), \
        part(0, 0, "hnorm.weight")
    full["eh_proj.weight"] = np.concatenate([part(t, 0, "eh_proj.weight")
                                             for t in range(lay.tp)], axis=0)
    inner = merge_layer(spec, lay, lambda t, e, k: part(t, e, "transformer_layer." + k),
                        spec.num_layers + j)
    for k, v in inner.items():
        full["transformer_layer." + k] = v
    full["final_layernorm.weight"] = part(0, 0, "final_layernorm.weight")
    return full


def validate_mtp(spec, lay, where: str) -> None:
    if spec.mtp_layers and spec.hidden % lay.tp:
        raise ValueError(f"{where}: tensor-parallel size {lay.tp} must divide hidden_size "
                         f"({spec.hidden}) for the MTP eh_proj")


def present_depths(spec, has: Callable[[int], bool], where: str) -> int:
    """MTP depths whose tensors a folder holds, of the ``num_nextn_predict_layers`` its config
    names: transformers saves DeepSeek-V3 / GLM-4.5 models with the field set but without the
    MTP weights (its MTP module is a separate speculative-decoding model), so a config's count
    alone does not say the weights are there."""
    n = 0
    while n < spec.mtp_layers and has(n):
        n += 1
    if n < spec.mtp_layers:
        log.info("%s: config names %d MTP layer(s), the folder holds %d; converting %d",
                 where, spec.mtp_layers, n, n)
    return n
