"""GPTDataset / BlendedDataset: Megatron-Core's document/sample/shuffle indices, stated by hand or
by literal transcriptions of Megatron's loops written here; packing masks; cache; loader."""
import json
import os

import numpy as np
import pytest

from ms_llm.data import BatchIterator, load_tokenizer
from ms_llm.data import gpt_dataset as gd
from ms_llm.data.gpt_dataset import (BlendedDataset, GPTDataset, GPTDatasetConfig, build_pretrain_dataset,
                                     build_pretrain_datasets, split_indices)
from ms_llm.data.indexed import write_indexed_dataset


def _write(tmp_path, name, lengths, base=0):
    """Document d = [base + 100*d, base + 100*d + 1, ...] so every token names its document."""
    prefix = str(tmp_path / name)
    write_indexed_dataset(prefix, [np.arange(n) + base + 100 * d for d, n in enumerate(lengths)], np.int32)
    return prefix


def _cfg(tmp_path, seq, seed, **kw):
    return GPTDatasetConfig(sequence_length=seq, random_seed=seed, path_to_cache=str(tmp_path / "cache"), **kw)


def test_hand_computed_indices(tmp_path):
    # docs of lengths 3, 5, 2; seq 4; seed 7 -> RandomState(7).shuffle([0,1,2]) = [2,1,0].
    # Stream: doc2[0:2] doc1[0:5] doc0[0:3] (10 tokens) -> (10 - 1) // 4 = 2 samples starting at
    # tokens 0, 4, 8 = (doc-index pos 0, off 0), (pos 1, off 2), (pos 2, off 1).
    ds = GPTDataset(_write(tmp_path, "d", [3, 5, 2]), None, _cfg(tmp_path, 4, 7))
    assert ds.document_index.tolist() == [2, 1, 0]
    assert ds.sample_index.tolist() == [[0, 0], [1, 2], [2, 1]]
    assert ds.shuffle_index.tolist() == [1, 0]  # the same RandomState continues: shuffle([0, 1]) -> [1, 0]
    assert len(ds) == 2
    s0, s1 = ds[1], ds[0]  # ds[i] reads sample shuffle_index[i]
    assert s0["tokens"].tolist() == [200, 201, 100, 101] and s0["labels"].tolist() == [201, 100, 101, 102]
    assert s1["tokens"].tolist() == [102, 103, 104, 0] and s1["labels"].tolist() == [103, 104, 0, 1]
    assert s1["position_ids"].tolist() == [0, 1, 2, 3] and s1["loss_mask"].tolist() == [1, 1, 1, 1]
    assert s1["attention_mask"].shape == (1, 4, 4) and s1["attention_mask"][0].tolist() == (~np.tri(4, dtype=bool)).tolist()


def test_epochs_and_separate_final_epoch(tmp_path):
    # 20 tokens/epoch, seq 4: 6 samples need 25 tokens -> 2 epochs. Samples before the final
    # epoch: (20 - 1) // 4 = 4; from the final: 2 < int(0.8 * 4) = 3 -> separate final epoch.
    lengths = [3, 5, 2, 6, 4]
    ds = GPTDataset(_write(tmp_path, "d", lengths), 6, _cfg(tmp_path, 4, 11))
    rng = np.random.RandomState(11)
    e0 = np.arange(5, dtype=np.int32); rng.shuffle(e0)
    e1 = np.arange(5, dtype=np.int32); rng.shuffle(e1)
    assert ds.document_index.tolist() == e0.tolist() + e1.tolist()
    assert len(ds) == (40 - 1) // 4 == 9
    first = np.arange(4, dtype=np.uint32); rng.shuffle(first)
    last = np.arange(4, 9, dtype=np.uint32); rng.shuffle(last)
    assert ds.shuffle_index.tolist() == first.tolist() + last.tolist()
    # 8 samples need 33 tokens -> 2 epochs; 4 from the final epoch is not < 3 -> one joint shuffle.
    ds2 = GPTDataset(_write(tmp_path, "d2", lengths), 8, _cfg(tmp_path, 4, 11))
    rng = np.random.RandomState(11)
    both = np.tile(np.arange(5, dtype=np.int32), 2); rng.shuffle(both)
    perm = np.arange(9, dtype=np.uint32); rng.shuffle(perm)
    assert ds2.document_index.tolist() == both.tolist() and ds2.shuffle_index.tolist() == perm.tolist()
    # 21 samples need 85 tokens -> 5 epochs
    assert gd.num_epochs_needed(20, 21, 4) == 5 and gd.num_epochs_needed(20, 4, 4) == 1 and gd.num_epochs_needed(20, 5, 4) == 2


