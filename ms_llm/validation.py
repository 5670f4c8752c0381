"""One validation layer for inputs that come from outside the suite: the run YAML, an HF
``config.json``, PEFT's ``adapter_config.json``, and the generation flags.

Why one place: these files are written by other tools or by hand, so a key given twice, a string
where a number belongs (``"num_hidden_layers": "4"``), a fraction (``hidden_size: 64.5``) or an
absurd size (``num_hidden_layers: 1e9``, which would allocate until memory runs out) must be
refused before anything is built, in one line naming the file, the key and the value, instead of
being copied through or ending in a traceback. Everything here raises ``InputError`` (a
``ValueError``, so every command's existing one-line handler reports it).
"""
from __future__ import annotations

import json
import math
from typing import Any, Callable, Dict, Optional, Tuple

import yaml

__all__ = ["InputError", "yaml_load_unique", "read_json_object", "validate_hf_config",
           "validate_adapter_config", "check_generation_flags", "check_int", "check_float",
           "HF_INT_BOUNDS", "RUN_SIZE_BOUNDS", "size_bound_problem",
           "writable_folder_problem", "check_utf8",
           "Rule", "value_rule", "greater_than", "at_least", "within", "one_of"]


class InputError(ValueError):
    """An external input that is malformed or out of range (message: file, key, value)."""


