"""The qualification runs' data: a 35-word tokenizer (so the output layer is 128 rows, or 35
with ``make_vocab_size_divisible_by 1`` for uneven FSDP shards), a small corpus in its words, and a
preprocessed pairwise (DPO) dataset. Deterministic, written once per output folder."""
from __future__ import annotations

import json
import os
import random
from typing import Dict, List

WORDS = ["<eos>", "<unk>"] + [f"w{i}" for i in range(33)]


def _atomic_write(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def _words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(len(WORDS) - 2)}" for _ in range(n))


def prepare(root: str) -> Dict[str, List[str]]:
    """Write the data under ``root``; return the config overrides per data kind:
    ``corpus`` (pretraining) and ``pairs`` (DPO)."""
    tok_dir = os.path.join(root, "tokenizer")
    tok = os.path.join(tok_dir, "tokenizer.json")
    corpus = os.path.join(root, "corpus.txt")
    pairs = os.path.join(root, "pairs")
    os.makedirs(tok_dir, exist_ok=True)
    if not os.path.isfile(tok):
        from tokenizers import Tokenizer, models, pre_tokenizers
        t = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
        t.pre_tokenizer = pre_tokenizers.Whitespace()
        t.add_special_tokens(["<eos>"])
        _atomic_write(tok, t.to_str())
    if not os.path.isfile(corpus):
        # periodic word patterns: learnable, so the loss falls within a few steps
        _atomic_write(corpus, "\n\n".join(" ".join(f"w{(i * j + i) % 33}" for j in range(48))
                                          for i in range(60)))
    if not os.path.isfile(pairs + "_packed_chosen_input_ids_document.idx"):
        # learnable preference: chosen answers use the low words, rejected ones the high
        # words, so the DPO loss falls on pairs a step has not seen
        rng = random.Random(0)
        rows = []
        for _ in range(48):
            n = rng.randint(2, 6)
            rows.append({"instruction": _words(rng, rng.randint(2, 5)),
                         "chosen": " ".join(f"w{rng.randrange(0, 12)}" for _ in range(n)),
                         "rejected": " ".join(f"w{rng.randrange(21, 33)}" for _ in range(n))})
        src = os.path.join(root, "pairs.jsonl")
        _atomic_write(src, "".join(json.dumps(r) + "\n" for r in rows))
        import contextlib
        import io
        from ms_llm.data.preprocess import main as preprocess
        said = io.StringIO()      # its summary line is noise unless it fails
        with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
            rc = preprocess(["--input", src, "--tokenizer-name-or-path", tok_dir,
                             "--output-prefix", pairs, "--handler-name",
                             "AlpacaStylePairwiseHandler", "--log-interval", "1000"])
        if rc != 0:
            raise RuntimeError(f"qualify: preprocessing {src} failed (exit {rc}): "
                               f"{said.getvalue().strip()[-300:]}")
    return {"corpus": ["--data.corpus", corpus, "--data.tokenizer", tok],
            "pairs": ["--data.data_path", pairs, "--data.tokenizer", tok_dir]}
