"""Reading ``ms-llm preprocess`` inputs as a stream of records: a file or a folder of
``.jsonl`` / ``.json`` (incrementally parsed arrays too) / ``.txt``, one record at a time with its
line number, so memory does not grow with the input and errors name ``file:line``."""
from __future__ import annotations

import json
import os
from typing import Any, Iterator, List, Tuple

SUPPORTED_EXT = (".jsonl", ".json", ".txt")


class PreprocessError(RuntimeError):
    """A one-line, user-facing failure (bad flag, bad input line, missing file)."""


def input_files(path: str) -> List[str]:
    if os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(SUPPORTED_EXT))
        if not files:
            raise PreprocessError(f"--input folder {path} has no {'/'.join(SUPPORTED_EXT)} files")
        return files
    if not os.path.isfile(path):
        raise PreprocessError(f"--input not found: {path}")
    if not path.endswith(SUPPORTED_EXT):
        raise PreprocessError(f"--input {path}: unsupported format (use {', '.join(SUPPORTED_EXT)})")
    return [path]


# ---------------------------------------------------------------- streaming readers

Record = Tuple[int, str, Any]  # (line number, kind "json"|"text"|"obj", payload)


def _is_json_array(path: str) -> bool:
    with open(path, "rb") as fh:
        head = fh.read(4096).lstrip()
    return head.startswith(b"[")


def iter_records(path: str) -> Iterator[Tuple[Record, int]]:
    """Yield ``((line, kind, payload), bytes consumed)``. JSON lines stay undecoded bytes (workers
    parse them); ``.txt`` gives one document per non-empty line (as ``datasets``' text loader)."""
    if path.endswith(".json") and _is_json_array(path):
        yield from _iter_json_array(path)
        return
    kind = "text" if path.endswith(".txt") else "json"
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            if raw.strip():
                yield (lineno, kind, raw), len(raw)
            else:
                yield None, len(raw)


def _iter_json_array(path: str, chunk_chars: int = 1 << 20) -> Iterator[Tuple[Record, int]]:
    """Incremental parse of a top-level JSON array: one element at a time via ``raw_decode``.

    A syntax error cannot be resynchronised inside an array, so it always stops the run.
    """
    dec = json.JSONDecoder()
    with open(path, encoding="utf-8") as fh:
        buf = fh.read(chunk_chars)
        eof = len(buf) < chunk_chars
        pos = buf.index("[") + 1
        line = 1 + buf.count("\n", 0, pos)
        expect_sep = False
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n":
                line += buf[pos] == "\n"
                pos += 1
            if pos >= len(buf) or (not eof and len(buf) - pos < 64):
                if eof and pos >= len(buf):
                    raise PreprocessError(f"{path}:{line}: unterminated JSON array")
                if not eof:
                    more = fh.read(chunk_chars)
                    eof = len(more) < chunk_chars
                    buf = buf[pos:] + more
                    pos = 0
                    continue
            ch = buf[pos]
            if ch == "]":
                return
            if expect_sep:
                if ch != ",":
                    raise PreprocessError(f"{path}:{line}: malformed JSON array (expected ',' or ']')")
                pos += 1
                expect_sep = False
                continue
            try:
                obj, end = dec.raw_decode(buf, pos)
                if end == len(buf) and not eof:
                    raise ValueError("element may continue in the next chunk")
            except ValueError as e:
                if eof:
                    msg = e.msg if isinstance(e, json.JSONDecodeError) else str(e)
                    raise PreprocessError(f"{path}:{line}: malformed JSON ({msg})") from None
                more = fh.read(chunk_chars)
                eof = len(more) < chunk_chars
                buf = buf[pos:] + more
                pos = 0
                continue
            n = len(buf[pos:end].encode("utf-8")) if end - pos < 4096 else end - pos
            yield (line, "obj", obj), n
            line += buf.count("\n", pos, end)
            pos = end
            expect_sep = True
