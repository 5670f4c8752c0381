"""Tests for ms_llm.data: tokenizers, embedded corpus, token cache, packed dataset, loader."""
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from ms_llm.data import (
    BatchIterator,
    PretrainDataset,
    ensure_default_corpus,
    load_tokenizer,
    read_documents,
    tokenize_corpus,
)
from ms_llm.data import dataset as dataset_mod
from ms_llm.data.embedded import _train_sentencepiece
from helpers.paths import ROOT as REPO

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex my jolly box".split()
TEXTS = ["Hello world, the fox.", "multi\nline\n\n  indented  text", "unicode: héllo ✓ 日本", "digits 12345 x"]


def _docs(n=300):
    rng = np.random.RandomState(0)
    return [" ".join(rng.choice(WORDS, size=rng.randint(5, 30))) + "." for _ in range(n)]


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("sp") / "tokenizer.model"
    path.write_bytes(_train_sentencepiece(_docs(), vocab_size=320))
    return str(path)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<pad>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(_docs(), trainer=trainer)
    d = tmp_path_factory.mktemp("hf")
    tok.save(str(d / "tokenizer.json"))
    return str(d)


# ---------------------------------------------------------------- tokenizers


def test_sentencepiece_round_trip(sp_model):
    tok = load_tokenizer(sp_model)
    assert tok.vocab_size == 320 and tok.eod == 2 and tok.pad == 3
    for text in TEXTS:
        ids = tok.encode(text)
        assert all(isinstance(i, int) and 0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
    assert tok.encode_batch(TEXTS) == [tok.encode(t) for t in TEXTS]
    assert tok.decode(np.asarray(tok.encode(TEXTS[0]), dtype=np.uint16)) == TEXTS[0]


def test_hf_tokenizer_json_round_trip(hf_dir):
    tok = load_tokenizer(hf_dir)  # folder -> tokenizer.json
    assert type(tok).__name__ == "HFTokenizer"
    assert 256 < tok.vocab_size <= 400 and tok.eod == 2 and tok.pad == 1
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.eod not in ids  # no special tokens added
        assert tok.decode(ids) == text
    assert tok.encode_batch(TEXTS) == [tok.encode(t) for t in TEXTS]


def test_hf_eos_from_config_and_pad_fallback(hf_dir, tmp_path):
    text = open(os.path.join(hf_dir, "tokenizer.json"), encoding="utf-8").read()
    (tmp_path / "tokenizer.json").write_text(text.replace('"<pad>"', '"<notpad>"'), encoding="utf-8")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<unk>"}}), encoding="utf-8")
    tok = load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert tok.eod == 0 and tok.pad == 0  # eos from tokenizer_config.json; no pad -> eod


def test_folder_prefers_tokenizer_json(hf_dir, sp_model, tmp_path):
    (tmp_path / "tokenizer.model").write_bytes(open(sp_model, "rb").read())
    assert type(load_tokenizer(str(tmp_path))).__name__ == "SentencePieceTokenizer"
    (tmp_path / "tokenizer.json").write_bytes(open(os.path.join(hf_dir, "tokenizer.json"), "rb").read())
    assert type(load_tokenizer(str(tmp_path))).__name__ == "HFTokenizer"


def test_tokenizer_errors_name_path(tmp_path):
    missing = str(tmp_path / "nope.model")
    with pytest.raises(FileNotFoundError, match="nope.model"):
        load_tokenizer(missing)
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        load_tokenizer(str(tmp_path))  # empty folder
    for name in ("bad.model", "tokenizer.json"):
        p = tmp_path / name
        p.write_bytes(b"not a tokenizer \x00\xff")
        with pytest.raises(ValueError) as ei:
            load_tokenizer(str(p))
        assert str(p) in str(ei.value) and "\n" not in str(ei.value)


# ---------------------------------------------------------------- corpus reading and token cache


def test_read_documents_jsonl_and_txt(tmp_path):
    j = tmp_path / "c.jsonl"
    j.write_text('{"text": "a b"}\n\n{"body": "x", "text": "c\\nd"}\n{"text": ""}\n', encoding="utf-8")
    assert list(read_documents(str(j))) == ["a b", "c\nd"]
    j2 = tmp_path / "k.jsonl"
    j2.write_text('{"body": "x"}\n', encoding="utf-8")
    assert list(read_documents(str(j2), text_key="body")) == ["x"]
    t = tmp_path / "c.txt"
    t.write_text("para one\nstill one\n\n\n  \npara two\n", encoding="utf-8")
    assert list(read_documents(str(t))) == ["para one\nstill one", "para two"]


@pytest.mark.parametrize(
    "bad_line,why", [('{"text": "ok"', "malformed"), ('["text"]', "text"), ('{"text": 3}', "text")]
)
def test_malformed_jsonl_names_file_and_line(tmp_path, bad_line, why):
    p = tmp_path / "broken.jsonl"
    p.write_text('{"text": "one"}\n\n' + bad_line + '\n{"text": "four"}\n', encoding="utf-8")
    with pytest.raises(ValueError) as ei:
        list(read_documents(str(p)))
    msg = str(ei.value)
    assert f"{p}:3:" in msg and why in msg and "\n" not in msg


def test_tokenize_corpus_appends_eod_and_caches(tmp_path, sp_model, monkeypatch):
    tok = load_tokenizer(sp_model)
    docs = _docs(40)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    tokens = tokenize_corpus(str(corpus), tok)
    expected = [i for d in docs for i in tok.encode(d) + [tok.eod]]
    assert tokens.dtype == np.uint16 and tokens.tolist() == expected
    cached = [f for f in os.listdir(tmp_path) if f.endswith(".tokens.npy")]
    assert len(cached) == 1

    def boom(*a, **k):
        raise AssertionError("should have used the cache")

    monkeypatch.setattr(dataset_mod, "_tokenize", boom)
    assert tokenize_corpus(str(corpus), tok).tolist() == expected
    monkeypatch.undo()

    corpus.write_text(json.dumps({"text": docs[0]}) + "\n", encoding="utf-8")  # size changes -> new key
    assert tokenize_corpus(str(corpus), tok).tolist() == tok.encode(docs[0]) + [tok.eod]
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".tokens.npy")]) == 2
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        tokenize_corpus(str(tmp_path / "missing.jsonl"), tok)


