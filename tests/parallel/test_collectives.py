"""Every collective of ms_llm.parallel.comm, in fp32/fp16/bf16, under real msrun with 2 and 3
ranks, against NumPy (the checks live in tests/dist_workers/collectives.py)."""
import re

import pytest

from helpers.msrun import run_msrun, worker_logs

EXPECTED = {"all_reduce_sum", "all_reduce_max", "all_reduce_avg", "all_gather_into_tensor_async0",
            "all_gather_into_tensor_async1", "reduce_scatter_tensor", "all_to_all_single_uneven",
            "broadcast", "batch_isend_irecv_ring"}


@pytest.mark.msrun
@pytest.mark.parametrize("nproc,shm", [(2, "1"), pytest.param(3, "1", marks=pytest.mark.extended),
                                       (2, "0")])
def test_collectives_match_numpy(tmp_path, nproc, shm, monkeypatch):
    """Through the shared-memory channel (the default on one host) and through mccl
    (``MS_LLM_SHM_COLLECTIVES=0``); the large cases span several 4 MiB slots."""
    monkeypatch.setenv("MS_LLM_SHM_COLLECTIVES", shm)
    r = run_msrun("collectives.py", nproc, str(tmp_path / "logs"), timeout=400)
    logs = worker_logs(str(tmp_path / "logs"), nproc)
    assert r.returncode == 0, "\n".join(log[-3000:] for log in logs)
    for rank, log in enumerate(logs):
        assert f"SHM {'on' if shm == '1' else 'off'}" in log
        for name in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"):
            for dt in ("fp32", "bf16"):
                assert f"CHECK large_{name}_{dt} OK" in log, (rank, name, dt)
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
