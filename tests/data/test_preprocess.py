"""``ms-llm preprocess``: outputs, prompt masking (Alpaca / ShareGPT / pairwise, Qwen3 and Llama-3
chat templates), packing, malformed input handling, multi-worker equality.

Expected token sequences are built here from literal template strings (what Qwen3's and
Llama-3's templates render), encoded piece by piece - not with the handlers' helpers."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from ms_llm.data import load_tokenizer
from ms_llm.data.indexed import IndexedDataset
from ms_llm.data.preprocess import main
from helpers.paths import ROOT as REPO

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex my jolly box".split()
SPECIAL = ["<unk>", "<pad>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>",
           "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
IGN = -100

# Qwen3's template (tool branches trimmed; the reasoning / last-query logic kept verbatim).
QWEN3 = """{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}{%- set content = message.content %}{%- else %}{%- set content = '' %}{%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
          "message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
          "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")


def _docs(n=300, seed=0):
    rng = np.random.RandomState(seed)
    return [" ".join(rng.choice(WORDS, size=rng.randint(3, 25))) + "." for _ in range(n)]


@pytest.fixture(scope="module")
def tok_json(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_docs(), trainer=trainer)
    return tok.to_str()


def _tok_dir(root, tok_json, name, cfg):
    d = root / name
    d.mkdir()
    (d / "tokenizer.json").write_text(tok_json, encoding="utf-8")
    if cfg is not None:
        (d / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")
    return str(d)


@pytest.fixture(scope="module")
def toks(tmp_path_factory, tok_json):
    root = tmp_path_factory.mktemp("toks")
    return {
        "qwen3": _tok_dir(root, tok_json, "qwen3", {"eos_token": "<|im_end|>", "pad_token": "<pad>", "chat_template": QWEN3}),
        "llama3": _tok_dir(root, tok_json, "llama3", {"eos_token": "<|eot_id|>", "bos_token": "<|begin_of_text|>",
                                                      "chat_template": LLAMA3}),
        "plain": _tok_dir(root, tok_json, "plain", {"eos_token": "<|endoftext|>"}),
    }


def _jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def _run(*args):
    return main([str(a) for a in args] + ["--log-interval", "100000"])


def _read(prefix):
    return [x.tolist() for x in IndexedDataset(prefix)]


def _expect(tok, segments):
    """segments: [(text, trained)] -> (ids, labels), each piece encoded on its own."""
    ids, labels = [], []
    for text, trained in segments:
        enc = tok.encode(text)
        ids += enc
        labels += enc if trained else [IGN] * len(enc)
    return ids, labels


# ---------------------------------------------------------------- pretraining


def test_pretrain_jsonl_json_txt_round_trip(tmp_path, toks):
    tok = load_tokenizer(toks["plain"])
    docs = _docs(40, seed=1)
    inputs = {
        "a.jsonl": lambda p: _jsonl(p, [{"text": d, "title": d[:7]} for d in docs]),
        "b.json": lambda p: p.write_text(json.dumps([{"text": d, "title": d[:7]} for d in docs], indent=1), encoding="utf-8"),
        "c.txt": lambda p: p.write_text("\n".join(docs) + "\n\n", encoding="utf-8"),
    }
    for name, make in inputs.items():
        make(tmp_path / name)
        keys = ["text"] if name.endswith(".txt") else ["text", "title"]
        out = tmp_path / "out" / name.split(".")[0]
        assert _run("--input", tmp_path / name, "--tokenizer-name-or-path", toks["plain"], "--output-prefix", out,
                    "--append-eod", "--json-keys", *keys) == 0
        seqs = _read(f"{out}_text_document")
        assert IndexedDataset(f"{out}_text_document").dtype == np.uint16  # vocab < 65500
        assert seqs == [tok.encode(d) + [tok.eod] for d in docs], name
        assert [tok.decode(s[:-1]) for s in seqs] == docs
        if "title" in keys:
            assert _read(f"{out}_title_document") == [tok.encode(d[:7]) + [tok.eod] for d in docs]
        assert sorted(f for f in os.listdir(tmp_path / "out") if "tmp" in f) == []
    # without --append-eod nothing is appended
    assert _run("--input", tmp_path / "a.jsonl", "--tokenizer-name-or-path", toks["plain"], "--output-prefix", tmp_path / "n") == 0
    assert _read(f"{tmp_path}/n_text_document") == [tok.encode(d) for d in docs]


def test_workers_2_byte_identical_and_sentencepiece(tmp_path, toks):
    docs = _docs(900, seed=2)
    src = _jsonl(tmp_path / "c.jsonl", [{"text": d} for d in docs])
    assert _run("--input", src, "--tokenizer-name-or-path", toks["plain"], "--output-prefix", tmp_path / "w1",
                "--append-eod", "--chunk-size", "64") == 0
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "ms_llm.data.preprocess", "--input", src, "--tokenizer-name-or-path",
                        toks["plain"], "--output-prefix", str(tmp_path / "w2"), "--append-eod", "--workers", "2",
                        "--chunk-size", "64"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "900 records -> 900 documents" in r.stderr
    for ext in (".bin", ".idx"):
        assert open(f"{tmp_path}/w1_text_document{ext}", "rb").read() == open(f"{tmp_path}/w2_text_document{ext}", "rb").read()

    from ms_llm.data.embedded import _train_sentencepiece

    (tmp_path / "sp").mkdir()
    (tmp_path / "sp" / "tokenizer.model").write_bytes(_train_sentencepiece(docs, vocab_size=300))
    assert _run("--input", src, "--tokenizer-type", "SentencePiece", "--tokenizer-name-or-path", tmp_path / "sp",
                "--output-prefix", tmp_path / "sp_out", "--append-eod") == 0
    sp = load_tokenizer(str(tmp_path / "sp" / "tokenizer.model"))
    assert _read(f"{tmp_path}/sp_out_text_document") == [sp.encode(d) + [sp.eod] for d in docs]


# ---------------------------------------------------------------- malformed input


def test_bad_lines_stop_or_are_skipped(tmp_path, toks, capsys):
    rows = [{"text": "good one"}, '{"text": "broken', {"body": "no text key"}, {"text": 5}, "", {"text": "good two"}, "[1, 2]"]
    src = _jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out" / "x"
    assert _run("--input", src, "--tokenizer-name-or-path", toks["plain"], "--output-prefix", out) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("ms-llm preprocess: ") and f"{src}:2: malformed JSON" in err and "\n" not in err
    assert os.listdir(tmp_path / "out") == []  # nothing, not even temporaries
    assert _run("--input", src, "--tokenizer-name-or-path", toks["plain"], "--output-prefix", out, "--skip-bad-lines") == 0
    err = capsys.readouterr().err
    for line, why in ((2, "malformed JSON"), (3, "missing field 'text'"), (4, "field 'text' must be a string, got int"), (7, "expected a JSON object")):
        assert f"skipping {src}:{line}: {why}" in err
    assert "4 bad lines skipped" in err
    tok = load_tokenizer(toks["plain"])
    assert _read(f"{out}_text_document") == [tok.encode("good one"), tok.encode("good two")]
    # a JSON array with a syntax error cannot be resynchronised: always stops, names the line
    arr = tmp_path / "arr.json"
    arr.write_text('[\n {"text": "a"},\n {"text": "b",,}\n]', encoding="utf-8")
    assert _run("--input", arr, "--tokenizer-name-or-path", toks["plain"], "--output-prefix", tmp_path / "o2", "--skip-bad-lines") == 1
    assert f"{arr}:3: malformed JSON" in capsys.readouterr().err
    assert not any(f.startswith("o2") for f in os.listdir(tmp_path))


def test_flag_errors_are_one_line(tmp_path, toks, capsys):
    src = _jsonl(tmp_path / "a.jsonl", [{"instruction": "q", "output": "a"}])
    cases = [
        (["--pack"], "--pack needs --seq-length"),
        (["--pack", "--seq-length", "8", "--handler-name", "GeneralPretrainHandler"], "--pack applies"),
        (["--prompt-type", "qwen"], "--prompt-type 'qwen' is not implemented"),
        (["--workers", "0"], "--workers must be >= 1"),
    ]
    for extra, msg in cases:
        assert _run("--input", src, "--tokenizer-name-or-path", toks["qwen3"], "--output-prefix", tmp_path / "o",
                    "--handler-name", "AlpacaStyleInstructionHandler", *extra) == 1
        err = capsys.readouterr().err.strip()
        assert msg in err and "\n" not in err, err
    assert _run("--input", tmp_path / "missing.jsonl", "--tokenizer-name-or-path", toks["qwen3"], "--output-prefix", tmp_path / "o") == 1
    assert "missing.jsonl" in capsys.readouterr().err
    assert _run("--input", src, "--tokenizer-name-or-path", tmp_path, "--output-prefix", tmp_path / "o") == 1
    assert "no tokenizer.json" in capsys.readouterr().err
    assert main(["--input", src, "--no-such-flag"]) == 2  # argparse usage error
    assert not any(f.startswith("o_") for f in os.listdir(tmp_path))


# ---------------------------------------------------------------- instruction data


def _sft(prefix):
    return {k: _read(f"{prefix}_packed_{k}_document") for k in ("input_ids", "attention_mask", "labels")}


def test_alpaca_labels_masked_on_prompt(tmp_path, toks):
    rows = [{"instruction": "fox jumps", "input": "over dog", "output": "lazy box."},
            {"instruction": "hex my box", "input": "", "output": "seven wizards.", "system": "quietly"},
            {"instruction": "q2", "output": "a2", "history": [["q1", "a1"]]}]
    src = _jsonl(tmp_path / "a.jsonl", rows)
    expected = {
        "qwen3": [
            [("<|im_start|>user\nfox jumps\nover dog<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n", False),
             ("lazy box.<|im_end|>", True), ("\n", False)],
            [("<|im_start|>system\nquietly<|im_end|>\n<|im_start|>user\nhex my box<|im_end|>\n<|im_start|>assistant\n"
              "<think>\n\n</think>\n\n", False), ("seven wizards.<|im_end|>", True), ("\n", False)],
            [("<|im_start|>user\nq1<|im_end|>\n<|im_start|>assistant\n", False), ("a1<|im_end|>", True),
             ("\n<|im_start|>user\nq2<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n", False),
             ("a2<|im_end|>", True), ("\n", False)],
        ],
        "llama3": [
            [("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nfox jumps\nover dog<|eot_id|>"
              "<|start_header_id|>assistant<|end_header_id|>\n\n", False), ("lazy box.<|eot_id|>", True)],
            [("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nquietly<|eot_id|><|start_header_id|>user"
              "<|end_header_id|>\n\nhex my box<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n", False),
             ("seven wizards.<|eot_id|>", True)],
            [("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nq1<|eot_id|><|start_header_id|>assistant"
              "<|end_header_id|>\n\n", False), ("a1<|eot_id|>", True),
             ("<|start_header_id|>user<|end_header_id|>\n\nq2<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n", False),
             ("a2<|eot_id|>", True)],
        ],
    }
    for name, segs_per_row in expected.items():
        tok = load_tokenizer(toks[name])
        out = tmp_path / name
        assert _run("--input", src, "--tokenizer-name-or-path", toks[name], "--output-prefix", out,
                    "--handler-name", "AlpacaStyleInstructionHandler") == 0
        got = _sft(out)
        for r, segs in enumerate(segs_per_row):
            ids, labels = _expect(tok, segs)
            assert got["input_ids"][r] == ids, (name, r)
            assert got["labels"][r] == labels, (name, r)
            assert got["attention_mask"][r] == [1] * len(ids)
            assert tok.decode(ids) == "".join(s for s, _ in segs)
    # no chat template: prompt + reply + eod, loss on reply + eod only
    plain = load_tokenizer(toks["plain"])
    assert _run("--input", src, "--tokenizer-name-or-path", toks["plain"], "--output-prefix", tmp_path / "plain",
                "--handler-name", "AlpacaStyleInstructionHandler") == 0
    got = _sft(tmp_path / "plain")
    p, a = plain.encode("fox jumps\nover dog"), plain.encode("lazy box.") + [plain.eod]
    assert got["input_ids"][0] == p + a and got["labels"][0] == [IGN] * len(p) + a


def test_sharegpt_multi_turn_loss_on_assistant_only(tmp_path, toks):
    rows = [  # the first reply repeats the user's words: masking must still hit the reply
        {"conversations": [{"from": "human", "value": "fox dog"}, {"from": "gpt", "value": "dog"},
                           {"from": "human", "value": "hex box"}, {"from": "gpt", "value": "jolly wizards"}],
         "system": "be quick"},
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nb"},
                      {"role": "user", "content": "c"}, {"role": "assistant", "content": "<think>\nyes\n</think>\n\nd"}]},
        {"conversations": [{"from": "human", "value": "x"}]},  # no reply -> bad line
        {"conversations": [{"from": "alien", "value": "x"}, {"from": "gpt", "value": "y"}]},
    ]
    src = _jsonl(tmp_path / "s.jsonl", rows)
    tok = load_tokenizer(toks["qwen3"])
    out = tmp_path / "s"
    assert _run("--input", src, "--tokenizer-name-or-path", toks["qwen3"], "--output-prefix", out,
                "--handler-name", "SharegptStyleInstructionHandler") == 1  # bad lines stop by default
    assert _run("--input", src, "--tokenizer-name-or-path", toks["qwen3"], "--output-prefix", out,
                "--handler-name", "SharegptStyleInstructionHandler", "--skip-bad-lines") == 0
    got = _sft(out)
    assert len(got["input_ids"]) == 2
    ids, labels = _expect(tok, [
        ("<|im_start|>system\nbe quick<|im_end|>\n<|im_start|>user\nfox dog<|im_end|>\n<|im_start|>assistant\n", False),
        ("dog<|im_end|>", True),
        ("\n<|im_start|>user\nhex box<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n", False),
        ("jolly wizards<|im_end|>", True), ("\n", False)])
    assert got["input_ids"][0] == ids and got["labels"][0] == labels
    # Reasoning: Qwen3's template drops it from turns before the last query (only the answer is
    # trained there) and keeps it in the final turn, where the model must learn to produce it.
    ids, labels = _expect(tok, [("<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\n", False), ("b<|im_end|>", True),
                                ("\n<|im_start|>user\nc<|im_end|>\n<|im_start|>assistant\n", False),
                                ("<think>\nyes\n</think>\n\nd<|im_end|>", True), ("\n", False)])
    assert got["input_ids"][1] == ids and got["labels"][1] == labels


