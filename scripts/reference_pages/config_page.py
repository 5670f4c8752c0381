"""docs/reference/config.md: every key of the run schema (``ms_llm.config.RunConfig``'s
sections), with its type and default from the dataclasses, its allowed values as ``ms-llm
train --help`` prints them (the schema's value rules), and its description from the schema's
comments."""
import dataclasses
import re
import typing
from typing import Any, Dict, List, Tuple

from .capture import printed
from .markdown import code, page, table
from .schema_source import class_doc, field_notes

INTRO = """Every key of the run config, by section. Set a key in a YAML file
(`section: {key: value}`) or on the command line (`--section.key VALUE`, which wins);
lists are comma-separated on the command line and `null` means none. `ms-llm train --help`
prints the same keys with their types, defaults and allowed values. Unknown keys, wrong types,
values outside the allowed ones and bad combinations are refused before a run starts, in one
line naming the key and where it was set."""


def sections() -> List[Tuple[str, type]]:
    """(section name, its dataclass) in the schema's order: the fields of ``RunConfig`` whose
    type is a dataclass."""
    from ms_llm.config import RunConfig
    hints = typing.get_type_hints(RunConfig)
    return [(f.name, hints[f.name]) for f in dataclasses.fields(RunConfig)
            if dataclasses.is_dataclass(hints[f.name])]


def keys() -> List[str]:
    """Every ``section.key`` of the schema (``model.family`` included)."""
    out = []
    for name, cls in sections():
        if name == "model":
            out.append("model.family")
        out += [f"{name}.{f.name}" for f in dataclasses.fields(cls)]
    return out


def help_rules() -> Dict[str, str]:
    """``section.key`` -> its allowed values, as ``ms-llm train --help`` prints them."""
    from ms_llm.cli import main
    rules, section = {}, None
    for line in printed(main, ["train", "--help"]).splitlines():
        header = re.match(r"^([a-z_]+):", line)
        if header:
            section = header.group(1)
            continue
        row = re.match(r"^  ([a-z_0-9]+)\s.*?(?:  \[(.*)\])?$", line)
        if section and row and row.group(2):
            rules[f"{section}.{row.group(1)}"] = row.group(2)
    return rules


def _restates(note: str, rule: str) -> bool:
    """A comment that only lists the allowed values (``cosine | linear | ...``)."""
    choices = rule.partition("one of ")[2]
    return bool(choices) and sorted(c.strip() for c in note.split("|")) == \
        sorted(c.strip() for c in choices.split(","))


def type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union:
        inner = [a for a in args if a is not type(None)]
        return " or ".join(type_name(a) for a in inner) + " or null"
    if origin in (list, typing.List):
        return f"list of {type_name(args[0])}"
    if origin in (dict, typing.Dict):
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def value_text(value: Any) -> str:
    """A default as it is written in YAML."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(value_text(v) for v in value) + "]"
    return str(value)


def default_text(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return value_text(f.default)
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return value_text(f.default_factory())  # type: ignore[misc]
    return "(required)"


def _section_block(name: str, cls: type, rules: Dict[str, str], flags: Dict[str, str]) -> str:
    hints = typing.get_type_hints(cls)
    notes = field_notes(cls)
    rows = []
    if name == "model":
        rows.append([code("model.family"), "str or null", code("null"),
                     rules.get("model.family", ""), code(flags.get("model.family", "")),
                     "the model family: its architecture defaults (the keys below override "
                     "them)"])
    for f in dataclasses.fields(cls):
        key = f"{name}.{f.name}"
        rule, note = rules.get(key, ""), notes.get(f.name, "")
        rows.append([code(key), type_name(hints[f.name]), code(default_text(f)), rule,
                     code(flags.get(key, "")), "" if _restates(note, rule) else note])
    doc = class_doc(cls)
    return "\n\n".join([f"## {name}"] + ([doc] if doc else []) + [
        table(["key", "type", "default", "allowed", "Megatron flag", "description"], rows)])


def render() -> str:
    from ms_llm.mindspeed.flags import FLAG_OF
    rules = help_rules()
    found = sections()
    contents = " · ".join(f"[{name}](#{name})" for name, _ in found)
    blocks = [_section_block(name, cls, rules, FLAG_OF) for name, cls in found]
    return page("Configuration reference", INTRO, "Sections: " + contents, *blocks)
