"""One tokenizer interface over sentencepiece ``.model`` and HF ``tokenizer.json`` files.

Why: data prep and generation should not care which format a checkpoint ships. Both backends
encode *without* adding BOS/EOS (the data pipeline appends ``eod`` itself, Megatron-style), so
token streams are comparable across formats.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import hashlib
import json
import os
from typing import Any, Iterable, Optional, Sequence

_EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "<|im_end|>", "[SEP]")
_PAD_CANDIDATES = ("<pad>", "<|pad|>", "[PAD]", "<|finetune_right_pad_id|>")


def file_sha256(path: str) -> str:
    """Content hash of a file; used to key token caches to the exact tokenizer."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class Tokenizer(ABC):
    """Common interface. Subclasses set ``path``, ``vocab_size``, ``eod`` and ``pad``.

    ``chat_template`` (Jinja text from ``tokenizer_config.json`` next to the tokenizer file, or
    ``None``) drives ``apply_chat_template``; ``eos_token``/``bos_token`` are the strings the
    template sees.
    """

    path: str
    vocab_size: int
    eod: int
    pad: int
    chat_template: Optional[str] = None
    eos_token: Optional[str] = None
    bos_token: Optional[str] = None
    _template_cfg: dict = {}

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = False,
                            tools: Optional[list] = None, **kwargs: Any) -> str:
        """Render ``messages`` (``[{"role", "content"}, ...]``) with the tokenizer's Jinja template.

        Same environment as HF ``transformers`` (sandboxed, ``trim_blocks``/``lstrip_blocks``,
        ``tojson``, ``raise_exception``, ``strftime_now``) so Qwen3 / Llama-3 templates render
        identically. Returns text; tokenise it with ``encode``.
        """
        if not self.chat_template:
            raise ValueError(f"tokenizer {self.path} has no chat_template (tokenizer_config.json)")
        from .chat_template import render_chat_template

        ctx = dict(self._template_cfg)
        ctx.update(kwargs)
        return render_chat_template(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                                    tools=tools, bos_token=self.bos_token or "", eos_token=self.eos_token or "", **ctx)

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (each backend implements it)."""

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Batch encode; backends override with a faster native path."""
        return [self.encode(t) for t in texts]

    @abstractmethod
    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` (each backend implements it)."""

    @property
    def fingerprint(self) -> str:
        """sha256 of the tokenizer file, for cache keys."""
        if not hasattr(self, "_fingerprint"):
            self._fingerprint = file_sha256(self.path)
        return self._fingerprint

    def __repr__(self) -> str:
        return f"{type(self).__name__}(path={self.path!r}, vocab_size={self.vocab_size}, eod={self.eod}, pad={self.pad})"


class SentencePieceTokenizer(Tokenizer):
    def __init__(self, path: str):
        import sentencepiece as spm

        self.path = path
        try:
            self._sp = spm.SentencePieceProcessor(model_file=path)
        except Exception as e:  # sentencepiece raises OSError/RuntimeError with multi-line text
            raise ValueError(f"cannot read sentencepiece model {path}: {str(e).splitlines()[0] if str(e) else e}") from None
        self.vocab_size = int(self._sp.get_piece_size())
        eos = int(self._sp.eos_id())
        if eos < 0:
            raise ValueError(f"sentencepiece model {path} defines no EOS id")
        self.eod = eos
        pad = int(self._sp.pad_id())
        self.pad = pad if pad >= 0 else eos
        self.eos_token = self._sp.id_to_piece(eos)
        bos = int(self._sp.bos_id())
        self.bos_token = self._sp.id_to_piece(bos) if bos >= 0 else None
        _attach_chat_template(self, _read_tokenizer_config(path))

    def encode(self, text: str) -> list[int]:
        return list(self._sp.encode(text))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(x) for x in self._sp.encode(list(texts))]

    def decode(self, ids: Iterable[int]) -> str:
        return self._sp.decode([int(i) for i in ids])


def _special_from_config(cfg: dict, key: str) -> Optional[str]:
    val = cfg.get(key)
    if isinstance(val, dict):
        val = val.get("content")
    return val if isinstance(val, str) else None


def _read_tokenizer_config(path: str) -> dict:
    """``tokenizer_config.json`` beside the tokenizer file, or ``{}`` when absent/unreadable."""
    cfg_path = os.path.join(os.path.dirname(os.path.abspath(path)), "tokenizer_config.json")
    if not os.path.isfile(cfg_path):
        return {}
    try:
        with open(cfg_path, encoding="utf-8") as fh:
            cfg = json.load(fh)
    except (OSError, ValueError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def _attach_chat_template(tok: Tokenizer, cfg: dict) -> None:
    """Pick the default chat template: a string, or the ``"default"`` entry of a named list."""
    tmpl = cfg.get("chat_template")
    if isinstance(tmpl, list):
        named = {t.get("name"): t.get("template") for t in tmpl if isinstance(t, dict)}
        tmpl = named.get("default")
    tok.chat_template = tmpl if isinstance(tmpl, str) else None
    tok._template_cfg = {}


class HFTokenizer(Tokenizer):
    def __init__(self, path: str):
        from tokenizers import Tokenizer as _HFTok

        self.path = path
        try:
            self._tok = _HFTok.from_file(path)
        except Exception as e:
            raise ValueError(f"cannot read tokenizer.json {path}: {str(e).splitlines()[0] if str(e) else e}") from None
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        cfg = _read_tokenizer_config(path)
        eod = self._lookup(_special_from_config(cfg, "eos_token"), _EOS_CANDIDATES)
        if eod is None:
            raise ValueError(f"tokenizer {path} has no recognisable EOS token (tried {', '.join(_EOS_CANDIDATES)})")
        self.eod = eod
        pad = self._lookup(_special_from_config(cfg, "pad_token"), _PAD_CANDIDATES)
        self.pad = eod if pad is None else pad
        self.eos_token = self._tok.id_to_token(eod)
        self.bos_token = _special_from_config(cfg, "bos_token")
        _attach_chat_template(self, cfg)

    def _lookup(self, preferred: Optional[str], candidates: Sequence[str]) -> Optional[int]:
        for tok in ((preferred,) if preferred else ()) + tuple(candidates):
            tid = self._tok.token_to_id(tok)
            if tid is not None:
                return int(tid)
        return None

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(e.ids) for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def load_tokenizer(path: str) -> Tokenizer:
    """Load a tokenizer from a ``.model``/``tokenizer.json`` file or a folder holding one.

    A folder is searched for ``tokenizer.json`` first (HF's canonical format), then
    ``tokenizer.model``. Files ending in ``.json`` go to ``tokenizers``; anything else to
    sentencepiece.
    """
    path = os.path.expanduser(str(path))
    if os.path.isdir(path):
        for name in ("tokenizer.json", "tokenizer.model"):
            cand = os.path.join(path, name)
            if os.path.isfile(cand):
                path = cand
                break
        else:
            raise FileNotFoundError(f"no tokenizer.json or tokenizer.model in folder {path}")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"tokenizer file not found: {path}")
    if path.endswith(".json"):
        return HFTokenizer(path)
    return SentencePieceTokenizer(path)


def padded_vocab(vocab_size: int, divisible_by: int) -> int:
    """Megatron's ``--make-vocab-size-divisible-by`` rounding (tp = 1)."""
    return -(-vocab_size // divisible_by) * divisible_by
