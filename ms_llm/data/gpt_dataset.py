"""Megatron-Core ``GPTDataset`` / ``BlendedDataset`` over mmap indexed datasets, with cached indices.

Why: a run that switches lanes (or resumes) must see the same samples in the same order as the
PyTorch lane for the same data, seed and sample count. So the three indices follow
Megatron-Core exactly:

* document index: the split's document ids repeated ``num_epochs`` times and shuffled with
  ``RandomState(seed)`` (the last epoch shuffled on its own when it is used for less than 80 %);
* sample index: ``(position in document index, token offset)`` every ``sequence_length`` tokens
  of the concatenated document stream, each sample overlapping the next by one token (the
  shifted label);
* shuffle index: a permutation of samples (again separate for a partial last epoch).

``num_epochs`` is the smallest count giving ``num_samples * sequence_length + 1`` tokens. The
indices are cached as ``.npy`` under ``<cache>/<md5 of the description>-GPTDataset-<split>-*``;
the description file is written last and marks a complete cache.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from .embedded import atomic_write_bytes, file_lock
from .indexed import IndexedDataset, idx_path
from .packing import ltor_masks_and_position_ids

SPLITS = ("train", "valid", "test")


@dataclass
class GPTDatasetConfig:
    """Megatron names. ``eod`` is the tokenizer's end-of-document id (packing boundaries)."""

    sequence_length: int
    random_seed: int = 1234
    eod: int = 0
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    create_attention_mask: bool = True
    add_extra_token_to_sequence: bool = True
    path_to_cache: Optional[str] = None
    split: str = "100,0,0"
    mmap_bin_files: bool = True
    extra: dict = field(default_factory=dict)


def _np_bytes(arr: np.ndarray) -> bytes:
    import io

    bio = io.BytesIO()
    np.save(bio, arr, allow_pickle=False)
    return bio.getvalue()


def build_document_index(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                         separate_final_epoch: bool) -> np.ndarray:
    """Megatron-Core ``_build_document_index``."""
    if not separate_final_epoch or num_epochs == 1:
        doc_idx = np.mgrid[0:num_epochs, 0:len(documents)][1]
        doc_idx[:] = documents
        doc_idx = doc_idx.reshape(-1).astype(np.int32)
        rng.shuffle(doc_idx)
        return doc_idx
    first = build_document_index(documents, num_epochs - 1, rng, False)
    last = build_document_index(documents, 1, rng, False)
    return np.concatenate((first, last))


def build_sample_index(sequence_lengths: np.ndarray, document_index: np.ndarray, sequence_length: int,
                       num_epochs: int, tokens_per_epoch: int, add_extra_token: int = 1) -> np.ndarray:
    """Megatron-Core ``helpers.build_sample_idx`` (drop the last partial sequence), vectorised.

    Sample ``i`` starts at token ``i * sequence_length`` of the stream formed by the documents in
    ``document_index`` order; the row is ``(j, offset)`` with ``j`` the last document-index
    position whose cumulative start is ``<=`` that token. Shape ``[num_samples + 1, 2]``.
    """
    num_samples = (num_epochs * tokens_per_epoch - add_extra_token) // sequence_length
    lengths = np.asarray(sequence_lengths, dtype=np.int64)[document_index]
    starts = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=starts[1:])
    t = np.arange(num_samples + 1, dtype=np.int64) * sequence_length
    j = np.searchsorted(starts, t, side="right") - 1
    j = np.minimum(j, len(lengths) - 1)
    out = np.empty((num_samples + 1, 2), dtype=np.int64)
    out[:, 0] = j
    out[:, 1] = t - starts[j]
    return out


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """Megatron-Core ``_build_shuffle_index``."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(0, num_samples, 1, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, 1, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def num_epochs_needed(tokens_per_epoch: int, num_samples: Optional[int], sequence_length: int, add_extra_token: int = 1) -> int:
    if num_samples is None:
        return 1
    if tokens_per_epoch <= 0:
        raise ValueError("the dataset split has no tokens")
    requested = num_samples * sequence_length + add_extra_token
    return max(1, -(-requested // tokens_per_epoch))


def build_indices(sequence_lengths: np.ndarray, documents: np.ndarray, num_samples: Optional[int], sequence_length: int,
                  seed: int, add_extra_token: int = 1) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(document_index, sample_index, shuffle_index) exactly as Megatron-Core's GPTDataset."""
    tokens_per_epoch = int(np.asarray(sequence_lengths, dtype=np.int64)[documents].sum())
    num_epochs = num_epochs_needed(tokens_per_epoch, num_samples, sequence_length, add_extra_token)
    if num_epochs == 1:
        separate_final_epoch = False
    else:
        sans_final = ((num_epochs - 1) * tokens_per_epoch - add_extra_token) // sequence_length
        from_final = num_samples - sans_final
        per_epoch = (tokens_per_epoch - add_extra_token) // sequence_length
        assert 0 <= from_final <= per_epoch + 1
        separate_final_epoch = from_final < int(0.80 * per_epoch)
    rng = np.random.RandomState(seed)
    document_index = build_document_index(np.asarray(documents), num_epochs, rng, separate_final_epoch)
    sample_index = build_sample_index(sequence_lengths, document_index, sequence_length, num_epochs, tokens_per_epoch, add_extra_token)
    total = sample_index.shape[0] - 1
    if total < 1:
        raise ValueError(f"the dataset split has {tokens_per_epoch} tokens, too few for one sample of {sequence_length}")
    if separate_final_epoch:
        shuffle_index = build_shuffle_index(sans_final, total, rng)
    else:
        shuffle_index = build_shuffle_index(total, total, rng)
    return document_index, sample_index, shuffle_index


