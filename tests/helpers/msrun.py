"""The tests' side of msrun: worker scripts under ``tests/dist_workers`` launched through
``ms_llm.launch.msrun`` (free port, bounded wait, worker logs), and the one run-spec encoding the
shared training workers read (``name:--key=value,--key=value,@flag``)."""
import json
import os
from typing import List, Sequence, Tuple

from ms_llm.launch.msrun import (ROOT, LaunchResult, free_port,  # noqa: F401 (re-exported)
                                 launch_env, read_worker_logs)
from ms_llm.launch.msrun import msrun_command as _msrun_command
from ms_llm.launch.msrun import run_msrun as _run_msrun

from .paths import WORKERS

# A comma inside a value (data.split 90,10,0; num_layer_list 1,3) travels as "|".
_COMMA = "|"


def msrun_command(script: str, nproc: int, log_dir: str, args=(), cluster_time_out: int = 60):
    """``(cmd, env)`` launching ``tests/dist_workers/<script>`` on ``nproc`` local workers, for a
    test that starts several jobs side by side."""
    cmd = _msrun_command(os.path.join(WORKERS, script), args, worker_num=nproc,
                         master_port=free_port(), log_dir=log_dir,
                         cluster_time_out=cluster_time_out)
    return cmd, launch_env()


def run_msrun(script: str, nproc: int, log_dir: str, args=(), timeout: int = 300,
              cluster_time_out: int = 60) -> LaunchResult:
    """Run ``tests/dist_workers/<script>`` and wait at most ``timeout`` s (then the job is killed
    and ``returncode`` is ``"timeout"``)."""
    return _run_msrun(os.path.join(WORKERS, script), nproc, log_dir, args, timeout=timeout,
                      cluster_time_out=cluster_time_out)


def worker_logs(log_dir: str, nproc: int) -> List[str]:
    return read_worker_logs(log_dir, nproc)


def run_spec(name: str, *arg_lists: Sequence[str], flags: Sequence[str] = ()) -> str:
    """One run of a shared training worker: ``name`` and flat ``--key value`` lists become
    ``name:--key=value,...`` plus ``@flag`` markers (see :func:`parse_run_spec`)."""
    args = [a for lst in arg_lists for a in lst]
    if len(args) % 2:
        raise ValueError(f"run spec {name}: overrides must be --key value pairs, got {args}")
    pairs = [f"{k}={str(v).replace(',', _COMMA)}" for k, v in zip(args[::2], args[1::2])]
    return name + ":" + ",".join(pairs + [f if f.startswith("@") else "@" + f for f in flags])


def parse_run_spec(spec: str) -> Tuple[str, List[str], List[str]]:
    """``(name, overrides, flags)`` of a :func:`run_spec` string; flags keep their ``@``."""
    name, _, extra = spec.partition(":")
    items = [a.replace(_COMMA, ",") for a in extra.split(",") if a]
    return (name, [a for a in items if not a.startswith("@")],
            [a for a in items if a.startswith("@")])


def run_worker_job(script: str, tmp_path, nproc: int, specs, timeout: int = 600) -> dict:
    """Run a training worker (``tests/dist_workers/<script>``, argv ``OUT_JSON RUN_SPEC...``)
    under msrun and return rank 0's JSON; a failed job fails the test with the workers' logs."""
    out = tmp_path / "result.json"
    r = run_msrun(script, nproc, str(tmp_path / "logs"), [str(out), *specs], timeout=timeout)
    assert r.ok, r.failure_report()
    return json.loads(out.read_text())
