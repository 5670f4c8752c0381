"""SFT / pairwise datasets: next-token shift, prompt masking, packed rows with per-sample causal
masks and restarting positions (expected values written out by hand or built with loops here)."""
import numpy as np
import pytest

from ms_llm.data import BatchIterator, PairwiseDataset, SFTDataset, open_sft_dataset
from ms_llm.data.indexed import write_indexed_dataset
from ms_llm.data.packing import first_fit_decreasing

IGN = -100


def _write(prefix, rows):
    for key in rows[0]:
        write_indexed_dataset(f"{prefix}_packed_{key}_document", [r[key] for r in rows], np.int32)


def test_unpacked_sample_shift_pad_truncate(tmp_path):
    p = str(tmp_path / "s")
    _write(p, [
        {"input_ids": [11, 12, 13, 14, 15], "attention_mask": [1] * 5, "labels": [IGN, IGN, 13, 14, 15]},
        {"input_ids": list(range(20, 30)), "attention_mask": [1] * 10, "labels": [IGN] * 4 + list(range(24, 30))},
    ])
    ds = SFTDataset(p, 6, pad_id=0)
    a = ds[0]
    assert a["tokens"].tolist() == [11, 12, 13, 14, 15, 0]
    assert a["labels"].tolist() == [0, 13, 14, 15, 0, 0]
    assert a["loss_mask"].tolist() == [0, 1, 1, 1, 0, 0]
    assert a["position_ids"].tolist() == [0, 1, 2, 3, 4, 0]
    assert a["attention_mask"].shape == (1, 6, 6)
    causal = ~np.tri(6, dtype=bool)
    assert (a["attention_mask"][0, :5, :5] == causal[:5, :5]).all()
    b = ds[1]  # truncated to 6 positions
    assert b["tokens"].tolist() == list(range(20, 26))
    assert b["labels"].tolist() == [0, 0, 0, 24, 25, 0] and b["loss_mask"].tolist() == [0, 0, 0, 1, 1, 0]
    assert len(ds) == 2 and ds[-1]["tokens"].tolist() == b["tokens"].tolist()
    with pytest.raises(IndexError):
        ds[2]


def test_packed_rows_have_block_diagonal_masks(tmp_path):
    # one packed row of 8: sample 1 = [1,2,3] (prompt 1, reply 2 3), sample 2 = [4,5,6,7] (5 is
    # prompt; 4 is given a label on purpose so only the boundary rule can mask "3 predicts 4"), pad
    p = str(tmp_path / "pk")
    _write(p, [{"input_ids": [1, 2, 3, 4, 5, 6, 7, 0], "attention_mask": [1, 1, 1, 2, 2, 2, 2, 0],
                "labels": [IGN, 2, 3, 4, IGN, 6, 7, IGN]}])
    row = SFTDataset(p, 8, pad_id=0)[0]
    assert row["labels"].tolist() == [2, 3, 0, 0, 6, 7, 0, 0]
    assert row["loss_mask"].tolist() == [1, 1, 0, 0, 1, 1, 0, 0]  # 3 must not predict sample 2's first token
    assert row["position_ids"].tolist() == [0, 1, 2, 0, 1, 2, 3, 0]
    allowed = np.zeros((8, 8), dtype=bool)  # built by hand: causal within [0,3) and [3,7); pad sees itself
    for lo, hi in ((0, 3), (3, 7)):
        for q in range(lo, hi):
            allowed[q, lo:q + 1] = True
    allowed[7, 7] = True
    assert row["attention_mask"][0].tolist() == (~allowed).tolist()


def test_pairwise_dataset_and_autodetect(tmp_path):
    p = str(tmp_path / "dpo")
    _write(p, [{"chosen_input_ids": [5, 6, 7], "chosen_labels": [IGN, 6, 7],
                "rejected_input_ids": [5, 8, 9, 10], "rejected_labels": [IGN, 8, 9, 10]}])
    ds = open_sft_dataset(p, 5, pad_id=0)
    assert isinstance(ds, PairwiseDataset)
    r = ds[0]
    assert r["chosen_tokens"].tolist() == [5, 6, 7, 0, 0] and r["chosen_labels"].tolist() == [6, 7, 0, 0, 0]
    assert r["chosen_loss_mask"].tolist() == [1, 1, 0, 0, 0]
    assert r["rejected_tokens"].tolist() == [5, 8, 9, 10, 0] and r["rejected_loss_mask"].tolist() == [1, 1, 1, 0, 0]
    with pytest.raises(FileNotFoundError, match="_packed_input_ids_document"):
        open_sft_dataset(str(tmp_path / "nothing"), 5, pad_id=0)


def test_first_fit_decreasing():
    assert first_fit_decreasing([5, 3, 4, 2, 6], 8) == [[4, 3], [0, 1], [2]]  # 6+2, 5+3, 4
    bins = first_fit_decreasing(list(np.random.RandomState(0).randint(1, 9, size=200)), 10)
    assert sorted(i for b in bins for i in b) == list(range(200))
    with pytest.raises(ValueError, match="exceeds"):
        first_fit_decreasing([11], 10)


def test_loader_batches_sft_rows(tmp_path):
    p = str(tmp_path / "s")
    _write(p, [{"input_ids": [i, i + 1, i + 2], "attention_mask": [1, 1, 1], "labels": [IGN, i + 1, i + 2]} for i in range(0, 30, 3)])
    it = BatchIterator(SFTDataset(p, 4, pad_id=0), 2, seed=3, dp_rank=1, dp_size=2)
    b = next(it)
    assert b["tokens"].shape == (2, 4) and b["attention_mask"].shape == (2, 1, 4, 4) and b["position_ids"].shape == (2, 4)
    perm = np.random.RandomState(3).permutation(10)
    assert (b["tokens"][:, 0] // 3).tolist() == perm[2:4].tolist()


def test_packed_row_through_model_equals_separate_documents():
    """End to end: with the packed mask, each document's logits in a GPTModel equal those of the
    document run alone. (RoPE scores depend only on q-k distance, so this holds before the model
    takes position_ids; it fails if any token attends across the boundary.)"""
    import mindspore as ms
    from ms_llm.models import GPTModel, TransformerConfig

    cfg = TransformerConfig(num_layers=2, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4,
                            num_query_groups=2, padded_vocab_size=64)
    np.random.seed(0)
    model = GPTModel(cfg)
    rng = np.random.RandomState(1)
    docs = [rng.randint(1, 64, size=n).tolist() for n in (5, 7, 3)]
    ids = sum(docs, []) + [0]
    seg = sum(([j + 1] * len(d) for j, d in enumerate(docs)), []) + [0]
    p = {"input_ids": ids, "attention_mask": seg, "labels": ids}
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        _write(f"{d}/pk", [p])
        row = SFTDataset(f"{d}/pk", len(ids), pad_id=0)[0]
    packed = model(ms.Tensor(row["tokens"][None]), attention_mask=ms.Tensor(row["attention_mask"][None])).asnumpy()[0]
    start = 0
    for doc in docs:
        alone = model(ms.Tensor(np.asarray([doc], dtype=np.int32))).asnumpy()[0]
        np.testing.assert_allclose(packed[start:start + len(doc)], alone, rtol=1e-4, atol=1e-5)  # fp32 reassociation only
        start += len(doc)
    causal_only = model(ms.Tensor(row["tokens"][None])).asnumpy()[0]
    assert np.abs(causal_only[5:12] - packed[5:12]).max() > 1e-3  # without the mask, document 2 sees document 1