def _load_or_build(cache_dir: Optional[str], stem: str, description: dict, names: Sequence[str], build) -> Dict[str, np.ndarray]:
    """Cache ``build()``'s arrays as ``<stem>-<name>.npy``; the description json marks completion."""
    if cache_dir is None:
        return dict(zip(names, build()))
    desc = json.dumps(description, sort_keys=True, indent=2)
    digest = hashlib.md5(desc.encode("utf-8")).hexdigest()
    base = os.path.join(cache_dir, f"{digest}-{stem}")
    paths = {n: f"{base}-{n}.npy" for n in names}
    marker = f"{base}-description.txt"

    def cached() -> bool:
        return os.path.isfile(marker) and all(os.path.isfile(p) for p in paths.values())

    if not cached():
        os.makedirs(cache_dir, exist_ok=True)
        with file_lock(base + ".lock"):
            if not cached():
                for n, arr in zip(names, build()):
                    atomic_write_bytes(paths[n], _np_bytes(arr))
                atomic_write_bytes(marker, desc.encode("utf-8"))
    return {n: np.load(p, mmap_mode="r", allow_pickle=False) for n, p in paths.items()}


def split_indices(split: Union[str, Sequence[float]], num_elements: int) -> List[int]:
    """Megatron-Core ``_get_split_indices``: "969,30,1" -> document boundaries."""
    weights = [float(x) for x in (split.replace("/", ",").split(",") if isinstance(split, str) else split)]
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    if total <= 0 or any(w < 0 for w in weights):
        raise ValueError(f"split {split!r} must be non-negative weights with a positive sum")
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(w / total * float(num_elements))))
    diff = bounds[-1] - num_elements
    return [bounds[0]] + [b - diff for b in bounds[1:]]


