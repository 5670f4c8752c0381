"""``ms-llm convert`` with MindSpeed-LLM's mg -> hf flags (``convert_ckpt_v2.py``).

``--hf-cfg-dir``: the original HF folder's ``config.json`` describes the converted weights (every
field kept, including those Megatron ``args`` cannot express: token ids, sliding-window fields,
the unpadded vocabulary) once checked against the checkpoint, and its tokenizer and generation
files are copied beside them. Flags whose request has no counterpart here parse and are refused
with one ``ms-llm convert: ...`` line; unknown flags are refused naming them.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
from mindspore import Tensor

from helpers.cli import run_ms_llm
from helpers.hf_fixtures import make_hf_checkpoint
from ms_llm.checkpoint.convert import main as convert_main
from ms_llm.checkpoint.hf.io import read_hf_weights
from ms_llm.data import load_tokenizer
from ms_llm.checkpoint import from_pretrained

TO_MG = ["--load-model-type", "hf", "--save-model-type", "mg"]
TO_HF = ["--load-model-type", "mg", "--save-model-type", "hf"]
SIDE = {"generation_config.json": {"bos_token_id": 1, "eos_token_id": 2, "do_sample": True},
        "tokenizer_config.json": {"model_max_length": 2048, "eos_token": "<eos>"},
        "special_tokens_map.json": {"eos_token": "<eos>"}}


def write_tokenizer(folder) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    words = ["<eos>", "<unk>"] + [f"w{i}" for i in range(20)]
    t = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.save(os.path.join(str(folder), "tokenizer.json"))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """An HF Qwen3 folder (2 shards + index, tokenizer, generation config) and its Megatron
    conversion at tp=2 with the vocabulary padded 100 -> 128 and, as in a MindSpeed-trained
    checkpoint, no config.json beside it."""
    root = tmp_path_factory.mktemp("mindspeed_flags")
    make_hf_checkpoint(root / "hf", "qwen3", hidden=64, layers=2, heads=4, kv_heads=2,
                       head_dim=16, ffn=96, vocab=100, tied=False, shards=2, seed=7)
    write_tokenizer(root / "hf")
    for name, obj in SIDE.items():
        (root / "hf" / name).write_text(json.dumps(obj))
    assert convert_main(TO_MG + ["--load-dir", str(root / "hf"), "--save-dir", str(root / "mg"),
                                 "--target-tensor-parallel-size", "2",
                                 "--make-vocab-size-divisible-by", "64"]) == 0
    os.remove(root / "mg" / "config.json")
    return root


def fails(capsys, tmp_path, argv, expected):
    out = tmp_path / "out"
    rc = convert_main([str(a) for a in argv] + ["--save-dir", str(out)])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, err
    assert lines[0].startswith("ms-llm convert: ") and expected in lines[0], lines[0]
    assert not out.exists() and not [n for n in os.listdir(tmp_path) if ".tmp-" in n]


def test_hf_cfg_dir_keeps_the_hf_config_and_copies_tokenizer_files(folders, tmp_path):
    """Through the real ``ms-llm convert`` entry point, with the flags MindSpeed's example
    scripts pass."""
    out = tmp_path / "hf_out"
    r = run_ms_llm("convert", *TO_HF, "--load-dir", str(folders / "mg"), "--save-dir", str(out),
                   "--hf-cfg-dir", str(folders / "hf"), "--model-type-hf", "qwen3",
                   "--use-mcore-models", "--model-type", "GPT", "--save-layer-by-layer",
                   "--target-tensor-parallel-size", "1", "--target-pipeline-parallel-size", "1",
                   timeout=300)
    assert r.returncode == 0, r.stderr
    src = folders / "hf"
    assert json.loads((out / "config.json").read_text()) == \
        json.loads((src / "config.json").read_text())            # vocab_size 100, bos/eos ids...
    for name in [*SIDE, "tokenizer.json"]:
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    assert sorted(os.listdir(out)) == sorted([*SIDE, "tokenizer.json", "config.json",
                                              "model.safetensors"])   # not the source's index
    want, got = read_hf_weights(str(src)), read_hf_weights(str(out))
    assert sorted(want) == sorted(got)
    assert all(np.array_equal(want[k], got[k]) for k in want)
    ids = Tensor(np.arange(20, dtype=np.int32).reshape(2, 10))
    np.testing.assert_array_equal(from_pretrained(str(out))(ids).asnumpy(),
                                  from_pretrained(str(src))(ids).asnumpy())
    assert load_tokenizer(str(out)).vocab_size == 22


def test_without_hf_cfg_dir_the_config_is_rebuilt_from_args(folders, tmp_path):
    assert convert_main(TO_HF + ["--load-dir", str(folders / "mg"), "--save-dir",
                                 str(tmp_path / "o")]) == 0
    cfg = json.loads((tmp_path / "o" / "config.json").read_text())
    assert "bos_token_id" not in cfg and not (tmp_path / "o" / "tokenizer.json").exists()


def test_hf_cfg_dir_of_another_model_is_one_line(folders, tmp_path, capsys):
    other = tmp_path / "other"
    make_hf_checkpoint(other, "qwen3", hidden=64, layers=3, heads=4, kv_heads=2, head_dim=16,
                       ffn=96, vocab=100)
    fails(capsys, tmp_path, TO_HF + ["--load-dir", folders / "mg", "--hf-cfg-dir", other],
          f"--hf-cfg-dir {other / 'config.json'}: num_hidden_layers is 3 but the Megatron "
          f"checkpoint {folders / 'mg'} has 2")
    cfg = json.loads((folders / "hf" / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(dict(cfg, vocab_size=200)))
    fails(capsys, tmp_path, TO_HF + ["--load-dir", folders / "mg", "--hf-cfg-dir", other],
          "vocab_size 200 is larger than the 128 embedding rows")
    fails(capsys, tmp_path, TO_HF + ["--load-dir", folders / "mg", "--hf-cfg-dir",
                                     tmp_path / "nope"], "no such directory")
    fails(capsys, tmp_path, TO_MG + ["--load-dir", folders / "hf", "--hf-cfg-dir",
                                     folders / "hf"], "--hf-cfg-dir applies to mg -> hf only")


@pytest.mark.parametrize("flags,expected", [
    (["--save-lora-to-hf"], "--save-lora-to-hf: not supported"),
    (["--load-checkpoint-loosely"], "--load-checkpoint-loosely: not supported"),
    (["--lora-load", "x", "--lora-r", "8"], "x: neither a PEFT adapter folder"),
    (["--lora-alpha", "16"], "--lora-alpha/--lora-target-modules describe the adapters of "
                             "--lora-load, which is missing"),
    (["--moe-tp-extend-ep"], "--moe-tp-extend-ep: not supported"),
    (["--mla-mm-split"], "--mla-mm-split: not supported"),
    (["--schedules-method", "dualpipev"], "--schedules-method dualpipev: not supported"),
    (["--first-k-dense-replace", "1"], "--first-k-dense-replace 1: not supported"),
    (["--pipeline-model-parallel-layout", "E|t|tL"], "--pipeline-model-parallel-layout E|t|tL: "
                                                     "not supported"),
    (["--input-tp-rank", "0"], "--input-tp-rank 0: not supported"),
    (["--mtp-num-layers", "1"], "--mtp-num-layers 1: the checkpoint has 0 MTP layer(s)"),
    (["--transformer-impl", "transformer_engine"], "--transformer-impl transformer_engine: "
                                                   "not supported"),
    (["--mamba-state-dim", "64"], "--mamba-state-dim 64: not supported"),
    (["--num-layers", "3"], "--num-layers 3: the checkpoint has 2 decoder layers"),
    (["--model-type-hf", "mixtral"], "--model-type-hf: invalid choice: 'mixtral'"),
    (["--ckpt-iter", "1"], "unrecognized arguments: --ckpt-iter 1"),
])
def test_flags_that_cannot_be_honoured_are_one_line(folders, tmp_path, capsys, flags,
                                                    expected):
    fails(capsys, tmp_path, TO_HF + ["--load-dir", folders / "mg", *flags], expected)


def test_accepted_mindspeed_flags_with_their_default_meaning(folders, tmp_path):
    assert convert_main(TO_HF + ["--load-dir", str(folders / "mg"), "--save-dir",
                                 str(tmp_path / "o"), "--num-layers", "2", "--mtp-num-layers",
                                 "0", "--transformer-impl", "local", "--use-mcore-models"]) == 0


@pytest.fixture(scope="module")
def bare(folders, tmp_path_factory):
    """The tp=2 Megatron folder saved with ``args`` None (a bare training checkpoint, as
    Megatron-Core writes one without --ckpt-convert-save args): only tensors describe it."""
    import shutil
    import torch
    out = tmp_path_factory.mktemp("bare") / "mg"
    shutil.copytree(folders / "mg", out)
    for root, _, files in os.walk(out):
        for f in files:
            if f == "model_optim_rng.pt":
                p = os.path.join(root, f)
                obj = torch.load(p, weights_only=False)
                obj["args"] = None
                torch.save(obj, p)
    return out


def test_a_folder_without_args_converts_with_hf_cfg_dir(folders, bare, tmp_path, capsys):
    fails(capsys, tmp_path, TO_HF + ["--load-dir", bare], "no args in it to rebuild one from; "
          "pass --hf-cfg-dir ORIGINAL_HF")
    out = tmp_path / "hf_out"
    assert convert_main(TO_HF + ["--load-dir", str(bare), "--save-dir", str(out),
                                 "--hf-cfg-dir", str(folders / "hf")]) == 0
    want, got = read_hf_weights(str(folders / "hf")), read_hf_weights(str(out))
    assert sorted(want) == sorted(got) and all(np.array_equal(want[k], got[k]) for k in want)
    assert json.loads((out / "config.json").read_text()) == \
        json.loads((folders / "hf" / "config.json").read_text())


@pytest.mark.parametrize("kw, expected", [
    (dict(layers=3), "num_hidden_layers is 3 but the Megatron checkpoint"),
    (dict(ffn=128), "decoder.layers.0.mlp.linear_fc1.weight would be (128, 64) per tensor-"
                    "parallel rank"),
    (dict(kv_heads=4), "decoder.layers.0.self_attention.linear_qkv.weight would be (96, 64)"),
])
def test_a_template_of_another_model_is_one_line_without_args(bare, tmp_path, capsys, kw,
                                                               expected):
    other = tmp_path / "other"
    arch = dict(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, ffn=96, vocab=100)
    make_hf_checkpoint(other, "qwen3", **{**arch, **kw})
    fails(capsys, tmp_path, TO_HF + ["--load-dir", bare, "--hf-cfg-dir", other], expected)
