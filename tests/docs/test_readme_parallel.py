"""README's parallel and recompute commands run as typed through scripts/pretrain.sh (default
config, which has training.jit true): tensor + sequence parallel says in one line that it trains
in PyNative, the pipeline and recompute commands train, and ms-llm schedule prints. A few steps
each; the numerics are checked elsewhere against one process (test_parallel_training,
test_pipeline_training)."""
import os

import pytest

from helpers.paths import ROOT
from helpers.pretrain_sh import run_readme_training


@pytest.mark.msrun
def test_readme_tensor_parallel_trains_as_typed(tmp_path):
    stdout = run_readme_training(tmp_path, "--parallel.tensor_model_parallel_size", "2",
                                 "--parallel.sequence_parallel", "true")
    notes = [line for line in stdout.splitlines() if "training.jit ignored" in line]
    assert len(notes) == 1 and "tensor parallel" in notes[0]


@pytest.mark.msrun
def test_readme_pipeline_command(tmp_path):
    run_readme_training(tmp_path, "--parallel.pipeline_model_parallel_size", "2",
                        "--parallel.virtual_pipeline_model_parallel_size", "2")


@pytest.mark.msrun
def test_readme_recompute_command(tmp_path):
    run_readme_training(tmp_path, "--training.recompute_granularity", "full",
                        "--training.recompute_method", "block", "--training.recompute_num_layers",
                        "2", "--training.recompute_norm", "true", nproc="1")


def test_readme_schedule_command(capsys):
    from ms_llm.cli import main
    assert main(["schedule", os.path.join(ROOT, "configs", "tiny.yaml"),
                 "--parallel.pipeline_model_parallel_size", "2",
                 "--parallel.virtual_pipeline_model_parallel_size", "2",
                 "--training.micro_batch_size", "4"]) == 0
    assert "interleaved 1F1B: pp=2 vpp=2" in capsys.readouterr().out