def test_pairwise_handlers(tmp_path, toks):
    tok = load_tokenizer(toks["llama3"])
    alp = _jsonl(tmp_path / "p.jsonl", [{"instruction": "fox", "input": "", "chosen": "good dog", "rejected": "bad box"}])
    shg = _jsonl(tmp_path / "q.jsonl", [{"conversations": [{"from": "human", "value": "q1"}, {"from": "gpt", "value": "a1"},
                                                           {"from": "human", "value": "fox"}],
                                         "chosen": {"from": "gpt", "value": "good dog"}, "rejected": {"from": "gpt", "value": "bad box"}}])
    head = "<|begin_of_text|>"
    user = "<|start_header_id|>user<|end_header_id|>\n\n{}<|eot_id|>"
    asst = "<|start_header_id|>assistant<|end_header_id|>\n\n"
    prompts = {"AlpacaStylePairwiseHandler": (alp, head + user.format("fox") + asst),
               "SharegptStylePairwiseHandler": (shg, head + user.format("q1") + asst + "a1<|eot_id|>" + user.format("fox") + asst)}
    for handler, (src, prompt) in prompts.items():
        out = tmp_path / handler
        assert _run("--input", src, "--tokenizer-name-or-path", toks["llama3"], "--output-prefix", out, "--handler-name", handler) == 0
        for side, reply in (("chosen", "good dog"), ("rejected", "bad box")):
            ids, labels = _expect(tok, [(prompt, False), (reply + "<|eot_id|>", True)])  # earlier replies are not trained
            assert _read(f"{out}_packed_{side}_input_ids_document") == [ids], (handler, side)
            assert _read(f"{out}_packed_{side}_labels_document") == [labels], (handler, side)


