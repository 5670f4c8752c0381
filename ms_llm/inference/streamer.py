"""``TextStreamer``: print generated text as the tokens arrive (HF's ``TextStreamer`` protocol).

Why it decodes the whole reply every time instead of one token at a time: byte-level BPE and
sentencepiece tokens are not text on their own (a token can be half of a UTF-8 character, a
leading space depends on the neighbour). Decoding everything produced so far and printing only
what is new and settled (HF's rule: whole lines, else up to the last space; never a trailing
partial character) gives exactly the text a single decode at the end gives.
"""
from __future__ import annotations

import sys
from typing import Iterable, List, Optional, TextIO

import numpy as np


class TextStreamer:
    """``put(ids)`` / ``end()`` as ``generate`` calls them; one sequence (batch 1).

    ``skip_prompt``: the first ``put`` (the prompt) is not printed. ``skip_token_ids``: ids left
    out of the text (EOS). ``end()`` prints the rest and a newline."""

    def __init__(self, tokenizer, skip_prompt: bool = True,
                 skip_token_ids: Iterable[int] = (), out: Optional[TextIO] = None):
        self.tokenizer = tokenizer
        self.skip_prompt = skip_prompt
        self.skip = {int(i) for i in skip_token_ids}
        self.out = out
        self.tokens: List[int] = []
        self.printed = 0
        self.text = ""
        self._seen_prompt = False

    def put(self, value) -> None:
        value = np.asarray(value)
        if value.ndim >= 1 and value.shape[0] > 1:
            raise ValueError("TextStreamer streams one sequence (batch size 1)")
        if not self._seen_prompt:
            self._seen_prompt = True
            if self.skip_prompt:
                return
        self.tokens.extend(int(t) for t in value.reshape(-1) if int(t) not in self.skip)
        self.text = self.tokenizer.decode(self.tokens)
        self._emit(self._settled(self.text))

    def end(self) -> None:
        self._emit(len(self.text))
        self._write("\n")

    def _settled(self, text: str) -> int:
        """How much of ``text`` will not change when more tokens come."""
        end = len(text)
        while end and text[end - 1] == "\ufffd":   # an incomplete UTF-8 character
            end -= 1
        if text[:end].endswith("\n") or (end and _is_cjk(text[end - 1])):
            return end
        return max(self.printed, text.rfind(" ", 0, end) + 1)

    def _emit(self, upto: int) -> None:
        if upto > self.printed:
            self._write(self.text[self.printed:upto])
            self.printed = upto

    def _write(self, s: str) -> None:
        out = self.out or sys.stdout
        out.write(s)
        out.flush()


def _is_cjk(ch: str) -> bool:
    cp = ord(ch)
    return (0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x20000 <= cp <= 0x2FA1F
            or 0xF900 <= cp <= 0xFAFF or 0x3040 <= cp <= 0x30FF or 0xAC00 <= cp <= 0xD7AF)
