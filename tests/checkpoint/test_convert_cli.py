"""``ms-llm convert`` on bad input: one ``ms-llm convert: ...`` line on stderr, exit code 2, and
no output folder (nor a leftover temporary one) -- the output is complete or absent."""
from __future__ import annotations

import json
import os
import zipfile

import pytest

from helpers.cli import run_ms_llm
from helpers.hf_fixtures import make_hf_checkpoint
from ms_llm.checkpoint.convert import main as convert_main
from helpers.paths import ROOT

TO_MG = ["--load-model-type", "hf", "--save-model-type", "mg"]
TO_HF = ["--load-model-type", "mg", "--save-model-type", "hf"]


def fails(capsys, tmp_path, argv, pattern):
    out = tmp_path / "out"
    rc = convert_main([str(a) for a in argv] + ["--save-dir", str(out)])
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ms-llm convert: "), err
    assert pattern in lines[0], lines[0]
    assert not out.exists()
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]
    return lines[0]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    make_hf_checkpoint(root / "q3", "qwen3", hidden=32, layers=2, heads=4, kv_heads=2, ffn=48,
                       vocab=101, shards=2, seed=3)
    assert convert_main(TO_MG + ["--load-dir", str(root / "q3"), "--save-dir",
                                 str(root / "q3_mg"), "--target-tensor-parallel-size", "2",
                                 "--make-vocab-size-divisible-by", "8"]) == 0
    return root


def test_bad_hf_inputs(capsys, tmp_path, ckpts):
    src = ckpts / "q3"
    hf = tmp_path / "hf"
    hf.mkdir()
    for n in os.listdir(src):
        (hf / n).write_bytes((src / n).read_bytes())
    base = TO_MG + ["--load-dir", hf]
    fails(capsys, tmp_path, base + ["--model-type-hf", "qwen25"], "model_type is 'qwen3'")
    fails(capsys, tmp_path, base + ["--model-type-hf", "llama2"], "wrong --model-type-hf")
    fails(capsys, tmp_path, base + ["--target-tensor-parallel-size", "4"], "query groups (2)")
    fails(capsys, tmp_path, base + ["--target-tensor-parallel-size", "2"],
          "does not divide the vocabulary (101)")
    fails(capsys, tmp_path, base + ["--target-pipeline-parallel-size", "3"],
          "not divisible by pipeline size 3")
    fails(capsys, tmp_path, base + ["--num-layer-list", "1,2", "--target-pipeline-parallel-size",
                                    "2"], "--num-layer-list [1, 2]")
    fails(capsys, tmp_path, base + ["--frobnicate"], "unrecognized arguments: --frobnicate")
    fails(capsys, tmp_path, base + ["--moe-grouped-gemm"], "needs a MoE model")
    shard = hf / "model-00002-of-00002.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    fails(capsys, tmp_path, base, "truncated")
    shard.unlink()
    fails(capsys, tmp_path, base, "model-00002-of-00002.safetensors: listed in")
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_key_value_heads"] = 4  # config disagrees with the weights
    shard.write_bytes(data)
    (hf / "config.json").write_text(json.dumps(cfg))
    fails(capsys, tmp_path, base, "has shape")


def test_bad_megatron_inputs(capsys, tmp_path, ckpts):
    mg = tmp_path / "mg"
    src = ckpts / "q3_mg"
    for dirpath, _, names in os.walk(src):
        rel = os.path.relpath(dirpath, src)
        os.makedirs(mg / rel, exist_ok=True)
        for n in names:
            (mg / rel / n).write_bytes(open(os.path.join(dirpath, n), "rb").read())
    base = TO_HF + ["--load-dir", mg]
    f1 = mg / "iter_0000001" / "mp_rank_01" / "model_optim_rng.pt"
    good = f1.read_bytes()
    f1.write_bytes(good[: len(good) // 2])
    fails(capsys, tmp_path, base, "mp_rank_01/model_optim_rng.pt: not a torch zip checkpoint "
                                  "or truncated")
    # a pickle asking for os.system: refused, nothing runs
    marker = tmp_path / "ran"
    cmd = f"touch {marker}".encode()
    evil = b"\x80\x02cos\nsystem\nX" + len(cmd).to_bytes(4, "little") + cmd + b"\x85R."
    with zipfile.ZipFile(f1, "w") as z:
        z.writestr("model_optim_rng/data.pkl", evil)
    fails(capsys, tmp_path, base, "global os.system")
    assert not marker.exists()
    f1.parent.rename(mg / "iter_0000001" / "elsewhere")
    fails(capsys, tmp_path, base, "mp_rank_01/model_optim_rng.pt: missing shard")
    (mg / "latest_checkpointed_iteration.txt").write_text("7")
    fails(capsys, tmp_path, base, "iter_0000007: missing")
    fails(capsys, tmp_path, TO_HF + ["--load-dir", tmp_path / "nope"], "no such directory")


def test_output_must_be_new_and_cli_exit_code(tmp_path, ckpts):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    proc = run_ms_llm("convert", *TO_HF, "--load-dir", ckpts / "q3_mg", "--save-dir", out,
                      cwd=ROOT, timeout=300, env={"PYTHONPATH": ROOT})
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == \
        f"ms-llm convert: --save-dir {out}: exists and is not empty"
    assert os.listdir(out) == ["keep.txt"]
