"""MindSpeed-LLM's order of instruction (SFT) and pairwise samples, for ``data.padded_samples``
and ``data.shuffle: false`` (its ``--padded-samples`` / ``--no-shuffle``).

Why: MindSpeed-LLM's ``DecoderPackedMTFDataset`` does not shuffle through the sampler; it builds
one index of sample (document) ids up front (``_build_index_mappings``) and reads it in order
(Megatron's sequential ``MegatronPretrainingSampler``). Its rule, re-stated:

* one epoch is the split's ids ``start .. start + count - 1``; with ``--padded-samples`` and
  ``count`` not a multiple of the global batch size, ids ``0 .. pad - 1`` (from the dataset's
  first sample, not the split's: LlamaFactory's "fill the last batch from the start") are
  appended, ``pad = global_batch - count % global_batch``;
* with shuffling each epoch's ids are shuffled in place by ONE ``numpy.random.RandomState(seed)``
  drawn from epoch after epoch; with ``--no-shuffle`` they stay in order;
* epochs are appended until the index holds at least the run's sample count
  (``train_iters x global_batch_size``).

So with ``--no-shuffle`` nothing at all is shuffled (the ids run in file order, padding
included), and with ``--padded-samples`` every epoch ends on a whole global batch.
"""
from __future__ import annotations

import numpy as np


def epoch_ids(start: int, count: int, global_batch_size: int, padded: bool) -> np.ndarray:
    """One epoch's sample ids (MindSpeed's ``_build_sequential_idx``)."""
    ids = np.arange(start, start + count, dtype=np.int64)
    remainder = count % global_batch_size
    if padded and remainder:
        ids = np.append(ids, np.arange(0, global_batch_size - remainder, dtype=np.int64))
    return ids


def sample_order(start: int, count: int, num_samples: int, seed: int, global_batch_size: int,
                 shuffle: bool = True, padded: bool = False) -> np.ndarray:
    """The sample ids a run reads, in order: whole epochs until ``num_samples`` are covered."""
    if count < 1:
        raise ValueError("the split holds no samples")
    rng = np.random.RandomState(seed)
    epochs, total = [], 0
    while total < max(num_samples, 1):
        ids = epoch_ids(start, count, global_batch_size, padded)
        if shuffle:
            rng.shuffle(ids)
        epochs.append(ids)
        total += len(ids)
    return np.concatenate(epochs)


class OrderedSamples:
    """``dataset`` read through ``order`` (absolute sample ids): the loader reads it in order."""

    def __init__(self, dataset, order: np.ndarray):
        self.dataset, self.order = dataset, np.asarray(order, np.int64)

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, idx: int) -> dict:
        return self.dataset[int(self.order[idx % len(self.order)])]