# ---------------------------------------------------------------- packed dataset


def test_pretrain_dataset_boundaries():
    seq, n_tok = 10, 107
    tokens = np.arange(1000, 1000 + n_tok, dtype=np.uint16)
    ds = PretrainDataset(tokens, seq)
    assert len(ds) == 10  # (107 - 1) // 10
    for i in range(len(ds)):
        s = ds[i]
        want = [1000 + j for j in range(i * seq, i * seq + seq + 1)]
        assert s["tokens"].dtype == np.int32 and s["labels"].dtype == np.int32
        assert s["loss_mask"].dtype == np.float32 and s["tokens"].shape == (seq,)
        assert s["tokens"].tolist() == want[:-1] and s["labels"].tolist() == want[1:]
        assert s["loss_mask"].tolist() == [1.0] * seq
    assert ds[-1]["tokens"].tolist() == ds[9]["tokens"].tolist()
    with pytest.raises(IndexError):
        ds[10]
    assert len(PretrainDataset(np.arange(11), 10)) == 1
    with pytest.raises(ValueError):
        PretrainDataset(np.arange(10), 10)


def test_pretrain_dataset_pad_mask():
    tokens = np.array([5, 6, 0, 0, 7, 0, 8, 9, 9], dtype=np.int64)
    s = PretrainDataset(tokens, 4, pad_id=0)[0]
    assert s["labels"].tolist() == [6, 0, 0, 7]
    assert s["loss_mask"].tolist() == [1.0, 0.0, 0.0, 1.0]


# ---------------------------------------------------------------- loader

SEQ = 4


def _ds(n_samples):
    return PretrainDataset(np.arange(n_samples * SEQ + 1, dtype=np.int64), SEQ)


