"""Every collective of ms_llm.parallel.comm, in fp32/fp16/bf16, under real msrun with 2 and 3
ranks, against NumPy (the checks live in tests/dist_workers/collectives.py)."""
import re

import pytest

from msrun_util import run_msrun, worker_logs

EXPECTED = {"all_reduce_sum", "all_reduce_max", "all_reduce_avg", "all_gather_into_tensor_async0",
            "all_gather_into_tensor_async1", "reduce_scatter_tensor", "all_to_all_single_uneven",
            "broadcast", "batch_isend_irecv_ring"}


@pytest.mark.msrun
@pytest.mark.parametrize("nproc", [2, 3])
def test_collectives_match_numpy(tmp_path, nproc):
    r = run_msrun("collectives.py", nproc, str(tmp_path / "logs"))
    logs = worker_logs(str(tmp_path / "logs"), nproc)
    assert r.returncode == 0, "\n".join(log[-3000:] for log in logs)
    for rank, log in enumerate(logs):
        done = set(re.findall(r"CHECK (\w+) OK", log))
        for name in EXPECTED:
            for dt in ("fp32", "fp16", "bf16"):
                assert f"{name}_{dt}" in done, (rank, name, dt)
        assert "ALL DONE" in log
        if rank in (0, 1):
            assert "send_recv" in done
        if rank in (0, nproc - 1):
            assert "subgroup_all_reduce" in done
        for name in ("grad_copy_to_group", "grad_gather_from_group", "grad_all_to_all"):
            assert name in done, (rank, name)
