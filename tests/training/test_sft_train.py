"""SFT through ``ms-llm train``: single-sample, packed and multi-turn instruction data, from an
HF folder, preprocessed by ``ms-llm preprocess``, trained by the CLI.

Each run's global batch holds every sample exactly once, so its first logged loss is the
token-mean next-token loss over all replies whatever the order or packing. The reference
computes that here from the stored ``input_ids`` / ``labels`` (-100 off the loss), running the
starting weights on each sample alone: no SFT dataset code, no packing masks. Tolerance rtol
1e-5: NumPy float64 on the model's fp32 logits against the trainer's fp32 reductions.
"""
import json

import numpy as np
import pytest
from mindspore import Tensor

from helpers.cli import last_wins
from helpers.finetune_fixtures import (RUN, alpaca_rows, make_hf_folder, preprocess, sharegpt_rows,
                               write_jsonl)
from ms_llm.cli import main as cli_main
from ms_llm.data.indexed import IndexedDataset
from ms_llm.checkpoint import from_pretrained

IGN = -100
SEQ = "32"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft_train")
    hf = make_hf_folder(root / "hf")
    preprocess(write_jsonl(root / "alpaca.jsonl", alpaca_rows(8)), hf, str(root / "single"),
               "AlpacaStyleInstructionHandler")
    preprocess(str(root / "alpaca.jsonl"), hf, str(root / "packed"),
               "AlpacaStyleInstructionHandler", "--pack", "--seq-length", SEQ)
    preprocess(write_jsonl(root / "chat.jsonl", sharegpt_rows(8)), hf, str(root / "multi"),
               "SharegptStyleInstructionHandler")
    return root


def reference_loss(root, prefix: str) -> float:
    """Token-mean loss of the unpacked samples under the starting weights, each alone."""
    model = from_pretrained(str(root / "hf"))
    ids = IndexedDataset(f"{prefix}_packed_input_ids_document")
    labels = IndexedDataset(f"{prefix}_packed_labels_document")
    total, count = 0.0, 0
    for i in range(len(ids)):
        x, y = np.asarray(ids[i], np.int32), np.asarray(labels[i], np.int64)
        logits = model(Tensor(x[None])).asnumpy()[0].astype(np.float64)
        logp = logits - logits.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        for t in range(len(x) - 1):
            if y[t + 1] != IGN:
                total -= logp[t, y[t + 1]]
                count += 1
    return total / count


def train(root, out, prefix, batch, *extra):
    args = ["train", "--checkpoint.load", str(root / "hf"), "--data.tokenizer", str(root / "hf"),
            *RUN, "--data.seq_length", SEQ, "--data.data_path", prefix, "--data.dataset_type",
            "sft", "--training.micro_batch_size", "1" if batch % 2 else "2",
            "--training.global_batch_size", str(batch), "--training.max_steps", "2",
            "--training.output_dir", str(out),
            # Megatron's schedule applies lr_warmup_init (0) at iteration 1: no warmup, so
            # step 1 updates and step 2's loss is lower
            "--training.lr_warmup_steps", "0", *extra]
    assert cli_main(last_wins(args)) == 0
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["loss"] < rows[0]["loss"]
    return rows


def test_single_sample_sft(root, tmp_path):
    rows = train(root, tmp_path, str(root / "single"), 8)
    assert rows[0]["loss"] == pytest.approx(reference_loss(root, str(root / "single")), rel=1e-5)


def test_packed_sft_equals_the_samples_alone(root, tmp_path):
    packed_rows = len(IndexedDataset(str(root / "packed") + "_packed_input_ids_document"))
    assert packed_rows < 8                       # several samples share a row
    rows = train(root, tmp_path, str(root / "packed"), packed_rows,
                 "--data.reset_position_ids", "true", "--data.reset_attention_mask", "true")
    assert rows[0]["loss"] == pytest.approx(reference_loss(root, str(root / "single")), rel=1e-5)


def test_multi_turn_sft_trains_every_reply(root, tmp_path):
    labels = IndexedDataset(str(root / "multi") + "_packed_labels_document")
    spans = [int(np.sum(np.diff((np.asarray(labels[i]) != IGN).astype(int)) == 1))
             for i in range(len(labels))]
    assert min(spans) >= 2                       # two or more trained replies per conversation
    rows = train(root, tmp_path, str(root / "multi"), 8)
    assert rows[0]["loss"] == pytest.approx(reference_loss(root, str(root / "multi")), rel=1e-5)
