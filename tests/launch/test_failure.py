"""A failing worker ends the whole msrun job with a non-zero code within the time-outs, and the
launcher output names the failing rank and its error (three jobs run side by side)."""
import subprocess
import time

import pytest

from helpers.msrun import msrun_command

# cluster_time_out 20 s + start-up (~15 s) + the 5 s collective watchdog, with margin.
LIMIT_S = 120


@pytest.mark.msrun
def test_raise_kill_and_stall_end_the_job(tmp_path):
    procs = {}
    for mode in ("raise", "kill", "stall"):
        status = [str(tmp_path / "status")] if mode == "stall" else []
        cmd, env = msrun_command("fail.py", 2, str(tmp_path / mode), [mode, *status],
                                 cluster_time_out=20)
        procs[mode] = (time.time(), subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                                     stderr=subprocess.STDOUT, text=True))
    for mode, (t0, p) in procs.items():
        try:
            out, _ = p.communicate(timeout=LIMIT_S + 60)
        except subprocess.TimeoutExpired:
            p.kill()
            pytest.fail(f"{mode}: msrun still running after {LIMIT_S + 60} s (hang)")
        elapsed = time.time() - t0
        assert p.returncode != 0, (mode, out[-2000:])
        assert elapsed < LIMIT_S, (mode, elapsed)
        assert "unreachable" not in out
        assert f"rank 1 {'stalling' if mode == 'stall' else 'failing now'}" in out, out[-2000:]
        if mode == "raise":
            assert "deliberate failure on rank 1" in out
        if mode == "kill":
            assert "Error code: -9" in out
        if mode == "stall":
            # rank 0 names the collective, its ranks, its step, and rank 1 as the stalled one
            assert "rank 0: collective all_reduce over all 2 ranks did not complete within 5 s " \
                "(parallel.collective_timeout_s) in step 3; stalled rank(s): [1]; peers: " \
                "rank 1: step 3, not in a collective" in out, out[-2000:]
