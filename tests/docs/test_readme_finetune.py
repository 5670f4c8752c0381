"""docs/guides/finetuning.md: the SFT-with-evaluation and DPO command blocks run as typed (bash, the real
``ms-llm`` console script) in a folder holding ``hf_model`` (a tiny HF folder), ``alpaca.jsonl``
and ``pairs.jsonl``. The DPO block is HF folder -> preprocess pairwise -> train stage dpo ->
save -> resume -> export; its resumed losses equal one uninterrupted in-process run of the same
4 steps, whose weights the exported folder holds.

Tolerance rtol 1e-5 between the CLI processes and the in-process run: the same fp32 kernels in
another process (thread pools may reduce in another order).
"""
import json
import os
import re
import shlex
import subprocess
import sys

import numpy as np
import pytest
from mindspore import Tensor

from helpers.finetune_fixtures import alpaca_rows, make_hf_folder, pairwise_rows, write_jsonl
from ms_llm.config import load_config
from ms_llm.checkpoint import from_pretrained
from ms_llm.training.trainer import Trainer
from helpers.paths import ROOT


def readme_block(heading: str) -> str:
    text = open(os.path.join(ROOT, "docs", "guides", "finetuning.md"), encoding="utf-8").read()
    section = text.split(f"\n{heading}\n", 1)[1]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


def run_block(block: str, cwd) -> str:
    env = dict(os.environ, PYTHONPATH=ROOT)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    r = subprocess.run(["bash", "-e", "-c", block], cwd=cwd, env=env, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


@pytest.fixture
def workdir(tmp_path):
    make_hf_folder(tmp_path / "hf_model")
    write_jsonl(tmp_path / "alpaca.jsonl", alpaca_rows(20))
    write_jsonl(tmp_path / "pairs.jsonl", pairwise_rows(24))
    return tmp_path


def metrics(path):
    return [json.loads(line) for line in open(path)]


def test_readme_sft_with_evaluation(workdir):
    stdout = run_block(readme_block("## SFT with evaluation"), workdir)
    assert " validation loss at iteration 2 | eval_loss: " in stdout and "| eval_ppl: " in stdout
    rows = metrics(workdir / "outputs" / "sft" / "metrics.jsonl")
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 4]
    assert all(r["eval_ppl"] == pytest.approx(np.exp(r["eval_loss"])) for r in evals)


def test_readme_dpo_sequence(workdir):
    block = readme_block("## DPO")
    stdout = run_block(block, workdir)
    assert "resumed from" in stdout and "training.jit ignored" in stdout
    assert "| rewards/accuracy: " in stdout and "| rewards/margin: " in stdout   # step lines
    assert "| eval_rewards/accuracy: " in stdout
    rows = metrics(workdir / "outputs" / "dpo" / "metrics.jsonl")
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert [r["step"] for r in rows if "eval_loss" in r] == [2, 4]
    assert steps[0]["rewards/margin"] == 0.0 and steps[0]["loss"] == pytest.approx(np.log(2))

    # One uninterrupted 4-step run of the same command, in this process.
    train = shlex.split(block.replace("\\\n", " ").splitlines()[1])   # the first train command
    assert train[:2] == ["ms-llm", "train"]
    args = [a.replace("hf_model", str(workdir / "hf_model")).replace(
        "data/", str(workdir / "data") + "/") for a in train[2:]]
    args += ["--training.max_steps", "4", "--checkpoint.save_dir", "null",
             "--training.output_dir", str(workdir / "straight")]
    trainer = Trainer(load_config(None, args))
    straight = [r for r in trainer.fit() if "loss" in r]
    for key in ("loss", "grad_norm", "rewards/margin", "rewards/chosen"):
        np.testing.assert_allclose([r[key] for r in steps], [r[key] for r in straight],
                                   rtol=1e-5, atol=1e-7, err_msg=key)

    exported = from_pretrained(str(workdir / "hf_dpo"))
    ids = Tensor(np.arange(24, dtype=np.int32).reshape(2, 12) % 32)
    np.testing.assert_allclose(exported(ids).asnumpy(), trainer.model(ids).asnumpy(),
                               rtol=1e-5, atol=1e-5)
    base = from_pretrained(str(workdir / "hf_model"))(ids).asnumpy()
    assert not np.allclose(base, exported(ids).asnumpy(), atol=1e-4)   # trained weights