# ----------------------------------------------------------------------------- YAML
class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a mapping key given twice (YAML 1.2 says keys are
    unique; PyYAML silently keeps the last one)."""


def _construct_unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode,
                              deep: bool = False) -> dict:
    seen: Dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            hash(key)
        except TypeError:
            raise yaml.constructor.ConstructorError(
                None, None, f"unhashable key {key!r}", key_node.start_mark) from None
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} given twice (lines {seen[key] + 1} and "
                f"{key_node.start_mark.line + 1})", key_node.start_mark)
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
                                 _construct_unique_mapping)


def yaml_load_unique(stream) -> Any:
    """``yaml.safe_load`` that raises ``yaml.YAMLError`` on a duplicate key or section."""
    return yaml.load(stream, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader subclass)


# ----------------------------------------------------------------------------- JSON
def _no_duplicates(path: str):
    def hook(pairs):
        out = {}
        for k, v in pairs:
            if k in out:
                raise InputError(f"{path}: key {k!r} given twice")
            out[k] = v
        return out
    return hook


def read_json_object(path: str) -> dict:
    """The JSON object in ``path``: invalid JSON, a duplicate key, NaN/Infinity literals or a
    top level that is not an object are one-line ``InputError``s naming the file."""
    def no_constant(name):
        raise InputError(f"{path}: {name} is not valid JSON")
    try:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8")
        obj = json.loads(text, object_pairs_hook=_no_duplicates(path),
                         parse_constant=no_constant)
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise InputError(f"{path}: invalid JSON ({e})") from None
    except RecursionError:
        raise InputError(f"{path}: JSON nested too deeply") from None
    if not isinstance(obj, dict):
        raise InputError(f"{path}: expected a JSON object at the top level, got "
                         f"{type(obj).__name__}")
    return obj


# ----------------------------------------------------------------------------- checks
def check_int(where: str, key: str, value: Any, lo: int, hi: int) -> int:
    """An int (not a bool, float or string) in ``[lo, hi]``, else ``InputError``."""
    at = f"{where}: " if where else ""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"{at}{key} must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise InputError(f"{at}{key} = {value} is outside [{lo}, {hi}]")
    return value


def check_float(where: str, key: str, value: Any, lo: float = -math.inf,
                hi: float = math.inf, open_lo: bool = False) -> float:
    """A finite number in ``[lo, hi]`` (``(lo, hi]`` with ``open_lo``), else ``InputError``."""
    at = f"{where}: " if where else ""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(f"{at}{key} must be a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v) or v < lo or v > hi or (open_lo and v == lo):
        lo_s = "(" if open_lo else "["
        raise InputError(f"{at}{key} = {value} is outside {lo_s}{lo}, {hi}]")
    return v


# Upper bounds far above any released model (Llama-3.1-405B: 126 layers, hidden 16384, FFN
# 53248; DeepSeek-V3: 256 experts; Gemma: 262144 tokens; 10M-token contexts), low enough that
# no allocation is attempted for a typo such as 1e9.
HF_INT_BOUNDS: Dict[str, Tuple[int, int]] = {
    "num_hidden_layers": (1, 4096), "hidden_size": (1, 1 << 17),
    "intermediate_size": (1, 1 << 20), "num_attention_heads": (1, 4096),
    "num_key_value_heads": (1, 4096), "head_dim": (1, 1 << 14), "vocab_size": (1, 1 << 23),
    "max_position_embeddings": (1, 1 << 27), "num_experts": (0, 1 << 14),
    "n_routed_experts": (0, 1 << 14), "moe_intermediate_size": (1, 1 << 20),
    "num_experts_per_tok": (0, 1 << 14), "decoder_sparse_step": (1, 4096),
    "n_shared_experts": (0, 1 << 10), "first_k_dense_replace": (0, 4096),
    "num_nextn_predict_layers": (0, 64), "q_lora_rank": (1, 1 << 17),
    "kv_lora_rank": (1, 1 << 17), "qk_nope_head_dim": (0, 1 << 14),
    "qk_rope_head_dim": (0, 1 << 14), "v_head_dim": (1, 1 << 14), "n_group": (1, 1 << 14),
    "topk_group": (1, 1 << 14),
}
HF_FLOAT_KEYS = {"rms_norm_eps": (0.0, 1.0, True), "rope_theta": (0.0, math.inf, True),
                 "routed_scaling_factor": (0.0, math.inf, True),
                 "router_aux_loss_coef": (0.0, math.inf, False)}


def validate_hf_config(cfg: Any, path: str) -> dict:
    """Types and ranges of the architecture fields of an HF ``config.json`` (absent or null
    fields are left to the family's rules). Returns ``cfg``."""
    if not isinstance(cfg, dict):
        raise InputError(f"{path}: expected a JSON object, got {type(cfg).__name__}")
    for key, (lo, hi) in HF_INT_BOUNDS.items():
        if cfg.get(key) is not None:
            check_int(path, key, cfg[key], lo, hi)
    for key, (lo, hi, open_lo) in HF_FLOAT_KEYS.items():
        if cfg.get(key) is not None:
            check_float(path, key, cfg[key], lo, hi, open_lo)
    for key in ("tie_word_embeddings", "attention_bias", "norm_topk_prob"):
        if key in cfg and cfg[key] is not None and not isinstance(cfg[key], bool):
            raise InputError(f"{path}: {key} must be true or false, got {cfg[key]!r}")
    if "model_type" in cfg and not isinstance(cfg["model_type"], str):
        raise InputError(f"{path}: model_type must be a string, got {cfg['model_type']!r}")
    mlp_only = cfg.get("mlp_only_layers")
    if mlp_only is not None and not (isinstance(mlp_only, list) and all(
            isinstance(i, int) and not isinstance(i, bool) for i in mlp_only)):
        raise InputError(f"{path}: mlp_only_layers must be a list of layer indices")
    return cfg


def validate_adapter_config(cfg: Any, path: str) -> dict:
    """PEFT ``adapter_config.json``: ``r`` a positive integer, ``lora_alpha`` a finite number,
    ``target_modules`` a string or list of strings. Returns ``cfg``."""
    if not isinstance(cfg, dict):
        raise InputError(f"{path}: expected a JSON object, got {type(cfg).__name__}")
    for key in ("r", "lora_alpha"):
        if key not in cfg:
            raise InputError(f"{path}: missing key {key!r}")
    check_int(path, "r", cfg["r"], 1, 1 << 16)
    check_float(path, "lora_alpha", cfg["lora_alpha"])
    tm = cfg.get("target_modules")
    if tm is not None and not (isinstance(tm, str) or (
            isinstance(tm, list) and all(isinstance(m, str) for m in tm))):
        raise InputError(f"{path}: target_modules must be a string or a list of strings, "
                         f"got {tm!r}")
    return cfg


# Run-config keys that size an allocation, with the same far-above-any-model bounds: a typo
# (``num_layers: 1000000000``) is refused at load, not discovered when memory runs out.
RUN_SIZE_BOUNDS: Dict[str, int] = {
    "model.num_layers": 4096, "model.hidden_size": 1 << 17, "model.ffn_hidden_size": 1 << 20,
    "model.num_attention_heads": 4096, "model.num_query_groups": 4096,
    "model.kv_channels": 1 << 14, "model.padded_vocab_size": 1 << 23,
    "model.max_position_embeddings": 1 << 27, "model.num_moe_experts": 1 << 14,
    "model.moe_ffn_hidden_size": 1 << 20, "model.q_lora_rank": 1 << 17,
    "model.kv_lora_rank": 1 << 17, "model.mtp_num_layers": 64, "data.seq_length": 1 << 27,
    "training.micro_batch_size": 1 << 20, "training.global_batch_size": 1 << 30,
}


def size_bound_problem(key: str, value: Any) -> Optional[str]:
    """Why ``value`` of run-config ``key`` (``section.key``) is too large to allocate, or None."""
    hi = RUN_SIZE_BOUNDS.get(key)
    if hi is None or not isinstance(value, int) or isinstance(value, bool) or value <= hi:
        return None
    return f"{key} = {value} is above the bound {hi} (a typo? nothing is allocated for it)"


def check_generation_flags(max_new_tokens: Optional[int] = None,
                           temperature: Optional[float] = None,
                           top_k: Optional[int] = None, top_p: Optional[float] = None,
                           max_context: Optional[int] = None,
                           seed: Optional[int] = None) -> None:
    """Ranges of the sampling flags (one line naming the flag): ``--max-new-tokens`` >= 1,
    ``--temperature`` >= 0, ``--top-k`` >= 0, ``--top-p`` in (0, 1], ``--max-context`` >= 1,
    ``--seed`` in [0, 2**32). The caller prefixes its command name."""
    checks = [
        (max_new_tokens, lambda v: check_int("", "--max-new-tokens", v, 1, 1 << 24)),
        (temperature, lambda v: check_float("", "--temperature", v, 0.0)),
        (top_k, lambda v: check_int("", "--top-k", v, 0, 1 << 24)),
        (top_p, lambda v: check_float("", "--top-p", v, 0.0, 1.0, open_lo=True)),
        (max_context, lambda v: check_int("", "--max-context", v, 1, 1 << 27)),
        (seed, lambda v: check_int("", "--seed", v, 0, (1 << 32) - 1)),
    ]
    for value, check in checks:
        if value is not None:
            check(value)



def writable_folder_problem(path: str) -> Optional[str]:
    """Why a run cannot write into the folder ``path`` (created if missing), or None. Checked
    by writing and removing a probe file, not with ``os.access`` (which says yes to root on a
    read-only mount), so a folder that cannot be written is found before the first step
    rather than at the first save after training."""
    import os
    import tempfile
    try:
        os.makedirs(path, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".ms_llm_write_probe_", dir=path)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        return f"{path}: cannot write there ({e.strerror or type(e).__name__})"
    return None


def check_utf8(where: str, text: str) -> str:
    """``text`` if it is valid UTF-8. Python keeps undecodable bytes of the command line as lone
    surrogates (``surrogateescape``), which fail only later, deep in the tokenizer."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = ord(text[e.start])
        byte = f"byte 0x{bad - 0xDC00:02x}" if 0xDC80 <= bad <= 0xDCFF else f"U+{bad:04X}"
        raise InputError(f"{where} is not valid UTF-8 ({byte} at character {e.start})") from None
    return text


# ----------------------------------------------------------------------------- value rules
# What one run-config key's value must be (``ms_llm.config.values.RULES``, and the keys a
# registered optimizer owns, ``ms_llm.optim.kinds``): a rule returns None for a good value, else
# what the value must be; ``rule.desc`` is that text for ``ms-llm train --help``.
Rule = Callable[[Any], Optional[str]]


def value_rule(desc: str, ok: Callable[[Any], bool]) -> Rule:
    def rule(value: Any) -> Optional[str]:
        return None if ok(value) else desc
    rule.desc = desc  # type: ignore[attr-defined]  # shown by ``ms-llm train --help``
    return rule


def greater_than(lo: float) -> Rule:
    return value_rule(f"> {lo}", lambda v: v > lo)


def at_least(lo: float) -> Rule:
    return value_rule(f">= {lo}", lambda v: v >= lo)


def within(lo: float, hi: float, hi_open: bool = False) -> Rule:
    close = ")" if hi_open else "]"
    return value_rule(f"in [{lo}, {hi}{close}",
                      lambda v: lo <= v < hi if hi_open else lo <= v <= hi)


def one_of(*choices: str, null: bool = False, case: bool = True) -> Rule:
    desc = ("null or " if null else "") + "one of " + ", ".join(choices)
    if case:
        return value_rule(desc, lambda v: v in choices)
    return value_rule(desc, lambda v: v.lower() in choices)
