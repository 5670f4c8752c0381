"""docs/features/parallelism.md's context-parallel command runs as typed (two steps; numerics are checked against one
process in test_context_parallel_training)."""
import pytest

from helpers.pretrain_sh import run_readme_training


@pytest.mark.msrun
def test_readme_context_parallel_command(tmp_path):
    stdout = run_readme_training(tmp_path, "--parallel.context_parallel_size", "2",
                                 "--data.seq_length", "1024", "--training.micro_batch_size", "1",
                                 "--training.global_batch_size", "2")
    assert any("context parallel" in line for line in stdout.splitlines()
               if "training.jit ignored" in line)