def test_pack_bins_samples_with_segment_ids(tmp_path, toks):
    tok = load_tokenizer(toks["plain"])
    rng = np.random.RandomState(4)
    rows = [{"instruction": " ".join(rng.choice(WORDS, rng.randint(1, 6))), "output": " ".join(rng.choice(WORDS, rng.randint(1, 8)))}
            for _ in range(50)]
    src = _jsonl(tmp_path / "a.jsonl", rows)
    seq = 40
    out = tmp_path / "pk"
    assert _run("--input", src, "--tokenizer-name-or-path", toks["plain"], "--output-prefix", out,
                "--handler-name", "AlpacaStyleInstructionHandler", "--pack", "--seq-length", seq, "--pack-buffer", "16") == 0
    got = _sft(out)
    samples = []
    for ids, seg, lab in zip(got["input_ids"], got["attention_mask"], got["labels"]):
        assert len(ids) == len(seg) == len(lab) == seq
        seg = np.asarray(seg)
        k = seg.max()
        assert (np.diff(seg[seg > 0]) >= 0).all() and set(seg[seg > 0].tolist()) == set(range(1, k + 1))
        assert (seg[np.argmax(seg == 0):] == 0).all() if (seg == 0).any() else True  # padding only at the end
        pad = seg == 0
        assert all(np.asarray(ids)[pad] == tok.pad) and all(np.asarray(lab)[pad] == IGN)
        for j in range(1, k + 1):
            sel = seg == j
            samples.append((tuple(np.asarray(ids)[sel]), tuple(np.asarray(lab)[sel])))
    expected = []
    for r in rows:
        p, a = tok.encode(r["instruction"]), tok.encode(r["output"]) + [tok.eod]
        expected.append((tuple(p + a), tuple([IGN] * len(p) + a)))
    assert sorted(samples) == sorted(expected)  # every sample exactly once, intact
    assert len(got["input_ids"]) < len(rows)  # packing actually combined samples


def test_chat_template_rendering_and_folder_input(tmp_path, toks):
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": " hi "}]
    assert load_tokenizer(toks["llama3"]).apply_chat_template(msgs, add_generation_prompt=True) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\ns<|eot_id|><|start_header_id|>user"
        "<|end_header_id|>\n\nhi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    assert load_tokenizer(toks["qwen3"]).apply_chat_template(msgs[1:], add_generation_prompt=True) == (
        "<|im_start|>user\n hi <|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="no chat_template"):
        load_tokenizer(toks["plain"]).apply_chat_template(msgs)
    # a folder input processes its files in name order into one output
    d = tmp_path / "in"
    d.mkdir()
    _jsonl(d / "b.jsonl", [{"text": "two"}])
    _jsonl(d / "a.jsonl", [{"text": "one"}])
    (d / "notes.md").write_text("ignored", encoding="utf-8")
    assert _run("--input", d, "--tokenizer-name-or-path", toks["plain"], "--output-prefix", tmp_path / "f") == 0
    tok = load_tokenizer(toks["plain"])
    assert _read(f"{tmp_path}/f_text_document") == [tok.encode("one"), tok.encode("two")]
