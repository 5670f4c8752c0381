"""The built-in model families, one folder each (``llama/``, ``qwen25/``, ``qwen3/``,
``qwen3_moe/``, ``deepseek_v3/``, ``glm45/``, ``qwen3_next/``, ``qwen35/``, ``qwen35_moe/``): its
``hf.py`` maps the HF ``config.json``, its ``spec.py`` holds the ``FamilySpec``, its ``layouts.py``
the checkpoint layer kinds only it has, and its ``__init__`` registers them with
``ms_llm.models.registry`` (and ``ms_llm.models.layouts``). The plain modules here (``common``,
``deepseek_moe``) are what several families share.

The names below are views of the registry for the config schema and callers that want a plain
function: ``family_defaults(name)`` (a run's ``model.family`` switches) and ``config_from_hf``
(the one ``config.json`` -> TransformerConfig translation)."""
from __future__ import annotations

from typing import Mapping

from ..config import TransformerConfig
from ..registry import families, get_family, names, parse_hf_config


def family_defaults(name: str) -> dict:
    """Architecture switches of family ``name`` (or an alias); sizes come from the YAML config
    or the HF config.json."""
    return dict(get_family(name).defaults)


def config_from_hf(hf: Mapping, source: str = "config.json") -> TransformerConfig:
    """Translate a Hugging Face ``config.json`` dict of any registered family."""
    return parse_hf_config(hf, source)[1]


def __getattr__(name: str):
    # Computed on access so families registered later are listed too.
    if name == "FAMILIES":
        return {s.name: dict(s.defaults) for s in families()}
    if name == "ALIASES":
        return {n: f for n, f in names().items() if n != f}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["family_defaults", "config_from_hf", "FAMILIES", "ALIASES"]
