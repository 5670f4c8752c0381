"""Acceptance: MindSpeed-LLM's ``pretrain_qwen3_0point6b_4K_ptd.sh`` and
``tune_qwen3_0point6b_4K_lora_ptd.sh`` run end to end under msrun with only the launcher line
(``torchrun $DISTRIBUTED_ARGS pretrain_gpt.py`` -> ``msrun ... pretrain_gpt.py``) and the sizes
changed: their published argument lists (``tests/fixtures/mindspeed_examples.json``), the sizes
shrunk to a 2-layer Qwen3 folder, the placeholders pointed at it, its data and a save folder.

The msrun job's curve must be the one ``ms-llm train`` gives for the same keys in one process
(2 workers x 1 micro-batch x 2 accumulation steps vs 1 process x 4 micro-batches: the same
samples per step; bf16 forward per micro-batch, fp32 gradient sums in another order: rtol 1e-3).
"""
import json
import os

import numpy as np
import pytest

from helpers.finetune_fixtures import alpaca_rows, preprocess, write_jsonl, write_tokenizer
from helpers.hf_fixtures import make_hf_checkpoint
from helpers.mindspeed_examples import load
from helpers.msrun import ROOT, run_msrun, worker_logs

pytestmark = [pytest.mark.msrun, pytest.mark.slow]

SHRINK = {"--num-layers": "2", "--hidden-size": "64", "--num-attention-heads": "4",
          "--ffn-hidden-size": "96", "--num-query-groups": "2", "--kv-channels": "16",
          "--padded-vocab-size": "64", "--seq-length": "32", "--global-batch-size": "4",
          "--train-iters": "4", "--save-interval": "2"}


def shrunk(argv, paths):
    """The script's arguments with the sizes above and the placeholders filled."""
    out = [paths.get(a, a) for a in argv]
    for i, a in enumerate(out[:-1]):
        if a in SHRINK:
            out[i + 1] = SHRINK[a]
    return out


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("mindspeed")
    hf = root / "qwen3_hf"
    make_hf_checkpoint(hf, "qwen3", hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16,
                       ffn=96, vocab=64, tied=True, seed=3, rope_theta=1e6,
                       max_position_embeddings=32768)
    write_tokenizer(hf)
    rows = alpaca_rows(64, seed=4)
    text = write_jsonl(root / "text.jsonl", [{"text": " ".join([r["instruction"], r["output"]] * 3)}
                                             for r in rows])
    preprocess(text, str(hf), str(root / "pre"), "GeneralPretrainHandler", "--append-eod")
    preprocess(write_jsonl(root / "alpaca.jsonl", rows), str(hf), str(root / "sft"),
               "AlpacaStyleInstructionHandler")
    return root


def run_script(folder, name, data, nproc, tag):
    entry = load()[name]
    paths = {"@LOAD@": str(folder / "qwen3_hf"), "@TOKENIZER@": str(folder / "qwen3_hf"),
             "@DATA@": data, "@SAVE@": str(folder / tag / "save")}
    argv = shrunk(entry["argv"], paths)
    work = folder / tag
    work.mkdir()
    cwd = os.getcwd()
    os.chdir(work)      # MindSpeed scripts log relative to the working folder, as here
    try:
        r = run_msrun(os.path.join(ROOT, entry["entry"]), nproc, str(work / "logs"), argv,
                      timeout=600)
    finally:
        os.chdir(cwd)
    logs = worker_logs(str(work / "logs"), nproc)
    assert r.returncode == 0, "\n".join([log[-3000:] for log in logs] + [r.stderr[-2000:]])
    rows = [json.loads(x) for x in open(work / "outputs" / "default" / "metrics.jsonl")
            if '"loss"' in x]
    return argv, rows, logs[0]


def test_pretrain_qwen3_0point6b_script_under_msrun(folder):
    from ms_llm.config import load_config
    from ms_llm.mindspeed.flags import to_overrides, translate
    from ms_llm.training.trainer import Trainer
    argv, rows, log0 = run_script(folder, "qwen3/pretrain_qwen3_0point6b_4K_ptd.sh",
                                  str(folder / "pre_text_document"), 2, "pretrain")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert "pretrain_gpt.py: --use-flash-attn: no-op" in log0
    assert os.path.isdir(folder / "pretrain" / "save")
    # relaunching the script with --load at its --save folder resumes the ms-llm run there
    save = str(folder / "pretrain" / "save")
    again = translate([save if a == str(folder / "qwen3_hf") and argv[i - 1] == "--load" else a
                       for i, a in enumerate(argv)], world_size=2)
    assert again.keys["training.resume"] == "auto" and "checkpoint.load" not in again.keys
    assert any("resuming the ms-llm run saved there" in n for n in again.notes)
    # the same keys in one process (1 worker: the default global batch needs the script's)
    keys = translate(argv, world_size=1).keys
    keys["training.output_dir"] = str(folder / "one")
    # its own save folder: the script's holds the msrun run's checkpoints (a save folder belongs
    # to one run)
    keys["checkpoint.save_dir"] = str(folder / "one" / "save")
    ref = Trainer(load_config(None, to_overrides(keys))).fit()
    np.testing.assert_allclose([r["loss"] for r in rows], [r["loss"] for r in ref], rtol=1e-3)
    assert [r["lr"] for r in rows] == [r["lr"] for r in ref]


def test_lora_tune_script_under_msrun(folder):
    argv, rows, log0 = run_script(folder, "qwen3/tune_qwen3_0point6b_4K_lora_ptd.sh",
                                  str(folder / "sft"), 1, "lora")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(np.isfinite(r["loss"]) for r in rows)
    assert "posttrain_gpt.py: --lora-fusion: no-op" in log0
