"""Render HF-style Jinja chat templates (``tokenizer_config.json`` ``chat_template``).

Why: Qwen3 / Llama-3 checkpoints define their conversation format only as a Jinja template;
to train SFT data that matches how the model is prompted at inference we must render that same
template, in the same Jinja environment ``transformers`` uses (sandboxed, ``trim_blocks``,
``lstrip_blocks``, ``loopcontrols``, a ``tojson`` that keeps non-ASCII, ``raise_exception``,
``strftime_now``).

A template comes with a downloaded checkpoint, so rendering it is bounded: at most
``RENDER_MAX_CHARS`` characters of output (also the size bound of a string or list made by
``*``; ``**`` results of more than ``POW_MAX_BITS`` bits are refused, as big-integer
arithmetic cannot be interrupted) and, in the main thread, at most ``RENDER_SECONDS`` seconds
(a SIGALRM timer, which stops even a loop that prints nothing). Either ends in one
``TemplateError`` line instead of a hang.
"""
from __future__ import annotations

import json
import signal
import threading
from contextlib import contextmanager
from datetime import datetime
from functools import lru_cache
from typing import Any, Optional, Sequence


RENDER_SECONDS = 5.0          # real templates render a conversation in milliseconds
RENDER_MAX_CHARS = 1 << 22    # 4 Mi characters: far above any context a model takes
POW_MAX_BITS = 1 << 16


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
    env = _BoundedEnvironment(ImmutableSandboxedEnvironment)(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except TemplateSyntaxError as e:
        raise TemplateError(f"chat_template syntax error at line {e.lineno}: {e.message}") from None


def _size(x) -> int:
    return len(x) if isinstance(x, (str, bytes, list, tuple)) else 0


def _bounded_binop(op: str, left, right):
    """``*`` and ``**`` of the template, refused when the result would be too big to make."""
    if op == "*":
        n, k = (_size(left), right) if _size(left) else (_size(right), left)
        if isinstance(k, int) and n * max(k, 0) > RENDER_MAX_CHARS:
            raise TemplateError(f"chat_template: a sequence of {n} x {k} items exceeds "
                                f"{RENDER_MAX_CHARS} (a runaway template?)")
        return left * right
    if isinstance(left, int) and isinstance(right, int) and right > 0 \
            and left.bit_length() * right > POW_MAX_BITS:
        raise TemplateError(f"chat_template: {left} ** {right} is too large to compute")
    return left ** right


def _BoundedEnvironment(base):
    class Bounded(base):
        intercepted_binops = frozenset(["*", "**"])

        def call_binop(self, context, operator, left, right):
            if operator in ("*", "**"):
                return _bounded_binop(operator, left, right)
            return super().call_binop(context, operator, left, right)
    return Bounded


@contextmanager
def _time_limit(seconds: float):
    """Raise ``TemplateError`` in this (main) thread after ``seconds``; elsewhere no timer
    (signals reach the main thread only), the output bound still holds."""
    if threading.current_thread() is not threading.main_thread() \
            or not hasattr(signal, "setitimer"):
        yield
        return

    def expired(signum, frame):
        raise TemplateError(f"chat_template: rendering took longer than {seconds:g} s "
                            f"(a runaway loop?)")
    old = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@contextmanager
def _as_template_error(jinja_error):
    """A template's own runtime error (undefined name, sandbox refusal) as one line."""
    try:
        yield
    except jinja_error as e:
        raise TemplateError(f"chat_template: {type(e).__name__}: {e}") from None


def render_chat_template(template: str, messages: Sequence[dict], add_generation_prompt: bool = False,
                         tools: Optional[list] = None, **context: Any) -> str:
    """Render ``messages`` with ``template``; extra ``context`` (``bos_token``, ``eos_token``,
    ``enable_thinking``...) is passed to the template like HF does."""
    from jinja2.exceptions import TemplateError as JinjaError
    compiled = _compile(template)
    out, n = [], 0
    with _time_limit(RENDER_SECONDS), _as_template_error(JinjaError):
        for chunk in compiled.generate(messages=list(messages),
                                       add_generation_prompt=add_generation_prompt,
                                       tools=tools, **context):
            n += len(chunk)
            if n > RENDER_MAX_CHARS:
                raise TemplateError(f"chat_template: the rendered text exceeds "
                                    f"{RENDER_MAX_CHARS} characters (a runaway loop?)")
            out.append(chunk)
    return "".join(out)
