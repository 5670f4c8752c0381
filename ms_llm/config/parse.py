"""Parsing of the run config: YAML files and dotted command-line overrides, layered (the
command line wins), each explicitly set key type-checked and value-checked (``rules``)
so an error names the key and the source that set it. ``schema.load_config`` is the entry."""
from __future__ import annotations

import dataclasses
import os
import re
import typing
from typing import Any, Dict, List, Optional, Sequence

import yaml

from ms_llm.config.values import ConfigError, check_value
from ms_llm.models.config import TransformerConfig
from ms_llm.models.families import family_defaults
from ms_llm.validation import size_bound_problem, yaml_load_unique

COMMAND_LINE = "command line"
MODEL_FIELDS = {f.name for f in dataclasses.fields(TransformerConfig)}


def _coerce(value: Any, tp: Any, key: str, source: str) -> Any:
    """Check ``value`` against the annotation ``tp``; strings from the command line are parsed."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union:  # Optional[X]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        return _coerce(value, next(a for a in args if a is not type(None)), key, source)
    if origin in (list, List):
        if isinstance(value, str):
            value = [v for v in value.split(",") if v]
        if not isinstance(value, list):
            raise ConfigError(f"{source}: key '{key}' must be a list, got {value!r}")
        return [_coerce(v, args[0], key, source) for v in value]
    if tp is bool:
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        if isinstance(value, bool):
            return value
    elif tp in (int, float):      # a YAML int is a fine float; a float is not an int
        if isinstance(value, str):
            try:
                return tp(value)
            except ValueError:
                pass
        elif isinstance(value, (int, float) if tp is float else int) \
                and not isinstance(value, bool):
            return tp(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    else:
        return value
    raise ConfigError(f"{source}: key '{key}' must be {getattr(tp, '__name__', tp)}, "
                      f"got {value!r}")


def _checked(value: Any, tp: Any, key: str, source: str) -> Any:
    """Type, then value: the one gate every explicitly set key passes through."""
    value = _coerce(value, tp, key, source)
    check_value(key, value, source)
    too_big = size_bound_problem(key, value)   # before anything is sized by it
    if too_big:
        raise ConfigError(f"{source}: {too_big}")
    return value


def type_hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _read_yaml(path: str) -> dict:
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: config file not found")
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml_load_unique(f) or {}   # a key or section given twice is refused
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    return data


def parse_overrides(args: Sequence[str], refuse_repeats: bool = True) -> List[tuple]:
    """``--training.max_steps 20`` or ``--training.max_steps=20`` -> [("training.max_steps", "20")].
    A key given twice is refused (as in a YAML file: taking the last silently would hide a typo
    in a long launch line), unless ``refuse_repeats`` is False: a list composed in code (a base
    list and its changes, ``load_config``'s default) lets the last occurrence win."""
    out, i, seen = [], 0, {}
    args = list(args)
    while i < len(args):
        a = args[i]
        if not a.startswith("--") or "." not in a.split("=")[0]:
            raise ConfigError(f"{COMMAND_LINE}: expected --section.key VALUE, got {a!r}")
        if "=" in a:
            k, v = a[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"{COMMAND_LINE}: {a} needs a value")
            k, v = a[2:], args[i + 1]
            i += 2
        if k in seen and refuse_repeats:
            raise ConfigError(f"{COMMAND_LINE}: key '{k}' given twice (--{k} {seen[k]} and "
                              f"--{k} {v}); give it once")
        seen[k] = v
        out.append((k, v))
    return out


def merge_overrides(*parts: Sequence[str]) -> List[str]:
    """One ``--section.key VALUE`` list from several composed in code (a base list and its
    changes), each key once with its last value, in first-seen order: the command line refuses a
    key given twice, so code that builds a launch line (benchmarks, tests) merges first."""
    pairs: Dict[str, str] = {}
    for k, v in parse_overrides([str(a) for part in parts for a in part], refuse_repeats=False):
        pairs.pop(k, None)
        pairs[k] = v
    return [x for k, v in pairs.items() for x in (f"--{k}", v)]


def layer(path: Optional[str], overrides: Sequence[str], sections: Sequence[str],
          refuse_repeats: bool = True) -> Dict[str, Dict[str, tuple]]:
    """section -> key -> (raw value, source); command-line overrides replace YAML values."""
    source = path or "defaults"
    raw = _read_yaml(path) if path else {}
    layered: Dict[str, Dict[str, tuple]] = {s: {} for s in ("model", *sections)}
    for section, values in raw.items():
        if section not in layered:
            raise ConfigError(f"{source}: unknown section '{section}' "
                              f"(expected one of {sorted(layered)})")
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: section '{section}' must be a mapping")
        for k, v in values.items():
            layered[section][k] = (v, source)
    for dotted, v in parse_overrides(overrides, refuse_repeats):
        section, _, k = dotted.partition(".")
        src = f"{COMMAND_LINE} --{dotted}"
        if section not in layered or not k:
            raise ConfigError(f"{src}: unknown key '{dotted}'")
        layered[section][k] = (v, src)
    return layered


def build_section(section: str, cls, values: Dict[str, tuple]):
    hints = type_hints(cls)
    kwargs = {}
    for k, (v, src) in values.items():
        if k not in hints:
            raise ConfigError(f"{src}: unknown key '{section}.{k}'")
        kwargs[k] = _checked(v, hints[k], f"{section}.{k}", src)
    return cls(**kwargs)


def build_model(values: Dict[str, tuple], base: str):
    """(TransformerConfig, family, explicitly set fields): family defaults, then explicit keys."""
    values = dict(values)
    family, family_src = None, base
    if "family" in values:
        v, family_src = values.pop("family")
        family = _checked(v, Optional[str], "model.family", family_src)
    model_kwargs = {}
    if family:
        try:
            model_kwargs.update(family_defaults(family))
        except ValueError as e:
            raise ConfigError(f"{family_src}: {e}") from None
    hints = type_hints(TransformerConfig)
    explicit = {}
    for k, (v, src) in values.items():
        if k not in MODEL_FIELDS:
            raise ConfigError(f"{src}: unknown key 'model.{k}'")
        explicit[k] = model_kwargs[k] = _checked(v, hints[k], f"model.{k}", src)
    try:
        model = TransformerConfig(**model_kwargs)
    except ValueError as e:
        named = _model_keys_named(str(e), values)
        src = next((values[k][1] for k in named if values[k][1].startswith(COMMAND_LINE)),
                   values[named[0]][1] if named else family_src)
        raise ConfigError(f"{src}: {e}") from None
    return model, family, explicit


def _model_keys_named(message: str, values: Dict[str, tuple]) -> List[str]:
    """The explicitly set model keys a TransformerConfig error mentions (to name their source)."""
    return [k for k in values if re.search(rf"\b{re.escape(k)}\b", message)]
