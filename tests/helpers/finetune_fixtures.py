"""A tiny fine-tuning setup shared by the DPO / evaluation / SFT-through-the-trainer tests and
their msrun worker: a 2-layer Qwen3 HF folder with its own 32-word tokenizer, instruction,
multi-turn and pairwise JSONL files in its words, and ``ms-llm preprocess`` outputs of them."""
import json
import os
import random

from .hf_fixtures import make_hf_checkpoint

WORDS = ["<eos>", "<unk>"] + [f"w{i}" for i in range(30)]
# Small steps, PyNative, the HF folder's model; a run adds data / stage / output keys.
RUN = ["--data.seq_length", "24", "--training.micro_batch_size", "2",
       "--training.global_batch_size", "4", "--training.progress_bar", "false",
       "--training.lr_warmup_steps", "1", "--training.log_interval", "1",
       "--training.jit", "false", "--training.lr", "1e-3", "--training.min_lr", "1e-4"]


def write_tokenizer(folder) -> None:
    """An HF ``tokenizer.json`` (WordLevel, the 32 ``WORDS``) beside the weights, as HF folders
    ship."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    t = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.add_special_tokens(["<eos>"])
    t.save(os.path.join(str(folder), "tokenizer.json"))


def _words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(30)}" for _ in range(n))


def write_jsonl(path, rows) -> str:
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


def make_hf_folder(folder) -> str:
    make_hf_checkpoint(folder, "qwen3", hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16,
                       ffn=96, vocab=64, tied=False, seed=5)
    write_tokenizer(folder)
    return str(folder)


def pairwise_rows(n: int = 24, seed: int = 0, same: bool = False) -> list:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        chosen = _words(rng, rng.randint(2, 6))
        rows.append({"instruction": _words(rng, rng.randint(2, 5)), "chosen": chosen,
                     "rejected": chosen if same else _words(rng, rng.randint(2, 6))})
    return rows


def alpaca_rows(n: int = 8, seed: int = 1) -> list:
    rng = random.Random(seed)
    return [{"instruction": _words(rng, rng.randint(2, 5)), "output": _words(rng, rng.randint(2, 7))}
            for _ in range(n)]


def sharegpt_rows(n: int = 8, seed: int = 2) -> list:
    """Conversations with two or three assistant turns (every reply is trained)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        turns = []
        for _ in range(rng.randint(2, 3)):
            turns += [{"from": "human", "value": _words(rng, rng.randint(1, 3))},
                      {"from": "gpt", "value": _words(rng, rng.randint(1, 3))}]
        rows.append({"conversations": turns})
    return rows


def preprocess(src: str, hf: str, prefix: str, handler: str, *extra: str) -> str:
    from ms_llm.data.preprocess import main
    assert main(["--input", src, "--tokenizer-name-or-path", hf, "--output-prefix", prefix,
                 "--handler-name", handler, *extra]) == 0
    return prefix
