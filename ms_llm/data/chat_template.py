"""Render HF-style Jinja chat templates (``tokenizer_config.json`` ``chat_template``).

Why: Qwen3 / Llama-3 checkpoints define their conversation format only as a Jinja template;
to train SFT data that matches how the model is prompted at inference we must render that same
template, in the same Jinja environment ``transformers`` uses (sandboxed, ``trim_blocks``,
``lstrip_blocks``, ``loopcontrols``, a ``tojson`` that keeps non-ASCII, ``raise_exception``,
``strftime_now``).
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any, Optional, Sequence


class TemplateError(ValueError):
    """Raised by a template's ``raise_exception(...)`` or a template syntax error."""


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Optional[int] = None, separators=None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=8)
def _compile(template: str):
    try:
        from jinja2.exceptions import TemplateSyntaxError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:  # pragma: no cover - jinja2 is a declared dependency
        raise ImportError(f"chat templates need jinja2: {e}") from None
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except TemplateSyntaxError as e:
        raise TemplateError(f"chat_template syntax error at line {e.lineno}: {e.message}") from None


def render_chat_template(template: str, messages: Sequence[dict], add_generation_prompt: bool = False,
                         tools: Optional[list] = None, **context: Any) -> str:
    """Render ``messages`` with ``template``; extra ``context`` (``bos_token``, ``eos_token``,
    ``enable_thinking``...) is passed to the template like HF does."""
    return _compile(template).render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                     tools=tools, **context)