class GPTDataset:
    """Megatron-Core ``GPTDataset``: fixed-length samples over one indexed dataset.

    ``ds[i]`` -> ``tokens``/``labels`` (int32 [s]), ``loss_mask`` (float32), ``position_ids``
    (int32) and, with ``create_attention_mask``, ``attention_mask`` (bool [1, s, s], True = masked).
    With ``reset_position_ids`` / ``reset_attention_mask`` (packing) positions restart after each
    ``eod`` and no token attends across one.
    """

    def __init__(self, indexed: Union[str, IndexedDataset], num_samples: Optional[int], config: GPTDatasetConfig,
                 indices: Optional[np.ndarray] = None, index_split: str = "train"):
        self.dataset = IndexedDataset(indexed) if isinstance(indexed, str) else indexed
        self.config = config
        self.index_split = index_split
        n_docs = self.dataset.num_documents
        self.indices = np.arange(n_docs, dtype=np.int32) if indices is None else np.asarray(indices, dtype=np.int32)
        if len(self.indices) == 0:
            raise ValueError(f"{self.dataset.prefix}: the {index_split} split has no documents")
        if len(self.dataset) != n_docs:
            raise ValueError(f"{self.dataset.prefix}: GPTDataset needs one sequence per document "
                             f"({len(self.dataset)} sequences, {n_docs} documents)")
        self.num_samples = num_samples
        extra = int(config.add_extra_token_to_sequence)
        st = os.stat(idx_path(self.dataset.prefix))
        description = {
            "class": "GPTDataset", "dataset_path": os.path.abspath(self.dataset.prefix), "idx_size": st.st_size,
            "idx_mtime_ns": st.st_mtime_ns, "num_samples": num_samples, "index_split": index_split,
            "random_seed": config.random_seed, "sequence_length": config.sequence_length,
            "add_extra_token_to_sequence": extra, "split": config.split,
            "indices": [int(self.indices[0]), int(self.indices[-1]), len(self.indices)],
        }
        cache = config.path_to_cache
        if cache is None:
            cache = os.path.join(os.path.dirname(os.path.abspath(self.dataset.prefix)), "cache", "GPTDataset_indices")
        arrays = _load_or_build(
            cache, f"GPTDataset-{index_split}", description, ("document_index", "sample_index", "shuffle_index"),
            lambda: build_indices(self.dataset.sequence_lengths, self.indices, num_samples, config.sequence_length,
                                  config.random_seed, extra))
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]

    def __len__(self) -> int:
        return int(self.sample_index.shape[0]) - 1

    def sample_tokens(self, idx: int) -> Tuple[np.ndarray, np.ndarray]:
        """Megatron's ``_query_document_sample_shuffle_indices``: (tokens incl. extra, document ids)."""
        extra = int(self.config.add_extra_token_to_sequence)
        idx = int(self.shuffle_index[idx])
        beg, beg_off = (int(x) for x in self.sample_index[idx])
        end, end_off = (int(x) for x in self.sample_index[idx + 1])
        doc_ids, parts = [], []
        if beg == end:
            doc_ids.append(int(self.document_index[beg]))
            parts.append(self.dataset.get(doc_ids[-1], offset=beg_off, length=end_off - beg_off + extra))
        else:
            for i in range(beg, end + 1):
                doc_ids.append(int(self.document_index[i]))
                offset = 0 if i > beg else beg_off
                length = None if i < end else end_off + extra
                parts.append(self.dataset.get(doc_ids[-1], offset=offset, length=length))
        return np.concatenate(parts).astype(np.int64), np.asarray(doc_ids, dtype=np.int64)

    def __getitem__(self, idx: int) -> dict:
        n = len(self)
        if not -n <= idx < n:
            raise IndexError(f"sample {idx} out of range for {n} samples")
        text, _ = self.sample_tokens(idx % n)
        if self.config.add_extra_token_to_sequence:
            tokens, labels = text[:-1], text[1:]
        else:
            tokens, labels = text, np.concatenate([text[1:], [self.config.eod]])
        c = self.config
        mask, loss_mask, pos = ltor_masks_and_position_ids(tokens, c.eod, c.reset_position_ids, c.reset_attention_mask,
                                                           c.eod_mask_loss, c.create_attention_mask)
        out = {"tokens": tokens.astype(np.int32), "labels": labels.astype(np.int32), "loss_mask": loss_mask,
               "position_ids": pos.astype(np.int32)}
        if mask is not None:
            out["attention_mask"] = mask
        return out


def normalize(weights: Sequence[float]) -> List[float]:
    w = np.asarray(weights, dtype=np.float64)
    if len(w) == 0 or (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"blend weights {list(weights)} must be non-negative with a positive sum")
    return (w / w.sum()).tolist()


def build_blending_indices(weights: Sequence[float], size: int) -> Tuple[np.ndarray, np.ndarray]:
    """Megatron-Core ``helpers.build_blending_indices``: greedily pick the dataset whose sampled
    share lags its weight most (ties -> lowest index)."""
    w = normalize(weights)
    current = [0] * len(w)
    dataset_index = np.empty(size, dtype=np.int16)
    dataset_sample_index = np.empty(size, dtype=np.int64)
    for i in range(size):
        x = max(float(i), 1.0)
        best, best_err = 0, w[0] * x - current[0]
        for d in range(1, len(w)):
            err = w[d] * x - current[d]
            if err > best_err:
                best, best_err = d, err
        dataset_index[i] = best
        dataset_sample_index[i] = current[best]
        current[best] += 1
    return dataset_index, dataset_sample_index


