"""``ms-llm train --help``: every config section and key with its type, default and allowed
values, generated from the schema and its rules (so it cannot drift from what ``load_config``
accepts)."""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import fields
from typing import Any, List

from ms_llm.config.schema import _SECTIONS, _hints
from ms_llm.config.values import rule_for
from ms_llm.models.config import TransformerConfig


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union:
        inner = next(a for a in args if a is not type(None))
        return f"{_type_name(inner)} or null"
    if origin in (list, List):
        return f"list of {_type_name(args[0])}"
    return getattr(tp, "__name__", str(tp))


def _default_text(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = f.default_factory()  # type: ignore[misc]
    else:
        return "(required)"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return ",".join(map(str, value)) or "(empty)"
    return str(value)


def _key_lines(section: str, cls) -> List[str]:
    hints = _hints(cls)
    lines = []
    for f in fields(cls):
        rule = rule_for(f"{section}.{f.name}")
        note = f"  [{rule.desc}]" if rule is not None else ""
        lines.append(f"  {f.name:<38} {_type_name(hints[f.name]):<20} "
                     f"{_default_text(f)}{note}")
    return lines


def schema_help() -> str:
    """Every config section and key with its type, default and allowed values, generated from
    the dataclasses and the value rules (``rule_for``) (so it cannot drift from what load_config accepts)."""
    from ms_llm.models.registry import families
    names = ", ".join(f.name for f in families())
    lines = ["model:  (family sets architecture defaults; the keys below override them)",
             f"  {'family':<38} {'str or null':<20} null  [one of {names}]"]
    lines += _key_lines("model", TransformerConfig)
    for section, cls in _SECTIONS.items():
        lines += ["", f"{section}:"] + _key_lines(section, cls)
    return "\n".join(lines)
