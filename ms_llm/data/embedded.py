"""Default training data that needs no download: built locally from the Python stdlib's docs.

Why: the default config must train on real text out of the box, offline, with a license-clean
source. The running interpreter's standard library is always present and PSF-licensed, so we
harvest its docstrings (parsed with ``ast``, never imported), the language-reference help
topics in ``pydoc_data``, and the ``__doc__`` strings of the compiled-in builtin modules, then
train a small sentencepiece BPE tokenizer on them. Everything is deterministic for a given
interpreter, cached under ``$MS_LLM_CACHE`` (or ``~/.cache/ms_llm``), written via temp file +
``os.replace`` and built under an ``fcntl`` lock so concurrent workers share one build.
"""
from __future__ import annotations

import ast
import contextlib
import fcntl
import importlib
import inspect
import io
import json
import os
import sys
import sysconfig
import time
from typing import Iterator

from ms_llm.compat.environment import variable

CORPUS_VERSION = "v1"
MIN_DOC_CHARS = 40
# Directories under the stdlib dir that are not stdlib (third-party) or hold no source.
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "lib-dynload"}
_EXTRA_TOP_LEVEL = ("test",)  # PSF-licensed test suite; not in sys.stdlib_module_names.


def default_cache_root() -> str:
    """Root cache folder: ``$MS_LLM_CACHE`` or ``~/.cache/ms_llm``."""
    return variable("MS_LLM_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "ms_llm")


@contextlib.contextmanager
def file_lock(path: str) -> Iterator[None]:
    """Exclusive advisory lock on ``path`` (created if needed); serialises builds across processes."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Write to a temp name then ``os.replace`` so readers never see a half-written file."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def _top_level_names() -> set:
    names = getattr(sys, "stdlib_module_names", None)  # Python >= 3.10
    if names is None:  # 3.9 fallback: everything in the stdlib dir counts.
        return set()
    return set(names) | set(_EXTRA_TOP_LEVEL)


def stdlib_source_files() -> list:
    """Sorted relative paths of the pure-Python stdlib ``.py`` files (fixed order -> same bytes)."""
    root = _stdlib_dir()
    allowed = _top_level_names()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("config-"))
        rel_dir = os.path.relpath(dirpath, root)
        if rel_dir != "." and allowed and rel_dir.split(os.sep)[0] not in allowed:
            dirnames[:] = []
            continue
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            if rel_dir == "." and allowed and name[:-3] not in allowed:
                continue
            out.append(os.path.normpath(os.path.join(rel_dir, name)))
    return sorted(out)


def _docstrings_from_source(path: str) -> Iterator[str]:
    try:
        with open(path, "rb") as fh:
            tree = ast.parse(fh.read(), filename=path)
    except (SyntaxError, ValueError, UnicodeDecodeError, OSError, RecursionError):
        return  # Deliberately broken test fixtures etc.
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc:
                yield doc


def _pydoc_topics(root: str) -> Iterator[str]:
    """Language-reference help topics, read from the ``topics = {...}`` literal without importing."""
    path = os.path.join(root, "pydoc_data", "topics.py")
    try:
        with open(path, "rb") as fh:
            tree = ast.parse(fh.read())
    except (OSError, SyntaxError, ValueError):
        return
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            pairs = [
                (k.value, v.value)
                for k, v in zip(node.value.keys, node.value.values)
                if isinstance(k, ast.Constant) and isinstance(v, ast.Constant) and isinstance(v.value, str)
            ]
            for _, text in sorted(pairs):
                yield text.strip()


def _builtin_module_docs() -> Iterator[str]:
    """``__doc__`` of compiled-in modules (already part of the interpreter, so importing is safe)."""
    for mod_name in sorted(sys.builtin_module_names):
        try:
            mod = importlib.import_module(mod_name)
        except Exception:  # pragma: no cover - builtins always import
            continue
        objs = [mod]
        for name in sorted(vars(mod)):
            obj = vars(mod)[name]
            objs.append(obj)
            if isinstance(obj, type):
                objs.extend(vars(obj)[k] for k in sorted(vars(obj)))
        for obj in objs:
            doc = getattr(obj, "__doc__", None)
            if isinstance(doc, str):
                yield inspect.cleandoc(doc)


def iter_corpus_documents() -> Iterator[str]:
    """Deduplicated, deterministic stream of documents for the default corpus."""
    root = _stdlib_dir()
    seen = set()

    def sources() -> Iterator[str]:
        for rel in stdlib_source_files():
            yield from _docstrings_from_source(os.path.join(root, rel))
        yield from _pydoc_topics(root)
        yield from _builtin_module_docs()

    for doc in sources():
        doc = doc.strip()
        if len(doc) < MIN_DOC_CHARS or len(doc.split()) < 4 or doc in seen:
            continue
        seen.add(doc)
        yield doc


def _train_sentencepiece(docs: list, vocab_size: int) -> bytes:
    """Train a Llama-style BPE model (byte fallback, identity normalisation) and return its bytes."""
    import sentencepiece as spm

    def lines() -> Iterator[str]:
        for doc in docs:
            for line in doc.split("\n"):
                if line.strip():
                    yield line

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=lines(),
        model_writer=buf,
        model_type="bpe",
        vocab_size=vocab_size,
        character_coverage=0.9995,
        byte_fallback=True,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=3,
        input_sentence_size=400_000,
        shuffle_input_sentence=False,
        num_threads=1,
        minloglevel=2,
    )
    return buf.getvalue()


def build_corpus_and_tokenizer(out_dir: str, vocab_size: int) -> tuple:
    """Build ``corpus.jsonl`` + ``tokenizer.model`` in ``out_dir`` (caller holds the lock)."""
    os.makedirs(out_dir, exist_ok=True)
    for name in os.listdir(out_dir):  # temp files of an interrupted earlier build
        if ".tmp." in name:
            os.remove(os.path.join(out_dir, name))
    t0 = time.time()
    docs = list(iter_corpus_documents())
    corpus = "".join(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in docs).encode("utf-8")
    corpus_path = os.path.join(out_dir, "corpus.jsonl")
    model_path = os.path.join(out_dir, "tokenizer.model")
    atomic_write_bytes(corpus_path, corpus)
    t1 = time.time()
    atomic_write_bytes(model_path, _train_sentencepiece(docs, vocab_size))
    meta = {
        "version": CORPUS_VERSION,
        "python": sys.version.split()[0],
        "documents": len(docs),
        "corpus_bytes": len(corpus),
        "text_chars": sum(len(d) for d in docs),
        "vocab_size": vocab_size,
        "corpus_seconds": round(t1 - t0, 2),
        "tokenizer_seconds": round(time.time() - t1, 2),
    }
    atomic_write_bytes(os.path.join(out_dir, "meta.json"), json.dumps(meta, indent=1).encode())
    return corpus_path, model_path


def ensure_default_corpus(cache_dir: str | None = None, vocab_size: int = 4096) -> tuple[str, str]:
    """Return ``(corpus_jsonl_path, tokenizer_model_path)``, building them on first use.

    The folder name carries the corpus version, interpreter version and vocab size, so a
    changed recipe or interpreter never reuses stale files. Completed files only ever appear
    via ``os.replace``; ``meta.json`` is written last, so its presence marks a finished build.
    """
    tag = f"default_corpus_{CORPUS_VERSION}_py{sys.version_info[0]}{sys.version_info[1]}_v{vocab_size}"
    out_dir = os.path.join(cache_dir or default_cache_root(), tag)
    corpus_path = os.path.join(out_dir, "corpus.jsonl")
    model_path = os.path.join(out_dir, "tokenizer.model")

    def done() -> bool:
        return os.path.isfile(corpus_path) and os.path.isfile(model_path) and os.path.isfile(
            os.path.join(out_dir, "meta.json")
        )

    if done():
        return corpus_path, model_path
    with file_lock(out_dir + ".lock"):
        if not done():  # The lock winner builds; losers find the finished files here.
            build_corpus_and_tokenizer(out_dir, vocab_size)
    return corpus_path, model_path
