"""``ms-llm generate`` / ``chat`` bad inputs (issue #41), in-process: a non-floating ``--dtype``,
invalid UTF-8 in ``--prompt`` or on chat's stdin, and a chat template over its time or size
bound each end in one line on stderr, exit code 2."""
import io
import json
import os

import pytest

from helpers.finetune_fixtures import make_hf_folder
from ms_llm.cli import chat, generate
from ms_llm.data import chat_template

LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
PRINT = "{% for i in range(100000) %}{% for j in range(100000) %}xxxx{% endfor %}{% endfor %}"


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return make_hf_folder(tmp_path_factory.mktemp("gen_bad") / "hf")


def with_template(hf, tmp_path, template):
    d = tmp_path / "hf"
    os.makedirs(d)
    for n in os.listdir(hf):
        os.symlink(os.path.join(hf, n), d / n)
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>",
                                                         "chat_template": template}))
    return str(d)


def one_line(capsys):
    err = [ln for ln in capsys.readouterr().err.splitlines()
           if ln.strip() and not ln.startswith("[WARNING] ME(")]
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


@pytest.mark.parametrize("dtype", ["int32", "bool"])
def test_dtype_must_be_floating(hf, capsys, dtype):
    assert generate.main(["--load", hf, "--prompt", "w1", "--dtype", dtype]) == 2
    assert one_line(capsys) == (f"ms-llm generate: --dtype {dtype}: dtype '{dtype}' is not a "
                                f"floating type (parameters: float32, bfloat16, float16)")
    from ms_llm.checkpoint import from_pretrained
    with pytest.raises(ValueError, match="is not a floating type"):
        from_pretrained(hf, dtype=dtype)


def test_prompt_not_utf8(hf, capsys):
    bad = b"w1 \xff w2".decode("utf-8", "surrogateescape")   # as Python keeps argv bytes
    assert generate.main(["--load", hf, "--prompt", bad, "--max-new-tokens", "1"]) == 2
    assert one_line(capsys) == ("ms-llm generate: --prompt is not valid UTF-8 (byte 0xff at "
                                "character 3)")


def test_chat_stdin_not_utf8(hf, tmp_path, capsys):
    d = with_template(hf, tmp_path, "{{ messages[-1]['content'] }}")
    stdin = io.TextIOWrapper(io.BytesIO(b"w1 w2\n\xfe w3\n"), encoding="utf-8")
    assert chat.main(["--load", d, "--max-new-tokens", "1"], stdin=stdin, out=io.StringIO()) == 2
    assert one_line(capsys) == "ms-llm chat: stdin is not valid UTF-8 (byte 0xfe)"
    stdin = io.TextIOWrapper(io.BytesIO(b"\xfe w3\n"), encoding="utf-8",
                             errors="surrogateescape")
    assert chat.main(["--load", d, "--max-new-tokens", "1"], stdin=stdin, out=io.StringIO()) == 2
    assert one_line(capsys) == "ms-llm chat: stdin is not valid UTF-8 (byte 0xfe at character 0)"


@pytest.mark.parametrize("template,message", [
    (LOOP, "ms-llm chat: chat_template: rendering took longer than 2 s (a runaway loop?)"),
    (PRINT, "ms-llm chat: chat_template: the rendered text exceeds 4194304 characters "
            "(a runaway loop?)"),
    ("{{ 'x' * 10000000 }}", "ms-llm chat: chat_template: a sequence of 1 x 10000000 items "
                             "exceeds 4194304 (a runaway template?)"),
    ("{{ 7 ** 1000000 }}", "ms-llm chat: chat_template: 7 ** 1000000 is too large to compute"),
    ("{{ nope() }}", "ms-llm chat: chat_template: UndefinedError: 'nope' is undefined"),
    ("{{ messages.__class__ }}", "ms-llm chat: every prompt needs at least one token"),
])
def test_chat_template_bounded(hf, tmp_path, capsys, monkeypatch, template, message):
    monkeypatch.setattr(chat_template, "RENDER_SECONDS", 2)
    d = with_template(hf, tmp_path, template)
    stdin = io.StringIO("w1\n")
    assert chat.main(["--load", d, "--max-new-tokens", "1"], stdin=stdin, out=io.StringIO()) == 2
    assert one_line(capsys) == message