class BlendedDataset:
    """Megatron-Core ``BlendedDataset``: ``size`` samples drawn from ``datasets`` by ``weights``."""

    def __init__(self, datasets: Sequence[GPTDataset], weights: Sequence[float], size: int, cache_dir: Optional[str] = None):
        if len(datasets) != len(weights) or not datasets:
            raise ValueError("BlendedDataset needs one weight per dataset")
        self.datasets = list(datasets)
        self.weights = normalize(weights)
        self.size = int(size)
        description = {"class": "BlendedDataset", "size": self.size, "weights": self.weights,
                       "datasets": [[d.dataset.prefix, d.index_split, d.num_samples, d.config.random_seed,
                                     d.config.sequence_length] for d in self.datasets]}
        arrays = _load_or_build(cache_dir, "BlendedDataset", description, ("dataset_index", "dataset_sample_index"),
                                lambda: build_blending_indices(self.weights, self.size))
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]
        for d in range(len(self.datasets)):
            need = int(self.dataset_sample_index[self.dataset_index == d].max(initial=-1)) + 1
            if need > len(self.datasets[d]):
                raise ValueError(f"{self.datasets[d].dataset.prefix}: blend needs {need} samples, dataset has {len(self.datasets[d])}")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> dict:
        if not -self.size <= idx < self.size:
            raise IndexError(f"sample {idx} out of range for {self.size} samples")
        idx %= self.size
        d = int(self.dataset_index[idx])
        out = dict(self.datasets[d][int(self.dataset_sample_index[idx])])
        out["dataset_id"] = np.int32(d)
        return out


def parse_blend(data_path: Union[str, Sequence[str]]) -> Tuple[List[str], Optional[List[float]]]:
    """Megatron ``--data-path``: ``"p"`` / ``["p1", "p2"]`` (equal) or ``["w1", "p1", "w2", "p2"]``."""
    items = data_path.split() if isinstance(data_path, str) else [str(x) for x in data_path]
    if not items:
        raise ValueError("data_path is empty")

    def is_num(s: str) -> bool:
        try:
            float(s)
            return True
        except ValueError:
            return False

    if len(items) == 1:
        return items, None
    if is_num(items[0]):
        if len(items) % 2 or not all(is_num(w) for w in items[0::2]):
            raise ValueError(f"data_path {items} must alternate weight and prefix")
        return items[1::2], [float(w) for w in items[0::2]]
    if any(is_num(x) for x in items):
        raise ValueError(f"data_path {items} mixes weights and prefixes inconsistently")
    return items, [1.0] * len(items)


def build_pretrain_datasets(data_path: Union[str, Sequence[str]], seq_length: int, num_samples: Sequence[Optional[int]],
                            seed: int = 1234, eod: int = 0, split: str = "100,0,0", cache_dir: Optional[str] = None,
                            reset_position_ids: bool = False, reset_attention_mask: bool = False,
                            eod_mask_loss: bool = False, create_attention_mask: bool = True) -> Dict[str, object]:
    """Train/valid/test datasets like Megatron's ``BlendedMegatronDatasetBuilder``.

    ``num_samples`` = samples per split (train_iters * global_batch_size, ...). Each prefix is
    split by documents with ``split``; with several prefixes each gets
    ``ceil(ceil(n * w) * 1.005)`` samples and a ``BlendedDataset`` of ``n`` mixes them.
    Splits with weight 0 or 0 samples are ``None``.
    """
    prefixes, weights = parse_blend(data_path)
    cfg = GPTDatasetConfig(sequence_length=seq_length, random_seed=seed, eod=eod, split=split, path_to_cache=cache_dir,
                           reset_position_ids=reset_position_ids, reset_attention_mask=reset_attention_mask,
                           eod_mask_loss=eod_mask_loss, create_attention_mask=create_attention_mask)
    low = [IndexedDataset(p) for p in prefixes]
    out: Dict[str, object] = {}
    for s, name in enumerate(SPLITS):
        n = num_samples[s] if s < len(num_samples) else None
        per: List[GPTDataset] = []
        wn = normalize(weights) if weights is not None else None
        for k, ds in enumerate(low):
            b = split_indices(split, ds.num_documents)
            if b[s + 1] <= b[s] or not n:
                per = []
                break
            target = n if wn is None else math.ceil(math.ceil(n * wn[k]) * 1.005)
            per.append(GPTDataset(ds, target, cfg, np.arange(b[s], b[s + 1], dtype=np.int32), name))
        if not per:
            out[name] = None
        elif weights is None:
            out[name] = per[0]
        else:
            out[name] = BlendedDataset(per, weights, n, cache_dir=cache_dir or os.path.join(
                os.path.dirname(os.path.abspath(prefixes[0])), "cache", "GPTDataset_indices"))
    return out


def build_pretrain_dataset(data_path: Union[str, Sequence[str]], seq_length: int, num_samples: int, **kwargs) -> object:
    """The training split only (see ``build_pretrain_datasets``); what the trainer wires in."""
    ds = build_pretrain_datasets(data_path, seq_length, [num_samples, 0, 0], **kwargs)["train"]
    if ds is None:
        raise ValueError(f"data split {kwargs.get('split', '100,0,0')!r} leaves no training documents")
    return ds
