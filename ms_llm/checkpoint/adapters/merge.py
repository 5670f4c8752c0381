"""LoRA adapters outside training: read them (an ms-llm training checkpoint or a PEFT folder),
turn them into weight deltas in Megatron's full-layer form, and merge them into a converter
source, so ``ms-llm export`` and ``ms-llm convert --lora-load`` stream base + delta one layer at
a time through the converter's own sinks (the QKV / gate-up / vocabulary rules stay in
``models.layouts``).

The merged weight is ``W + (alpha / r) B A`` (rsLoRA: ``alpha / sqrt(r)``), computed in
float64 and stored in W's dtype. A module whose B is all zero (an untrained adapter) is left bit-identical: adding zero would only
turn ``-0.0`` into ``+0.0``.

A LoRA training checkpoint also holds the buffers training kept moving under the frozen base:
the routers' ``mlp.router.expert_bias`` (aux-loss-free balancing updates it every step, LoRA or
not). The trained model routes with those values, so the merge writes them over the base's
(``e_score_correction_bias``): the base's would route tokens to other experts.
"""
from __future__ import annotations

import os
import re
from collections import OrderedDict
from typing import Dict, List, Optional, Tuple

import numpy as np

from ms_llm.models import layouts as L
from ms_llm.models.layouts.mla import MLA_LORA_MODULES
from ms_llm.lora.base import ALIASES, STATE_KEY, check_base
from .peft_fields import PeftFields