def megatron_build_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch):
    """Line-by-line transcription of Megatron's helpers.cpp build_sample_idx (drop last partial)."""
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    out = [[0, 0]]
    doc_pos, doc_offset = 0, 0
    while len(out) <= num_samples:
        remaining = seq_length + 1
        while remaining != 0:
            doc_len = sizes[doc_idx[doc_pos]] - doc_offset
            remaining -= doc_len
            if remaining <= 0:
                doc_offset += remaining + doc_len - 1
                remaining = 0
            else:
                if doc_pos == len(doc_idx) - 1:
                    doc_offset = sizes[doc_idx[doc_pos]] - 1
                    break
                doc_pos += 1
                doc_offset = 0
        out.append([doc_pos, doc_offset])
    return out


def test_sample_index_matches_megatron_loop():
    rng = np.random.RandomState(0)
    for trial in range(60):
        n_docs = rng.randint(1, 12)
        sizes = rng.randint(1, 15, size=n_docs).astype(np.int32)
        seq = int(rng.randint(1, 9))
        epochs = int(rng.randint(1, 4))
        if epochs * sizes.sum() < seq + 1:
            continue
        doc_idx = np.tile(np.arange(n_docs, dtype=np.int32), epochs)
        rng.shuffle(doc_idx)
        got = gd.build_sample_index(sizes, doc_idx, seq, epochs, int(sizes.sum()))
        assert got.tolist() == megatron_build_sample_idx(sizes.tolist(), doc_idx.tolist(), seq, epochs, int(sizes.sum())), trial


def megatron_ltor(data, eod, reset_position_ids, reset_attention_mask, eod_mask_loss):
    """Transcription of Megatron's _get_ltor_masks_and_position_ids with python loops."""
    s = len(data)
    att = np.tril(np.ones((s, s)))
    loss = np.ones(s, dtype=np.float32)
    if eod_mask_loss:
        loss[data == eod] = 0.0
    pos = np.arange(s)
    if reset_position_ids or reset_attention_mask:
        prev = 0
        for i in np.where(data == eod)[0]:
            if reset_attention_mask:
                att[i + 1:, :i + 1] = 0
            if reset_position_ids:
                pos[i + 1:] -= i + 1 - prev
                prev = i + 1
    return att < 0.5, loss, pos


def test_packing_masks_and_positions_match_megatron(tmp_path):
    eod = 0
    lengths = [3, 4, 1, 6, 2, 5]
    prefix = str(tmp_path / "p")  # documents end with eod, like preprocess --append-eod
    write_indexed_dataset(prefix, [np.r_[np.arange(1, n) + 10 * (d + 1), eod] for d, n in enumerate(lengths)], np.int32)
    for flags in [(True, True, True), (True, False, False), (False, True, False), (False, False, True)]:
        ds = GPTDataset(prefix, 12, _cfg(tmp_path, 5, 3, eod=eod, reset_position_ids=flags[0],
                                             reset_attention_mask=flags[1], eod_mask_loss=flags[2]))
        saw_boundary = False
        for i in range(len(ds)):
            s = ds[i]
            att, loss, pos = megatron_ltor(s["tokens"].astype(np.int64), eod, *flags)
            assert s["attention_mask"][0].tolist() == att.tolist()
            assert s["loss_mask"].tolist() == loss.tolist() and s["position_ids"].tolist() == pos.tolist()
            saw_boundary |= bool((s["tokens"][:-1] == eod).any())
        assert saw_boundary


def test_round_trip_text_to_samples(tmp_path):
    from ms_llm.data.embedded import _train_sentencepiece
    from ms_llm.data.preprocess import main

    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda".split()
    rng = np.random.RandomState(5)
    docs = [" ".join(rng.choice(words, size=rng.randint(3, 20))) for _ in range(60)]
    (tmp_path / "tokenizer.model").write_bytes(_train_sentencepiece(docs, vocab_size=320))
    src = tmp_path / "corpus.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    assert main(["--input", str(src), "--tokenizer-type", "SentencePiece", "--tokenizer-name-or-path", str(tmp_path),
                 "--output-prefix", str(tmp_path / "out" / "c"), "--append-eod", "--log-interval", "1000"]) == 0
    tok = load_tokenizer(str(tmp_path / "tokenizer.model"))
    prefix = str(tmp_path / "out" / "c_text_document")
    seq = 16
    ds = GPTDataset(prefix, None, _cfg(tmp_path, seq, 9, eod=tok.eod))
    # Concatenate documents in document-index order; sample k = stream[k*seq : k*seq + seq + 1].
    stream = np.concatenate([np.asarray(tok.encode(docs[d]) + [tok.eod]) for d in ds.document_index])
    for i in range(len(ds)):
        k = int(ds.shuffle_index[i])
        s = ds[i]
        assert s["tokens"].tolist() == stream[k * seq:k * seq + seq].tolist()
        assert s["labels"].tolist() == stream[k * seq + 1:k * seq + seq + 1].tolist()
    assert len(ds) == (len(stream) - 1) // seq
    # detokenizing the unshuffled samples (without the overlap token) reproduces the documents
    text_ids = np.concatenate([ds.sample_tokens(int(np.where(ds.shuffle_index == k)[0][0]))[0][:-1] for k in range(len(ds))])
    pieces = np.split(text_ids, np.where(text_ids == tok.eod)[0] + 1)
    decoded = [tok.decode(p[:-1]) for p in pieces if len(p) and p[-1] == tok.eod]
    assert decoded == [docs[d] for d in ds.document_index[:len(decoded)]] and len(decoded) >= len(docs) - 2


