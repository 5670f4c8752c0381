"""Tokenized-corpus cache, Megatron-style packed pretraining samples and a resumable loader.

Why: pretraining wants one long token stream (documents joined by ``eod``) cut into fixed
windows, a shuffled order that is a pure function of ``(seed, consumed_samples)`` so a resumed
run replays exactly the batches it would have seen, and no re-tokenising on every launch.
"""
from __future__ import annotations

import errno
import hashlib
import io
import json
import os
from typing import Iterator, Optional

import numpy as np

from .embedded import atomic_write_bytes, default_cache_root, file_lock
from .tokenizer import Tokenizer

TOKEN_CACHE_VERSION = 1


def read_documents(path: str, text_key: str = "text") -> Iterator[str]:
    """Yield documents from a corpus file.

    * ``.jsonl``/``.json``: one JSON object per line, text under ``text_key``; blank lines are
      skipped; a malformed line raises ``ValueError("<file>:<line>: ...")``.
    * anything else (``.txt``): plain text where a document is a blank-line-separated paragraph
      (internal newlines kept). Paragraphs rather than lines, so multi-line prose/code stays whole.
    Empty documents are dropped.
    """
    if path.endswith((".jsonl", ".json")):
        with open(path, encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: malformed JSON line ({e.msg} at column {e.colno})") from None
                if not isinstance(obj, dict) or not isinstance(obj.get(text_key), str):
                    raise ValueError(f"{path}:{lineno}: expected a JSON object with a string field {text_key!r}")
                if obj[text_key]:
                    yield obj[text_key]
        return
    para: list = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                para.append(line)
            elif para:
                yield "".join(para).rstrip("\n")
                para = []
    if para:
        yield "".join(para).rstrip("\n")


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 halves disk/RAM for vocabularies that fit it; otherwise int32."""
    return np.dtype(np.uint16) if vocab_size < 65536 else np.dtype(np.int32)


def _cache_key(path: str, tokenizer: Tokenizer, text_key: str) -> str:
    st = os.stat(path)
    desc = {
        "v": TOKEN_CACHE_VERSION,
        "corpus": os.path.abspath(path),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "tokenizer": tokenizer.fingerprint,
        "text_key": text_key,
    }
    return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:16]


def _tokenize(path: str, tokenizer: Tokenizer, text_key: str, chunk_docs: int = 512) -> np.ndarray:
    dtype = token_dtype(tokenizer.vocab_size)
    parts, batch = [], []

    def flush() -> None:
        for ids in tokenizer.encode_batch(batch):
            ids.append(tokenizer.eod)
            parts.append(np.asarray(ids, dtype=dtype))
        batch.clear()

    for doc in read_documents(path, text_key):
        batch.append(doc)
        if len(batch) >= chunk_docs:
            flush()
    if batch:
        flush()
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def tokenize_corpus(
    corpus_path: str, tokenizer: Tokenizer, cache_dir: Optional[str] = None, text_key: str = "text"
) -> np.ndarray:
    """Tokenize a corpus (``eod`` after every document) with an on-disk ``.npy`` cache.

    The cache file is ``<corpus name>.<hash>.tokens.npy`` in ``cache_dir`` (default: next to the
    corpus, or ``$MS_LLM_CACHE/tokens`` if that folder is read-only); the hash covers the corpus
    path, size and mtime plus the tokenizer file's sha256, so any change re-tokenizes. The result
    is memory-mapped read-only.
    """
    if not os.path.isfile(corpus_path):
        raise FileNotFoundError(f"corpus file not found: {corpus_path}")
    name = f"{os.path.basename(corpus_path)}.{_cache_key(corpus_path, tokenizer, text_key)}.tokens.npy"
    dirs = [cache_dir] if cache_dir else [os.path.dirname(os.path.abspath(corpus_path)), os.path.join(default_cache_root(), "tokens")]
    for i, d in enumerate(dirs):
        out = os.path.join(d, name)
        if os.path.isfile(out):
            return np.load(out, mmap_mode="r")
        try:
            os.makedirs(d, exist_ok=True)
            with file_lock(out + ".lock"):
                if not os.path.isfile(out):  # another worker may have finished while we waited
                    atomic_write_bytes(out, _npy_bytes(_tokenize(corpus_path, tokenizer, text_key)))
            return np.load(out, mmap_mode="r")
        except OSError as e:  # read-only corpus folder -> fall back to the cache root
            if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS) or i == len(dirs) - 1:
                raise
    raise AssertionError("unreachable")


def _npy_bytes(arr: np.ndarray) -> bytes:
    bio = io.BytesIO()
    np.save(bio, arr, allow_pickle=False)
    return bio.getvalue()


class PretrainDataset:
    """Non-overlapping packed windows: sample ``i`` = ``tokens[i*s : i*s + s + 1]``.

    The extra token gives the shifted label for the window's last position (Megatron GPTDataset
    layout). ``loss_mask`` is 1.0 everywhere except, if ``pad_id`` is given, where the label is
    ``pad_id`` (packed pretraining data normally has no pads; pass ``None`` when pad == eod so
    document ends are still learned).
    """

    def __init__(self, tokens: np.ndarray, seq_length: int, pad_id: Optional[int] = None):
        if seq_length < 1:
            raise ValueError(f"seq_length must be >= 1, got {seq_length}")
        if len(tokens) < seq_length + 1:
            raise ValueError(f"corpus has {len(tokens)} tokens, fewer than seq_length+1={seq_length + 1}")
        self.tokens = tokens
        self.seq_length = int(seq_length)
        self.pad_id = pad_id

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_length

    def __getitem__(self, idx: int) -> dict:
        n = len(self)
        if not -n <= idx < n:
            raise IndexError(f"sample {idx} out of range for {n} samples")
        idx %= n
        start = idx * self.seq_length
        window = np.asarray(self.tokens[start : start + self.seq_length + 1], dtype=np.int32)
        labels = window[1:].copy()
        mask = np.ones(self.seq_length, dtype=np.float32)
        if self.pad_id is not None:
            mask[labels == self.pad_id] = 0.0
        return {"tokens": window[:-1].copy(), "labels": labels, "loss_mask": mask}


class BatchIterator:
    """Infinite, deterministic, dp-sharded micro-batch iterator with exact resume.

    The global sample stream is the concatenation over epochs ``e = 0, 1, ...`` of
    ``RandomState(seed + e).permutation(len(dataset))``; batches may straddle an epoch boundary
    so no sample is dropped. Each step consumes one global batch of ``micro_batch_size * dp_size``
    stream positions; rank ``r`` takes the contiguous slice ``[r*mbs, (r+1)*mbs)`` of it.
    ``consumed_samples`` counts global samples, so resuming (even with another dp_size) continues
    the same stream. ``shuffle=False`` reads the dataset in order (Megatron's
    ``MegatronPretrainingSampler``), for datasets that carry their own shuffle index.
    """

    def __init__(
        self,
        dataset: PretrainDataset,
        micro_batch_size: int,
        seed: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        consumed_samples: int = 0,
        shuffle: bool = True,
    ):
        if micro_batch_size < 1 or dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"bad loader config: micro_batch_size={micro_batch_size} dp_rank={dp_rank} dp_size={dp_size}")
        if len(dataset) == 0:
            raise ValueError("dataset is empty")
        self.dataset = dataset
        self.micro_batch_size = int(micro_batch_size)
        self.seed = int(seed)
        self.dp_rank = int(dp_rank)
        self.dp_size = int(dp_size)
        self.consumed_samples = int(consumed_samples)
        self.shuffle = bool(shuffle)
        self._perm_epoch = -1
        self._perm: Optional[np.ndarray] = None
        self.trace: Optional[list] = None   # set to a list to record each micro-batch's indices

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.dp_size

    @property
    def epoch(self) -> int:
        return self.consumed_samples // len(self.dataset)

    def _index(self, pos: int) -> int:
        n = len(self.dataset)
        if not self.shuffle:  # dataset already shuffled (Megatron GPTDataset): sequential sampler
            return pos % n
        epoch = pos // n
        if epoch != self._perm_epoch:
            self._perm = np.random.RandomState((self.seed + epoch) % (2**32)).permutation(n)
            self._perm_epoch = epoch
        return int(self._perm[pos % n])

    def __iter__(self) -> "BatchIterator":
        return self

    def __next__(self) -> dict:
        start = self.consumed_samples + self.dp_rank * self.micro_batch_size
        indices = [self._index(p) for p in range(start, start + self.micro_batch_size)]
        if self.trace is not None:   # the dataset indices served, for exact-resume checks
            self.trace.append(indices)
        samples = [self.dataset[i] for i in indices]
        self.consumed_samples += self.global_batch_size
        return {k: np.stack([s[k] for s in samples]) for k in samples[0]}

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict) -> None:
        self.consumed_samples = int(state["consumed_samples"])
