"""A tiny HF checkpoint with a byte-level BPE tokenizer, and tiny benchmark files in each format
``ms-llm evaluate`` reads (written here; nothing is downloaded).

The model is random, but the output rows of the answer tokens (``A`` ... ``D`` and the digits)
are scaled up, so greedy replies often start with an answer letter or contain numbers: the
generation-scored tasks then get accuracies strictly between 0 and 1 instead of a trivial 0.
"""
from __future__ import annotations

import csv
import json
import os

import numpy as np

from . import hf_fixtures

TEXT = ("The following are multiple choice questions (with answers) about biology.\n\n"
        "What is the cell? A. B. C. D. Answer: A Answer: B Answer: C Answer: D "
        "Question: Let's think step by step The answer is 42 17 8 3 0 1 2 5 6 7 9 "
        "def f(x):\n    return x + 1\n Yes No passage true false ") * 30
EOS = "<|endoftext|>"


def make_model(path: str, seed: int = 11) -> str:
    from safetensors.numpy import load_file, save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    os.makedirs(path, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(
        vocab_size=320, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": EOS, "tokenizer_class": "PreTrainedTokenizerFast"}, f)
    hf_fixtures.make_hf_checkpoint(path, "qwen3", hidden=64, ffn=96, heads=4, kv_heads=2,
                                   vocab=tok.get_vocab_size(), seed=seed, tied=False)
    cfg = hf_fixtures.load_config(path)
    cfg.update(eos_token_id=tok.token_to_id(EOS), bos_token_id=None)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    weights = load_file(os.path.join(path, "model.safetensors"))
    head = weights["lm_head.weight"].copy()
    for pieces, scale in ((["A", "B", "C", "D", " A", " B", " C", " D"], 8.0), (list("0123456789"), 5.0)):
        for i in sorted({tok.encode(p).ids[-1] for p in pieces}):
            head[i] *= scale
    weights["lm_head.weight"] = head
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path


def _mc_rows(rng, n, subject):
    return [[f"{subject} question {i}: which is {rng.integers(100)}?", f"alpha {i}",
             f"beta {i}", f"gamma {i}", f"delta {i}", "ABCD"[rng.integers(4)]] for i in range(n)]


def write_mmlu(root: str, header: bool = False, n: int = 3) -> str:
    """``root/test/{s}_test.csv`` (or C-Eval's ``val/{s}_val.csv`` with a header) and
    ``root/dev/{s}_dev.csv`` for two subjects."""
    rng = np.random.default_rng(5 if header else 4)
    split = "val" if header else "test"
    for sub in (split, "dev"):
        os.makedirs(os.path.join(root, sub), exist_ok=True)
    for subject in ("college_biology", "astronomy"):
        for sub, rows in ((split, _mc_rows(rng, n, subject)), ("dev", _mc_rows(rng, 3, subject))):
            with open(os.path.join(root, sub, f"{subject}_{sub}.csv"), "w", newline="") as f:
                w = csv.writer(f)
                if header:
                    w.writerow(["id", "question", "A", "B", "C", "D", "answer", "explanation"])
                    rows = [[i, *r, ""] for i, r in enumerate(rows)]
                w.writerows(rows)
    return os.path.join(root, split)


def write_jsonl(path: str, rows) -> None:
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def write_boolq(root: str, n: int = 6) -> str:
    os.makedirs(root, exist_ok=True)
    write_jsonl(os.path.join(root, "dev.jsonl"), [
        {"question": f"is {i} even", "passage": f"passage {i} about numbers", "title": "t",
         "answer": bool(i % 3)} for i in range(n)])
    return root


def write_gsm8k(root: str, n: int = 4) -> str:
    os.makedirs(root, exist_ok=True)
    write_jsonl(os.path.join(root, "train.jsonl"), [
        {"question": f"What is {i} plus 1?", "answer": f"{i} + 1 = <<{i}+1={i + 1}>>{i + 1}\n"
                                                      f"#### {i + 1}"} for i in range(2)])
    write_jsonl(os.path.join(root, "test.jsonl"), [
        {"question": f"How many is {i} times 2?", "answer": f"{i} * 2\n#### {2 * i}"}
        for i in range(n)])
    return root


HUMAN_EVAL = [
    # passes whatever the model writes: the completion lands inside a raw string literal
    {"task_id": "t/0", "entry_point": "inc",
     "prompt": "def inc(x):\n    return x + 1\n\nNOTE = r'''",
     "test": "'''\n\ndef check(f):\n    assert f(1) == 2\n"},
    # fails whatever the model writes: the check is wrong
    {"task_id": "t/1", "entry_point": "inc",
     "prompt": "def inc(x):\n    return x + 1\n\nNOTE = r'''",
     "test": "'''\n\ndef check(f):\n    assert f(1) == 3\n"},
    # times out
    {"task_id": "t/2", "entry_point": "inc",
     "prompt": "def inc(x):\n    return x + 1\n\nNOTE = r'''",
     "test": "'''\n\ndef check(f):\n    while True:\n        pass\n"},
]


def write_human_eval(root: str) -> str:
    os.makedirs(root, exist_ok=True)
    write_jsonl(os.path.join(root, "HumanEval.jsonl"), HUMAN_EVAL)
    return root
