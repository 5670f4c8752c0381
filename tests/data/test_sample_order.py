"""MindSpeed-LLM's instruction-data order (``data.padded_samples``, ``data.shuffle: false``;
``--padded-samples`` / ``--no-shuffle``) against its ``_build_index_mappings`` logic re-derived
here in NumPy, and the loader of an SFT run reading the samples in that order."""
from __future__ import annotations

import numpy as np
import pytest

from helpers.finetune_fixtures import RUN, alpaca_rows, make_hf_folder, preprocess, write_jsonl
from ms_llm.config import ConfigError, load_config
from ms_llm.data.sample_order import sample_order
from ms_llm.data.sft import open_sft_dataset
from ms_llm.training.data_setup import build_data
from helpers.parallel_common import CONFIG


def mindspeed_index(start, n_docs, num_samples, seed, gbs, shuffle, padded):
    """decoder_packed_mtf_dataset._build_index_mappings as MindSpeed-LLM writes it: a list
    extended epoch by epoch (each the split's ids, padded from id 0 up to a whole global batch
    when asked, shuffled by the one RandomState(seed)) until it holds num_samples ids."""
    np_rng = np.random.RandomState(seed=seed)
    shuffle_idx = []
    while len(shuffle_idx) < num_samples:
        result = np.arange(start=start, stop=start + n_docs, step=1, dtype=np.int64)
        if padded and n_docs % gbs != 0:
            result = np.append(result, np.arange(start=0, stop=gbs - n_docs % gbs, step=1,
                                                 dtype=np.int64))
        if shuffle:
            np_rng.shuffle(result)
        shuffle_idx.extend(result.tolist())
    return shuffle_idx


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("start,n_docs,gbs,num_samples", [(0, 10, 4, 40), (3, 7, 8, 24),
                                                         (0, 16, 8, 50), (5, 1, 3, 2)])
def test_order_equals_mindspeeds_index(shuffle, padded, start, n_docs, gbs, num_samples):
    want = mindspeed_index(start, n_docs, num_samples, 1234, gbs, shuffle, padded)
    got = sample_order(start, n_docs, num_samples, 1234, gbs, shuffle=shuffle, padded=padded)
    assert got.tolist() == want
    if padded:   # every epoch ends on a whole global batch
        assert len(got) % gbs == 0


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    root = tmp_path_factory.mktemp("order")
    hf = make_hf_folder(root / "hf")
    prefix = preprocess(write_jsonl(root / "a.jsonl", alpaca_rows(10)), hf, str(root / "single"),
                        "AlpacaStyleInstructionHandler")
    return hf, prefix


def _cfg(sft, *extra):
    hf, prefix = sft
    return load_config(CONFIG, RUN + ["--data.tokenizer", hf, "--data.data_path", prefix,
                                      "--data.dataset_type", "sft", "--data.seq_length", "32",
                                      "--training.max_steps", "5", *extra])


@pytest.mark.parametrize("extra,shuffle,padded", [
    (["--data.shuffle", "false"], False, False),
    (["--data.padded_samples", "true"], True, True),
    (["--data.padded_samples", "true", "--data.shuffle", "false"], False, True)])
def test_sft_run_reads_samples_in_mindspeeds_order(sft, extra, shuffle, padded):
    """10 samples, global batch 4 (2 data-parallel ranks x micro-batch 2), 5 steps: the
    micro-batches of both ranks, interleaved as Megatron's sequential sampler hands them out,
    are the samples of MindSpeed's index in order (tokens compared)."""
    cfg = _cfg(sft, *extra)
    samples = open_sft_dataset(sft[1], 32, 0)
    want = mindspeed_index(0, 10, 5 * 4, cfg.training.seed, 4, shuffle, padded)
    loaders = [build_data(cfg, dp_rank=r, dp_size=2).loader for r in (0, 1)]
    got = []
    for _ in range(5):
        for loader in loaders:
            got.extend(list(next(loader)["tokens"]))
    for row, i in zip(got, want):
        np.testing.assert_array_equal(row, samples[i]["tokens"])
    assert len(got) == 20


def test_order_keys_refuse_pretraining_data():
    with pytest.raises(ConfigError, match="data.shuffle"):
        load_config(CONFIG, ["--data.shuffle", "false"])
