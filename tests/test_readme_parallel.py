"""The parallel, pipeline and recompute commands of docs/features/ run as typed through scripts/pretrain.sh (default
config, which has training.jit true): tensor + sequence parallel says in one line that it trains
in PyNative, the pipeline and recompute commands train, and ms-llm schedule prints. A few steps each; the numerics are checked elsewhere against one
process (test_parallel_training, test_pipeline_training)."""
import json
import os
import subprocess

import numpy as np
import pytest

from test_launch import ROOT, launch_env


def _run(tmp_path, *args, nproc="2"):
    out = tmp_path / "out"
    env = launch_env(tmp_path, NPROC=nproc)
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "pretrain.sh"), *args,
                        "--training.max_steps", "2", "--training.log_interval", "1",
                        "--training.output_dir", str(out)],
                       capture_output=True, text=True, timeout=400, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert len(rows) == 2 and all(np.isfinite(row["loss"]) for row in rows)
    return r.stdout


@pytest.mark.msrun
def test_readme_tensor_parallel_trains_as_typed(tmp_path):
    stdout = _run(tmp_path, "--parallel.tensor_model_parallel_size", "2",
                  "--parallel.sequence_parallel", "true")
    notes = [line for line in stdout.splitlines() if "training.jit ignored" in line]
    assert len(notes) == 1 and "tensor parallel" in notes[0]


@pytest.mark.msrun
def test_readme_pipeline_command(tmp_path):
    _run(tmp_path, "--parallel.pipeline_model_parallel_size", "2",
         "--parallel.virtual_pipeline_model_parallel_size", "2")


@pytest.mark.msrun
def test_readme_recompute_command(tmp_path):
    _run(tmp_path, "--training.recompute_granularity", "full", "--training.recompute_method",
         "block", "--training.recompute_num_layers", "2", "--training.recompute_norm", "true",
         nproc="1")


def test_readme_schedule_command(capsys):
    from ms_llm.cli import main
    assert main(["schedule", os.path.join(ROOT, "configs", "tiny.yaml"),
                 "--parallel.pipeline_model_parallel_size", "2",
                 "--parallel.virtual_pipeline_model_parallel_size", "2",
                 "--training.micro_batch_size", "4"]) == 0
    assert "interleaved 1F1B: pp=2 vpp=2" in capsys.readouterr().out