def test_index_cache_is_reused(tmp_path, monkeypatch):
    prefix = _write(tmp_path, "d", [7, 3, 9, 4, 6])
    a = GPTDataset(prefix, 10, _cfg(tmp_path, 4, 1))
    files = sorted(os.listdir(tmp_path / "cache"))
    assert sum(f.endswith(".npy") for f in files) == 3 and any(f.endswith("description.txt") for f in files)

    def boom(*args, **kwargs):
        raise AssertionError("indices should come from the cache")

    monkeypatch.setattr(gd, "build_indices", boom)
    b = GPTDataset(prefix, 10, _cfg(tmp_path, 4, 1))
    for name in ("document_index", "sample_index", "shuffle_index"):
        assert getattr(a, name).tolist() == getattr(b, name).tolist()
    with pytest.raises(AssertionError, match="cache"):
        GPTDataset(prefix, 10, _cfg(tmp_path, 4, 2))  # another seed is another cache entry


def megatron_blending(weights, size):
    """Transcription of Megatron's helpers.cpp build_blending_indices."""
    w = [x / sum(weights) for x in weights]
    cur = [0] * len(w)
    di, dsi = [], []
    for i in range(size):
        x = max(float(i), 1.0)
        errs = [w[d] * x - cur[d] for d in range(len(w))]
        best = errs.index(max(errs))
        di.append(best)
        dsi.append(cur[best])
        cur[best] += 1
    return di, dsi


def test_blending_and_split(tmp_path):
    assert split_indices("969,30,1", 1000) == [0, 969, 999, 1000]
    assert split_indices("98,2,0", 7) == [0, 7, 7, 7]  # rounding: 6.86 -> 7, remainder 0
    assert split_indices("1,1", 5) == [0, 3, 5, 5]
    di, dsi = gd.build_blending_indices([0.3, 0.7], 40)
    ref_di, ref_dsi = megatron_blending([0.3, 0.7], 40)
    assert di.tolist() == ref_di and dsi.tolist() == ref_dsi and sum(ref_di) == 28  # 70 % from dataset 1

    a = _write(tmp_path, "a", [5] * 30, base=10000)
    b = _write(tmp_path, "b", [7] * 30, base=20000)
    out = build_pretrain_datasets(["0.25", a, "0.75", b], 4, [20, 4, 0], seed=5, split="90,10,0",
                                  cache_dir=str(tmp_path / "cache"))
    train, valid = out["train"], out["valid"]
    assert out["test"] is None and isinstance(train, BlendedDataset) and len(train) == 20 and len(valid) == 4
    # each member is asked for ceil(ceil(n * w) * 1.005) samples; train uses documents 0..26 only
    assert [d.num_samples for d in train.datasets] == [6, 16] and all(d.indices.tolist() == list(range(27)) for d in train.datasets)
    assert set(valid.datasets[0].document_index.tolist()) == {27, 28, 29}
    ref_di, ref_dsi = megatron_blending([0.25, 0.75], 20)
    for i in range(20):
        s = train[i]
        base = 10000 if ref_di[i] == 0 else 20000
        assert int(s["dataset_id"]) == ref_di[i]
        assert s["tokens"].tolist() == train.datasets[ref_di[i]][ref_dsi[i]]["tokens"].tolist()
        assert base <= s["tokens"].min() and s["tokens"].max() < base + 3000
    single = build_pretrain_dataset(a, 4, 8, seed=5, cache_dir=str(tmp_path / "cache"))
    assert isinstance(single, GPTDataset) and single.num_samples == 8
    with pytest.raises(ValueError, match="alternate"):
        build_pretrain_datasets(["0.5", a, "0.5"], 4, [4])


def test_loader_over_gpt_dataset_sequential_sharded_resumable(tmp_path):
    ds = GPTDataset(_write(tmp_path, "d", [9, 4, 11, 6, 8, 5]), 12, _cfg(tmp_path, 3, 2, create_attention_mask=False))
    ref = [ds[i % len(ds)]["tokens"].tolist() for i in range(24)]  # Megatron's sampler reads in order
    r0 = BatchIterator(ds, 2, seed=0, dp_rank=0, dp_size=2, shuffle=False)
    r1 = BatchIterator(ds, 2, seed=0, dp_rank=1, dp_size=2, shuffle=False)
    got = []
    for _ in range(3):
        got += next(r0)["tokens"].tolist() + next(r1)["tokens"].tolist()
    assert got == ref[:12]
    resumed = BatchIterator(ds, 4, seed=0, shuffle=False, **r0.state_dict())
    assert next(resumed)["tokens"].tolist() == ref[12:16]
