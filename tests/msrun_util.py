"""Run a worker script under real msrun from a test, with a free port and a bounded time."""
import os
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = os.path.join(ROOT, "tests", "dist_workers")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def msrun_command(script: str, nproc: int, log_dir: str, args=(), cluster_time_out: int = 60):
    env = dict(os.environ, GLOG_v="3", PYTHONPATH=ROOT)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    cmd = ["msrun", "--worker_num", str(nproc), "--local_worker_num", str(nproc),
           "--master_port", str(free_port()), "--log_dir", log_dir, "--join", "True",
           "--cluster_time_out", str(cluster_time_out), os.path.join(WORKERS, script), *args]
    return cmd, env


def run_msrun(script: str, nproc: int, log_dir: str, args=(), timeout: int = 300,
              cluster_time_out: int = 60) -> subprocess.CompletedProcess:
    cmd, env = msrun_command(script, nproc, log_dir, args, cluster_time_out)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def worker_logs(log_dir: str, nproc: int) -> list:
    return [open(os.path.join(log_dir, f"worker_{i}.log"), errors="replace").read()
            for i in range(nproc)]


def run_worker_job(script: str, tmp_path, nproc: int, specs, timeout: int = 600) -> dict:
    """Run a training worker (``tests/dist_workers/<script>``, argv ``OUT_JSON RUN_SPEC...``)
    under msrun and return rank 0's JSON; a failed job fails the test with the workers' logs."""
    import json
    out = tmp_path / "result.json"
    r = run_msrun(script, nproc, str(tmp_path / "logs"), [str(out), *specs], timeout=timeout)
    logs = worker_logs(str(tmp_path / "logs"), nproc)
    assert r.returncode == 0, "\n".join([log[-4000:] for log in logs] + [
        f"msrun exit {r.returncode}; its output:", r.stdout[-2000:], r.stderr[-2000:]])
    return json.loads(out.read_text())
