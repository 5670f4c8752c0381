"""Evaluation (``training.eval_interval`` / ``eval_iters``) over the ``data.split`` validation
part: rows at every interval and at the end, values equal to a loss computed here from the
model's logits on the same validation samples, and training unchanged by evaluating.

Tolerance: the reference is NumPy float64 cross entropy on the model's fp32 logits; the
trainer reduces in fp32 (per-token losses, then sums of <= 8 x 24 tokens): rtol 1e-5.
"""
import json
import math

import numpy as np
import pytest
from mindspore import Tensor

from helpers.finetune_fixtures import RUN, alpaca_rows, make_hf_folder, preprocess, write_jsonl
from ms_llm.config import ConfigError, load_config
from ms_llm.data import SFTDataset, load_tokenizer, tokenize_corpus
from ms_llm.training.trainer import Trainer

RTOL = 1e-5


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("evaluate")
    make_hf_folder(root / "hf")
    (root / "corpus.txt").write_text("\n\n".join(" ".join(f"w{(i * j + j) % 30}" for j in range(50))
                                                 for i in range(12)))
    preprocess(write_jsonl(root / "sft.jsonl", alpaca_rows(20)), str(root / "hf"),
               str(root / "sft"), "AlpacaStyleInstructionHandler")
    return root


def cfg_of(root, out, *extra):
    return load_config(None, ["--checkpoint.load", str(root / "hf"), "--data.tokenizer",
                              str(root / "hf"), *RUN, "--training.output_dir", str(out), *extra])


def np_mean_nll(model, tokens, labels, mask, attention_mask=None):
    kw = {} if attention_mask is None else {"attention_mask": Tensor(attention_mask)}
    logits = model(Tensor(tokens), **kw).asnumpy().astype(np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, labels[..., None].astype(np.int64), -1)[..., 0]
    return float((nll * mask).sum() / mask.sum())


def rows_of(out):
    return [json.loads(line) for line in open(out / "metrics.jsonl")]


def test_pretraining_eval_rows_and_values(root, tmp_path):
    """Corpus windows split 70/30; eval every 2 steps and at the end (step 3)."""
    ev = ["--data.corpus", str(root / "corpus.txt"), "--data.split", "70,30,0",
          "--training.max_steps", "3", "--training.eval_interval", "2",
          "--training.eval_iters", "2"]
    trainer = Trainer(cfg_of(root, tmp_path / "a", *ev))
    trainer.fit()
    rows = rows_of(tmp_path / "a")
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 3]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3]
    # The final evaluation (the second one) reads validation windows 2*gbs .. 4*gbs - 1 in order.
    s, gbs = 24, 4
    tokens = np.asarray(tokenize_corpus(str(root / "corpus.txt"),
                                        load_tokenizer(str(root / "hf"))), np.int32)
    n = (len(tokens) - 1) // s
    # Megatron's _get_split_indices: round each part, then shift the bounds so they end at n.
    b1 = int(round(0.7 * n))
    b2 = b1 + int(round(0.3 * n))
    lo = b1 - (b2 - n)
    idx = [lo + (i % (n - lo)) for i in range(2 * gbs, 4 * gbs)]
    win = np.stack([tokens[i * s:i * s + s + 1] for i in idx])
    want = np_mean_nll(trainer.model, win[:, :-1], win[:, 1:], np.ones((len(idx), s)))
    assert evals[1]["eval_loss"] == pytest.approx(want, rel=RTOL)
    assert evals[1]["eval_ppl"] == pytest.approx(math.exp(want), rel=RTOL)

    # Evaluating changes nothing in training: the same run without it has the same losses.
    plain = Trainer(cfg_of(root, tmp_path / "b", *ev[:-4])).fit()
    assert [r["loss"] for r in plain] == [r["loss"] for r in rows if "loss" in r]
    assert [r["grad_norm"] for r in plain] == [r["grad_norm"] for r in rows if "loss" in r]


def test_sft_eval_values(root, tmp_path):
    """Indexed SFT samples split 60/40 (20 samples: train 0..11, validation 12..19); one
    evaluation at the end over eval_iters=2 global batches = all 8 validation samples."""
    trainer = Trainer(cfg_of(root, tmp_path, "--data.data_path", str(root / "sft"),
                             "--data.dataset_type", "sft", "--data.split", "60,40,0",
                             "--training.max_steps", "1", "--training.eval_interval", "5",
                             "--training.eval_iters", "2"))
    trainer.fit()
    evals = [r for r in rows_of(tmp_path) if "eval_loss" in r]
    assert [r["step"] for r in evals] == [1]
    ds = SFTDataset(str(root / "sft"), 24, pad_id=load_tokenizer(str(root / "hf")).pad)
    b = [ds[i] for i in range(12, 20)]
    want = np_mean_nll(trainer.model, np.stack([r["tokens"] for r in b]),
                       np.stack([r["labels"] for r in b]), np.stack([r["loss_mask"] for r in b]),
                       np.stack([r["attention_mask"] for r in b]))
    assert evals[0]["eval_loss"] == pytest.approx(want, rel=RTOL)


def test_megatron_dataset_eval_and_missing_validation_split(root, tmp_path):
    from ms_llm.data.preprocess import main
    docs = write_jsonl(root / "docs.jsonl", [{"text": " ".join(f"w{(i + j) % 30}" for j in range(30))}
                                             for i in range(30)])
    assert main(["--input", docs, "--tokenizer-name-or-path", str(root / "hf"),
                 "--output-prefix", str(root / "pt"), "--append-eod"]) == 0
    data = ["--data.data_path", str(root / "pt_text_document"), "--training.max_steps", "2",
            "--training.eval_interval", "1", "--training.eval_iters", "1"]
    Trainer(cfg_of(root, tmp_path, *data, "--data.split", "80,20,0")).fit()
    evals = [r for r in rows_of(tmp_path) if "eval_loss" in r]
    assert [r["step"] for r in evals] == [1, 2] and all(np.isfinite(r["eval_loss"]) for r in evals)
    assert evals[0]["eval_loss"] != evals[1]["eval_loss"]   # new samples, new weights
    with pytest.raises(ConfigError) as e:
        Trainer(cfg_of(root, tmp_path, *data))
    assert str(e.value) == ("command line --training.eval_interval: training.eval_interval "
                            "needs validation samples, but data.split '100,0,0' gives none")
