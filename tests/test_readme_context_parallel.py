"""docs/features/parallelism.md's context-parallel command runs as typed (two steps; numerics are checked against one
process in test_context_parallel_training)."""
import pytest

from test_readme_parallel import _run


@pytest.mark.msrun
def test_readme_context_parallel_command(tmp_path):
    stdout = _run(tmp_path, "--parallel.context_parallel_size", "2", "--data.seq_length", "1024",
                  "--training.micro_batch_size", "1", "--training.global_batch_size", "2")
    assert any("context parallel" in line for line in stdout.splitlines()
               if "training.jit ignored" in line)