def _ids(batch):
    return (batch["tokens"][:, 0] // SEQ).tolist()  # sample index, from the arange corpus


def _take(it, steps):
    return [next(it) for _ in range(steps)]


def test_loader_matches_seeded_permutation_and_is_deterministic():
    ds, seed, mbs = _ds(10), 7, 3
    stream = np.concatenate([np.random.RandomState(seed + e).permutation(10) for e in range(3)]).tolist()
    batches = _take(BatchIterator(ds, mbs, seed), 8)
    assert [i for b in batches for i in _ids(b)] == stream[:24]  # straddles epoch boundaries
    again = _take(BatchIterator(ds, mbs, seed), 8)
    for a, b in zip(batches, again):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])
    assert batches[0]["tokens"].shape == (mbs, SEQ) and batches[0]["loss_mask"].dtype == np.float32
    other = _take(BatchIterator(ds, mbs, seed + 1), 8)
    assert [_ids(b) for b in other] != [_ids(b) for b in batches]


@pytest.mark.parametrize("dp_size", [2, 3])
def test_dp_sharding_disjoint_and_covering(dp_size):
    mbs, seed = 2, 3
    n = mbs * dp_size * 5  # one epoch = 5 global steps
    ds = _ds(n)
    iters = [BatchIterator(ds, mbs, seed, dp_rank=r, dp_size=dp_size) for r in range(dp_size)]
    single = BatchIterator(ds, mbs * dp_size, seed)
    seen = []
    for _ in range(5):
        per_rank = [_ids(next(it)) for it in iters]
        assert [i for r in per_rank for i in r] == _ids(next(single))  # contiguous split by rank
        seen += [i for r in per_rank for i in r]
    assert sorted(seen) == list(range(n))  # disjoint + full coverage in one epoch
    assert all(it.state_dict() == {"consumed_samples": n} for it in iters)


def test_resume_reproduces_stream():
    ds, mbs, seed = _ds(13), 3, 11
    full = _take(BatchIterator(ds, mbs, seed, dp_rank=1, dp_size=2), 12)
    it = BatchIterator(ds, mbs, seed, dp_rank=1, dp_size=2)
    _take(it, 5)
    state = it.state_dict()
    assert state == {"consumed_samples": 5 * mbs * 2}
    resumed = BatchIterator(ds, mbs, seed, dp_rank=1, dp_size=2, **state)
    rest = _take(resumed, 7)
    loaded = BatchIterator(ds, mbs, seed, dp_rank=1, dp_size=2)
    loaded.load_state_dict(state)
    for a, b, c in zip(full[5:], rest, _take(loaded, 7)):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])
            np.testing.assert_array_equal(a[k], c[k])
    # Resume with a different dp layout continues the same global stream.
    single = BatchIterator(ds, mbs * 2, seed)
    _take(single, 5)
    r0 = BatchIterator(ds, mbs, seed, dp_rank=0, dp_size=2, **state)
    r1 = BatchIterator(ds, mbs, seed, dp_rank=1, dp_size=2, **state)
    for _ in range(4):
        assert _ids(next(r0)) + _ids(next(r1)) == _ids(next(single))


# ---------------------------------------------------------------- embedded default corpus


@pytest.mark.slow
def test_ensure_default_corpus_builds_once_and_caches(tmp_path):
    cache = str(tmp_path / "cache")
    code = "import sys; from ms_llm.data import ensure_default_corpus as e; print('|'.join(e(sys.argv[1])))"
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = [  # two concurrent "workers": one builds, the other waits on the lock and reuses it
        subprocess.Popen([sys.executable, "-c", code, cache], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1].decode()[-2000:] for o in outs]
    paths = {o[0].decode().strip() for o in outs}
    assert len(paths) == 1
    corpus, model = paths.pop().split("|")
    folder = os.path.dirname(corpus)
    assert sorted(os.listdir(folder)) == ["corpus.jsonl", "meta.json", "tokenizer.model"]  # no temp leftovers
    stamp = {f: os.stat(os.path.join(folder, f)).st_mtime_ns for f in os.listdir(folder)}

    t0 = time.time()
    assert ensure_default_corpus(cache) == (corpus, model)  # cached: no rebuild
    assert time.time() - t0 < 1.0
    assert stamp == {f: os.stat(os.path.join(folder, f)).st_mtime_ns for f in os.listdir(folder)}

    assert os.path.getsize(corpus) > 2_000_000
    docs = list(read_documents(corpus))
    assert len(docs) == len(set(docs)) > 5000
    tok = load_tokenizer(model)
    assert tok.vocab_size == 4096 and tok.eod == 2
    for d in docs[:: len(docs) // 20]:
        assert tok.decode(tok.encode(d)) == d
