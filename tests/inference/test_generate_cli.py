"""``ms-llm generate`` / ``ms-llm chat`` through the installed entry point, on a tiny Qwen3 folder
with a byte-level BPE ``tokenizer.json`` and a ChatML ``chat_template`` built here.

* ``--stream`` prints exactly what the non-streamed run prints, which is the Python API's greedy
  continuation decoded (EOS left out);
* a prompt longer than the context is a one-line error naming both lengths;
* ``chat`` with scripted stdin answers every turn with what ``generate`` gives for the whole
  conversation rendered by the template (so earlier turns really are kept), and stops at
  ``exit`` or EOF;
* a training checkpoint (``checkpoint.save_dir``) loads directly, with ``--tokenizer``.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess

import pytest

from helpers import hf_fixtures
from helpers.cli import run_ms_llm

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEXT = ("The quick brown fox jumps over the lazy dog. Streams of tokens become text, and text "
        "becomes tokens again. Hello there, how are you today? Fine, thanks: and you? "
        "Attention is computed over the cached keys and values. ") * 20


def ms_llm(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return run_ms_llm(*args, stdin=stdin, timeout=300)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    path = str(tmp_path_factory.mktemp("chat_model"))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(
        vocab_size=360, special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|im_end|>", "chat_template": CHATML}, f)
    hf_fixtures.make_hf_checkpoint(path, "qwen3", hidden=64, ffn=96, heads=4, kv_heads=2,
                                   vocab=tok.get_vocab_size(), seed=21)
    cfg = hf_fixtures.load_config(path)
    cfg.update(eos_token_id=tok.token_to_id("<|im_end|>"), bos_token_id=None)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def python_continuation(folder: str, ids, max_new: int) -> str:
    from ms_llm.data.tokenizer import load_tokenizer
    from ms_llm.inference import generate
    from ms_llm.checkpoint import from_pretrained
    tok = load_tokenizer(folder)
    out = generate(from_pretrained(folder), [ids], max_new, eos_token_id=tok.eod)[0, len(ids):]
    return tok.decode([t for t in out if t != tok.eod])


def test_generate_stream_equals_plain_equals_python(folder):
    from ms_llm.data.tokenizer import load_tokenizer
    args = ["generate", "--load", folder, "--prompt", "Hello there, how", "--max-new-tokens",
            "24"]
    plain, streamed = ms_llm(*args), ms_llm(*args, "--stream")
    assert plain.returncode == 0, plain.stderr
    assert streamed.returncode == 0, streamed.stderr
    assert streamed.stdout == plain.stdout
    ids = load_tokenizer(folder).encode("Hello there, how")
    assert plain.stdout == python_continuation(folder, ids, 24) + "\n"
    assert len(plain.stdout.strip()) > 0


def test_sampling_flags_and_seed(folder):
    args = ["generate", "--load", folder, "--prompt", "The quick", "--max-new-tokens", "16",
            "--temperature", "1.2", "--top-k", "50", "--top-p", "0.95"]
    a, b = ms_llm(*args, "--seed", "1"), ms_llm(*args, "--seed", "1", "--stream")
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout


def test_prompt_longer_than_context_is_one_line_error(folder):
    r = ms_llm("generate", "--load", folder, "--prompt", "The quick brown fox jumps over",
               "--max-context", "3")
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.strip().splitlines() if not ln.startswith("[WARNING] ME(")]
    assert len(lines) == 1, r.stderr
    assert "longer than the model's context of 3 tokens" in lines[0]
    n = int(lines[0].split("the prompt is ")[1].split()[0])
    assert n > 3


def test_max_new_tokens_beyond_the_context_is_capped_and_said(folder):
    """A budget past the context is shortened with a note naming both numbers (never silently),
    and a prompt that fills the context is a one-line error."""
    from ms_llm.data.tokenizer import load_tokenizer
    prompt = "The quick brown fox jumps over"
    n = len(load_tokenizer(folder).encode(prompt))
    r = ms_llm("generate", "--load", folder, "--prompt", prompt, "--max-context", str(n + 3),
               "--max-new-tokens", "10")
    assert r.returncode == 0, r.stderr
    assert f"--max-new-tokens 10 capped at 3 (prompt {n} tokens, context {n + 3})" in r.stderr
    r = ms_llm("generate", "--load", folder, "--prompt", prompt, "--max-context", str(n))
    assert r.returncode == 2
    assert "fills the model's context" in r.stderr and "no room to generate" in r.stderr


def test_chat_keeps_the_conversation(folder):
    from ms_llm.data.tokenizer import load_tokenizer
    tok = load_tokenizer(folder)
    turns = ["Hello there", "how are you today?"]
    r = ms_llm("chat", "--load", folder, "--system", "Be brief.", "--max-new-tokens", "12",
               stdin="\n".join(turns) + "\nexit\nnever read\n")
    assert r.returncode == 0, r.stderr
    messages = [{"role": "system", "content": "Be brief."}]
    expected = ""
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))
        reply = python_continuation(folder, ids, 12)
        messages.append({"role": "assistant", "content": reply})
        expected += reply + "\n"
    assert r.stdout == expected


def test_chat_ends_at_eof(folder):
    r = ms_llm("chat", "--load", folder, "--max-new-tokens", "4", stdin="Hi")
    assert r.returncode == 0, r.stderr
    assert r.stdout.endswith("\n") and r.stdout.count("\n") == 1


def test_training_checkpoint_loads_directly(folder, tmp_path):
    from ms_llm.checkpoint import from_pretrained
    from ms_llm.parallel.parallelize import describe_layouts
    from ms_llm.parallel.state import initialize_model_parallel
    from ms_llm.training import checkpointing as ckpt
    from ms_llm.optim import AdamW
    model = from_pretrained(folder)
    describe_layouts(model)
    named = list(model.named_parameters())
    save_dir = str(tmp_path / "ckpt")
    ckpt.save(save_dir, 1, named, AdamW([(n, p) for n, p in named if p.requires_grad]),
              initialize_model_parallel(),
              {"step": 1, "model_config": dataclasses.asdict(model.config)},
              barrier=lambda: None, rank=0, world=1)
    args = ["--prompt", "Hello there, how", "--max-new-tokens", "12"]
    want = ms_llm("generate", "--load", folder, *args)
    got = ms_llm("generate", "--load", save_dir, "--tokenizer", folder, *args)
    assert got.returncode == 0, got.stderr
    assert got.stdout == want.stdout
    missing = ms_llm("generate", "--load", save_dir, *args)
    assert missing.returncode == 2 and "pass --tokenizer" in missing.stderr


def test_chat_session_prefills_only_the_new_turn(folder, monkeypatch):
    from ms_llm.data.tokenizer import load_tokenizer
    from ms_llm.inference import ChatSession, KVCache
    from ms_llm.checkpoint import from_pretrained
    tok = load_tokenizer(folder)
    session = ChatSession(from_pretrained(folder), tok, [tok.eod], max_context=2048,
                          max_new_tokens=6)
    crops = []
    monkeypatch.setattr(KVCache, "crop", lambda self, n, _crop=KVCache.crop:
                        (crops.append(n), _crop(self, n))[1])
    session.send("Hello there")
    first = tok.encode(tok.apply_chat_template(session.messages[:1],
                                               add_generation_prompt=True))
    session.send("how are you today?")
    second = tok.encode(tok.apply_chat_template(session.messages[:3],
                                                add_generation_prompt=True))
    assert crops[0] == 0 and crops[1] >= len(first)      # the first turn is not recomputed
    assert second[:crops[1]] == [int(t) for t in session.fed[:crops[1]]]
    assert session.cache.length == len(session.fed)
