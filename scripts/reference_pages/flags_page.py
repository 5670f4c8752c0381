"""docs/reference/mindspeed_flags.md: the Megatron / MindSpeed-LLM flag glossary, rendered from
``ms_llm.mindspeed.flag_table``: the config key each flag sets, or that it is a no-op and why,
or that it is refused and why, or what a flag read together with others sets."""
from collections import Counter
from typing import Any, List, Tuple

from .config_page import value_text
from .markdown import code, page, table

INTRO = """`pretrain_gpt.py` and `posttrain_gpt.py` (at the repository root, run under msrun) take a
MindSpeed-LLM example script's Megatron flags unchanged. Each flag below is **mapped** to a
run-config key ([config.md](config.md)), **derived** (its meaning depends on other flags),
accepted as a **no-op** (printed with its reason at start), or **refused** (the job stops
before training with one line naming the flag). A flag not listed here is refused, naming it.
`--print-config` prints the YAML config a command line becomes, without running it."""

TAKES = {0: "switch", 1: "value", 2: "2 values", "+": "values"}


def describe(entry: Any) -> Tuple[str, str]:
    """(kind, what the flag becomes) of one table entry."""
    from ms_llm.mindspeed.flag_table import Map, Noop, Post, Refuse
    if isinstance(entry, Map):
        if entry.nargs == 0:
            return "mapped", f"{code(entry.key)} = {code(value_text(entry.const))}"
        doc = (entry.convert.__doc__ or "").strip() if entry.convert else ""
        return "mapped", code(entry.key) + (f" ({doc})" if doc else "")
    if isinstance(entry, Noop):
        allowed = f" (accepted values: {', '.join(entry.allowed)})" if entry.allowed else ""
        return "no-op", entry.reason + allowed
    if isinstance(entry, Refuse):
        return "refused", entry.reason
    if isinstance(entry, Post):
        return "derived", entry.means
    raise TypeError(f"unknown flag table entry {entry!r}")


def rows() -> List[List[str]]:
    from ms_llm.mindspeed.flag_table import TABLE
    out = []
    for flag in sorted(TABLE):
        kind, becomes = describe(TABLE[flag])
        out.append([code(flag), TAKES[TABLE[flag].nargs], kind, becomes])
    return out


def render() -> str:
    from ms_llm.mindspeed.flag_table import MEGATRON_DEFAULTS
    flags = rows()
    counts = Counter(row[2] for row in flags)
    summary = (f"{len(flags)} flags: " + ", ".join(f"{counts[k]} {k}" for k in
                                                   ("mapped", "derived", "no-op", "refused")) + ".")
    defaults = table(["key", "value when its flag is left out"],
                     [[code(k), code(value_text(v))] for k, v in sorted(MEGATRON_DEFAULTS.items())])
    return page("Megatron / MindSpeed-LLM flag glossary", INTRO, summary,
                table(["flag", "takes", "kind", "becomes"], flags),
                "## Megatron's defaults\n\nA script means here what it means to Megatron: where "
                "a script leaves a flag out and Megatron's default differs from ms-llm's, the "
                "key gets Megatron's value.", defaults)