# Megatron module (relative to decoder.layers.{i}.) -> HF module(s) it fuses
MODULES = OrderedDict([
    ("self_attention.linear_qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("self_attention.linear_proj", ("self_attn.o_proj",)),
    ("mlp.linear_fc1", ("mlp.gate_proj", "mlp.up_proj")),
    ("mlp.linear_fc2", ("mlp.down_proj",)),
    # Gated DeltaNet (merged in Megatron's fused form; the layer kind writes HF's layout)
    ("self_attention.in_proj_qkvz", ("linear_attn.in_proj_qkvz",)),
    ("self_attention.in_proj_ba", ("linear_attn.in_proj_ba",)),
    ("self_attention.out_proj", ("linear_attn.out_proj",)),
])
# latent attention's linears (the layout's map). HF_TO_MODULE is read for names only (PEFT
# tensor checks, --lora-target-modules): HF q_proj keeps the fused q/k/v attention's module.
MODULES.update((k, v) for k, v in MLA_LORA_MODULES.items() if k not in MODULES)
HF_TO_MODULE: Dict[str, str] = {}
for _mod, _hfs in MODULES.items():
    for _hf in _hfs:
        HF_TO_MODULE.setdefault(_hf.rsplit(".", 1)[-1], _mod)


def modules_for(spec: L.ModelSpec) -> "OrderedDict":
    """The Megatron -> HF module map of ``spec``'s layers: latent attention's linears or
    the fused q/k/v attention's (HF ``q_proj`` is one or the other)."""
    drop = {"self_attention.linear_qkv"} if spec.mla else \
        set(MLA_LORA_MODULES) - {"self_attention.linear_proj"}
    return OrderedDict((k, v) for k, v in MODULES.items() if k not in drop)


_KEY = re.compile(r"^decoder\.layers\.(\d+)\.(.+)\.lora_([AB])\.weight(:gate|:up)?$")
_LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
PEFT_PREFIX = "base_model.model.model.layers."
_PEFT_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(.+)\.lora_([AB])\.weight$")


# The largest |entry| of a LoRA factor merged. Trained factors start at ~1/sqrt(in) (A) and 0
# (B) and move at small learning rates, so their entries are O(1); 1e4 is far above any, and
# bounds each delta entry by |alpha / r| * r * 1e4 * 1e4 = |alpha| * 1e8, far below where a
# float32 / bf16 weight overflows (3.4e38), so a finite but absurd value (3e38) is refused
# rather than merged. The merged weight is also checked finite in its own dtype (a huge alpha).
FACTOR_BOUND = 1e4


class AdapterError(ValueError):
    """Bad adapters (reported as one line)."""


def _delta(a: np.ndarray, b: np.ndarray, scale: float) -> Optional[np.ndarray]:
    b64 = np.asarray(b, np.float64)
    if not np.any(b64):
        return None
    return scale * (b64 @ np.asarray(a, np.float64))


class Adapters:
    """A whole model's adapters: per (layer, Megatron module) the pair (A, B) of the fused
    module, or per HF module (PEFT files need not share A between q, k and v)."""

    def __init__(self, r: int, alpha: float, where: str, state: Optional[dict] = None):
        from ms_llm.validation import InputError, check_float, check_int
        try:   # a checkpoint's recorded r / alpha pass the same checks as PEFT's
            self.r = check_int(where, "lora r", r, 1, 1 << 16)
            self.alpha = check_float(where, "lora alpha", alpha)
        except InputError as e:
            raise AdapterError(str(e)) from None
        self.where = where
        self.scale = self.alpha / self.r
        self.state = state or {}
        self.fused: Dict[Tuple[int, str], Tuple[np.ndarray, np.ndarray]] = {}
        self.per_hf: Dict[Tuple[int, str], Tuple[np.ndarray, np.ndarray]] = {}
        # (layer, full-layer key) -> the trained buffer (router expert_bias), checkpoints only
        self.buffers: Dict[Tuple[int, str], np.ndarray] = {}
        self.unplaced: List[str] = []        # buffers outside decoder.layers (none place them)
        self.applied = set()

    def layers(self) -> List[int]:
        return sorted({i for i, _ in self.fused} | {i for i, _ in self.per_hf}
                      | {i for i, _ in self.buffers})

    def deltas(self, spec: L.ModelSpec, i: int) -> Dict[str, np.ndarray]:
        """Full-layer keys (``self_attention.linear_qkv.weight``...) -> float64 delta."""
        out = {}
        for (li, mod), (a, b) in self.fused.items():
            if li == i:
                d = _delta(a, b, self.scale)
                if d is not None:
                    out[mod + ".weight"] = d
                self.applied.add((li, mod))
        for mod, hfs in modules_for(spec).items():
            parts = [self.per_hf.get((i, hf)) for hf in hfs]
            if all(p is None for p in parts):
                continue
            for hf, p in zip(hfs, parts):
                if p is not None:
                    self.applied.add((i, hf))
            ds = [None if p is None else _delta(p[0], p[1], self.scale) for p in parts]
            if all(d is None for d in ds):
                continue
            if len(ds) == 1:
                out[mod + ".weight"] = ds[0]
                continue
            shapes = _hf_shapes(spec, mod)
            ds = [np.zeros(s) if d is None else d for d, s in zip(ds, shapes)]
            out[mod + ".weight"] = (L.fuse_qkv(*ds, spec.groups) if len(ds) == 3
                                    else np.concatenate(ds, 0))
        return out

    def check_all_applied(self) -> None:
        if self.unplaced:
            raise AdapterError(f"{self.where}: trained buffer {self.unplaced[0]!r} has no place "
                               f"in the merged model (only decoder layers' buffers merge)")
        left = sorted(set(self.fused) - self.applied) + sorted(set(self.per_hf) - self.applied) \
            + sorted(set(self.buffers) - self.applied)
        if left:
            i, mod = left[0]
            raise AdapterError(f"{self.where}: adapter of decoder layer {i} {mod} has no layer "
                               f"in the base model (a different base?)")


def check_pair(ad: "Adapters", what: str, a: np.ndarray, b: np.ndarray) -> Tuple[np.ndarray,
                                                                               np.ndarray]:
    """One module's (A, B): 2-D, rank ``ad.r`` (A is ``[r, in]``, B ``[out, r]``: a rank that
    disagrees with the recorded ``r`` would make ``alpha / r`` the wrong scale) and finite."""
    if a.ndim != 2 or b.ndim != 2 or a.shape[0] != ad.r or b.shape[1] != ad.r:
        raise AdapterError(f"{ad.where}: {what}: lora_A {list(a.shape)} / lora_B "
                           f"{list(b.shape)} do not have rank r = {ad.r} (adapter_config.json "
                           f"or the checkpoint's lora.r disagrees with the tensors)")
    for name, x in (("lora_A", a), ("lora_B", b)):
        x32 = np.asarray(x, np.float32)
        if not np.isfinite(x32).all():
            raise AdapterError(f"{ad.where}: {what} {name} holds a non-finite value (NaN/inf)")
        big = float(np.abs(x32).max()) if x32.size else 0.0
        if big > FACTOR_BOUND:
            raise AdapterError(f"{ad.where}: {what} {name} holds {big:.3g}, above the bound "
                               f"{FACTOR_BOUND:g} for a LoRA factor (trained factors are O(1); "
                               f"a damaged file?)")
    return a, b


def _hf_shapes(spec: L.ModelSpec, mod: str) -> List[tuple]:
    H, d = spec.hidden, spec.head_dim
    return {"self_attention.linear_qkv": [(spec.heads * d, H), (spec.groups * d, H),
                                          (spec.groups * d, H)],
            "self_attention.linear_proj": [(H, spec.heads * d)],
            "mlp.linear_fc1": [(spec.ffn, H), (spec.ffn, H)],
            "mlp.linear_fc2": [(H, spec.ffn)],
            **_gdn_shapes(spec)}[mod]


def _gdn_shapes(spec: L.ModelSpec) -> Dict[str, List[tuple]]:
    if not spec.linear:
        return {}
    hk, hv, dk, dv, _ = spec.linear
    H = spec.hidden
    return {"self_attention.in_proj_qkvz": [(2 * hk * dk + 2 * hv * dv, H)],
            "self_attention.in_proj_ba": [(2 * hv, H)],
            "self_attention.out_proj": [(H, hv * dv)]}


# ------------------------------------------------------------------------------ reading
def read_checkpoint_adapters(path: str) -> Adapters:
    """The adapters of an ms-llm training checkpoint (an ``iter_*`` folder)."""
    from ms_llm.checkpoint.native.load import DCPReader
    reader = DCPReader(path)
    try:
        st = reader.state.get(STATE_KEY)
        if not st:
            raise AdapterError(f"{path}: not a LoRA checkpoint (its state has no 'lora' entry)")
        ad = Adapters(st["r"], st["alpha"], path, st)
        ad.checkpoint_state = reader.state
        raw: Dict[Tuple[int, str, str], Dict[str, np.ndarray]] = {}
        for n in reader.names():
            m = _KEY.match(n)
            if m:
                i, mod, ab, part = int(m[1]), m[2], m[3], m[4] or ""
                raw.setdefault((i, mod, ab), {})[part] = reader.read(n)
            elif not n.startswith("optimizer."):     # a buffer trained under the frozen base
                m = _LAYER_KEY.match(n)
                if m:
                    ad.buffers[(int(m[1]), m[2])] = reader.read(n)
                else:
                    ad.unplaced.append(n)
        pairs: Dict[Tuple[int, str], Dict[str, np.ndarray]] = {}
        for (i, mod, ab), parts in raw.items():
            x = parts[""] if "" in parts else np.concatenate([parts[":gate"], parts[":up"]], 0)
            pairs.setdefault((i, mod), {})[ab] = x
        for (i, mod), p in pairs.items():
            if mod not in MODULES or set(p) != {"A", "B"}:
                raise AdapterError(f"{path}: decoder.layers.{i}.{mod}: expected lora_A and "
                                   f"lora_B of a {'/'.join(TARGETS)} module")
            ad.fused[(i, mod)] = check_pair(ad, f"decoder.layers.{i}.{mod}", p["A"], p["B"])
        if not ad.fused:
            raise AdapterError(f"{path}: the checkpoint holds no adapter tensors")
        return ad
    finally:
        reader.close()


def read_peft_adapters(folder: str) -> Adapters:
    """PEFT's ``adapter_config.json`` + ``adapter_model.safetensors``: plain LoRA or rsLoRA,
    on the layers ``layers_to_transform`` names; every other field that would change the merge
    is refused (``peft_fields``)."""
    from ms_llm.checkpoint.hf.io import SafetensorsFile
    from ms_llm.validation import InputError, read_json_object, validate_adapter_config
    cfg_path = os.path.join(folder, "adapter_config.json")
    try:
        cfg = validate_adapter_config(read_json_object(cfg_path), cfg_path)
    except InputError as e:
        raise AdapterError(str(e)) from None
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{cfg_path}: peft_type {cfg.get('peft_type')!r} is not LORA")
    try:   # every field honoured (layers_to_transform, target_modules, rsLoRA) or refused
        fields = PeftFields(cfg, cfg_path)
    except ValueError as e:
        raise AdapterError(str(e)) from None
    ad = Adapters(cfg["r"], cfg["lora_alpha"], folder, {"base": cfg.get(
        "base_model_name_or_path")})
    ad.scale = fields.scale(ad.r, ad.alpha)
    st = SafetensorsFile(os.path.join(folder, "adapter_model.safetensors"))
    pairs: Dict[Tuple[int, str], Dict[str, np.ndarray]] = {}
    for n in st.tensors:
        m = _PEFT_KEY.match(n)
        if not m or m[2].rsplit(".", 1)[-1] not in HF_TO_MODULE:
            raise AdapterError(f"{folder}: adapter tensor {n!r} is not a LoRA weight of "
                               f"q/k/v/o_proj, gate/up/down_proj or latent attention's "
                               f"q_a/q_b/kv_a_proj_with_mqa/kv_b_proj")
        try:
            fields.check_module(int(m[1]), m[2])
        except ValueError as e:
            raise AdapterError(str(e)) from None
        pairs.setdefault((int(m[1]), m[2]), {})[m[3]] = st.get(n)
    for key, p in pairs.items():
        if set(p) != {"A", "B"}:
            raise AdapterError(f"{folder}: layer {key[0]} {key[1]} lacks lora_A or lora_B")
        ad.per_hf[key] = check_pair(ad, f"layer {key[0]} {key[1]}", p["A"], p["B"])
    return ad


def read_adapters(path: str) -> Adapters:
    """A PEFT folder, an ms-llm ``iter_*`` checkpoint, or a save_dir (its newest one)."""
    if os.path.isfile(os.path.join(path, "adapter_config.json")):
        return read_peft_adapters(path)
    from ms_llm.checkpoint.native.discovery import find_latest_complete
    if not os.path.basename(os.path.normpath(path)).startswith("iter_"):
        latest = find_latest_complete(path) if os.path.isdir(path) else None
        if latest is None:
            raise AdapterError(f"{path}: neither a PEFT adapter folder (adapter_config.json) "
                               f"nor an ms-llm LoRA checkpoint")
        path = latest
    return read_checkpoint_adapters(path)


# ------------------------------------------------------------------------------ merging
class MergedSource:
    """A converter source (``HFSource`` / ``MegatronSource``) whose layers carry the adapters'
    deltas; everything else passes through unchanged."""

    def __init__(self, src, adapters: Adapters):
        self.src, self.adapters = src, adapters
        self.spec = src.spec
        n = self.spec.num_layers
        bad = [i for i in adapters.layers() if i >= n]
        if bad:
            raise AdapterError(f"{adapters.where}: adapters for layer {bad[0]}, the base has "
                               f"{n} layers (a different base?)")

    def __getattr__(self, name):
        return getattr(self.src, name)

    def check(self) -> None:
        self.adapters.check_all_applied()
        inner = getattr(self.src, "check", None)
        if inner is not None:
            inner()

    def layer(self, i: int) -> Dict:
        full = self.src.layer(i)
        for key, delta in self.adapters.deltas(self.spec, i).items():
            w = full.get(key)
            if w is None or tuple(w.shape) != delta.shape:
                raise AdapterError(f"{self.adapters.where}: layer {i} {key}: adapter delta "
                                   f"{list(delta.shape)} does not fit the base weight "
                                   f"{None if w is None else list(w.shape)}")
            with np.errstate(over="ignore"):   # an overflow is refused just below
                merged = (np.asarray(w, np.float64) + delta).astype(w.dtype)
            if not np.isfinite(np.asarray(merged, np.float32)).all():
                raise AdapterError(f"{self.adapters.where}: layer {i} {key}: the merged weight "
                                   f"overflows {w.dtype} (lora_alpha "
                                   f"{self.adapters.alpha:g} too large?)")
            full[key] = merged
        for (li, key), value in self.adapters.buffers.items():
            if li != i:
                continue
            w = full.get(key)
            if w is None or tuple(w.shape) != tuple(value.shape):
                raise AdapterError(f"{self.adapters.where}: layer {i} {key}: trained buffer "
                                   f"{list(value.shape)} does not fit the base's "
                                   f"{None if w is None else list(w.shape)}")
            full[key] = np.asarray(value).astype(w.dtype)
            self.adapters.applied.add((li, key))
        return full


def merged_source(src, opts, load_dir: str):
    """``ms-llm convert --lora-load DIR``: ``src`` with the adapters of DIR merged in. MindSpeed's
    ``--lora-r`` / ``--lora-alpha`` / ``--lora-target-modules`` are checked against what the
    adapters record; an ms-llm checkpoint's base fingerprint must match ``load_dir``."""
    ad = read_adapters(opts.lora_load)
    for flag, given, have in (("--lora-r", opts.lora_r, ad.r),
                              ("--lora-alpha", opts.lora_alpha, ad.alpha)):
        if given is not None and float(given) != float(have):
            raise AdapterError(f"{flag} {given}: the adapters in {opts.lora_load} have {have}")
    if opts.lora_target_modules:
        have = sorted({m.rsplit(".", 1)[-1] for _, m in ad.fused} |
                      {HF_TO_MODULE[h.rsplit(".", 1)[-1]].rsplit(".", 1)[-1]
                       for _, h in ad.per_hf})
        # MindSpeed's name for latent attention's fused down-projections (lora.base.ALIASES)
        folded = sorted({next((k for k, v in ALIASES.items() if m in v), m) for m in have})
        if sorted(set(opts.lora_target_modules)) not in (have, folded):
            raise AdapterError(f"--lora-target-modules {' '.join(opts.lora_target_modules)}: "
                               f"the adapters in {opts.lora_load} are on {' '.join(have)}")
    if ad.state.get("base_sha256"):
        check_base(ad.state, load_dir, ad.where)
    elif getattr(ad, "checkpoint_state", None) is not None:
        # an ms-llm checkpoint always records its base's fingerprint: one without it was
        # edited, and merging it into an unchecked base could give a different model silently
        raise AdapterError(f"{ad.where}: its lora state records no base fingerprint "
                           f"(base_sha256), so {load_dir} cannot be checked as its base")
    return MergedSource(src, ad)
