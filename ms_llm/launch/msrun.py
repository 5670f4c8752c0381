"""The one msrun launcher: the msrun command line, a free port, the workers' environment and log
files, and a bounded wait that reports the workers' logs on failure.

Every multi-process launch goes through here: ``scripts/pretrain.sh`` (through
``python -m ms_llm.training.restart``, which builds each attempt's command with
:func:`msrun_command`), ``ms-llm qualify``, the benchmarks and the tests' msrun jobs
(``tests/helpers/msrun.py``). Before this module the command line was written in six places and the
free-port helper in five, and they drifted (time-outs, ``--join`` spellings, ``PYTHONPATH``
replaced or prepended).

This module imports nothing from ``ms_llm`` and no MindSpore, so a supervisor process that only
launches stays light and any package may use it (it sits at the bottom of the package layering,
next to ``compat``).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import List, Mapping, Optional, Sequence, Union

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT = "timeout"    # LaunchResult.returncode of a launch stopped at its time-out


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it), for msrun's scheduler."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def msrun_command(script: str, args: Sequence[str] = (), *, worker_num: int,
                  master_port: Union[int, str], log_dir: str,
                  local_worker_num: Optional[int] = None, node_rank: Optional[int] = None,
                  master_addr: Optional[str] = None,
                  cluster_time_out: Union[int, str] = 120) -> List[str]:
    """The msrun command that runs ``script args`` on ``worker_num`` workers (of which
    ``local_worker_num``, default all, on this node), logging rank r to ``log_dir/worker_r.log``.

    ``--join True`` makes msrun wait for its workers and exit non-zero when one fails; the
    cluster time-out bounds how long it waits for a lost worker or a missing node. The node
    options are only written for a multi-node launch (``node_rank``/``master_addr`` given), which
    needs ``master_addr``.
    ``master_port`` and ``log_dir`` may be placeholders a supervisor fills in per attempt."""
    local = worker_num if local_worker_num is None else local_worker_num
    if local < worker_num and not master_addr:   # loopback would hang until the time-out
        raise ValueError(f"msrun: {worker_num} workers over several nodes ({local} on this one) "
                         "need master_addr, node 0's address")
    cmd = ["msrun", "--worker_num", str(worker_num), "--local_worker_num", str(local)]
    if node_rank is not None:
        cmd += ["--node_rank", str(node_rank)]
    if master_addr is not None:
        cmd += ["--master_addr", str(master_addr)]
    cmd += ["--master_port", str(master_port), "--log_dir", str(log_dir), "--join", "True",
            "--cluster_time_out", str(cluster_time_out), script, *[str(a) for a in args]]
    return cmd


def launch_env(base: Optional[Mapping[str, str]] = None, **extra: str) -> dict:
    """The environment for msrun and its workers: this checkout first on ``PYTHONPATH``, this
    interpreter's folder first on ``PATH`` (msrun starts workers with the ``python`` it finds),
    MindSpore's C++ logs at errors only (``GLOG_v=3`` unless set), unbuffered output (a
    killed worker's last lines still reach its log) and Python's fault handler (a worker that
    crashes prints its Python stack there). ``extra`` overrides."""
    env = dict(os.environ if base is None else base)
    env.setdefault("GLOG_v", "3")
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("PYTHONFAULTHANDLER", "1")
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != ROOT]
    env["PYTHONPATH"] = os.pathsep.join([ROOT, *paths])
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.update(extra)
    return env


def worker_log_paths(log_dir: str, nproc: int) -> List[str]:
    """msrun's per-rank log files."""
    return [os.path.join(log_dir, f"worker_{r}.log") for r in range(nproc)]


def read_worker_logs(log_dir: str, nproc: int) -> List[str]:
    """Each rank's log text ('' for a rank whose log was never written)."""
    logs = []
    for path in worker_log_paths(log_dir, nproc):
        try:
            with open(path, errors="replace") as f:
                logs.append(f.read())
        except OSError:
            logs.append("")
    return logs


@dataclass
class LaunchResult:
    """A finished launch: ``returncode`` (or ``TIMEOUT``), msrun's own output, each rank's log."""
    returncode: Union[int, str]
    stdout: str
    stderr: str
    logs: List[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def failure_report(self, tail: int = 4000) -> str:
        """The workers' log tails and msrun's output, for an assertion or an error message."""
        parts = [f"--- worker_{r}.log (last {tail} chars)\n{log[-tail:]}"
                 for r, log in enumerate(self.logs)]
        return "\n".join(parts + [f"msrun exit {self.returncode} after {self.seconds:.0f} s; "
                                  f"its output:", self.stdout[-2000:], self.stderr[-2000:]])


def descendants(pid: int) -> List[int]:
    """Every live process below ``pid`` (from ``/proc``; empty where there is none)."""
    children: dict = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


class MsrunJob:
    """A started launch, ended as a whole on a time-out or an interrupt: msrun starts every
    worker in a process group of its own and leaves them running when it is killed, so the
    workers are found as msrun's descendants and killed one by one (a leftover job would hold
    the cores of this shared machine)."""

    def __init__(self, cmd: Sequence[str], log_dir: str, nproc: int,
                 env: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None,
                 merge_stderr: bool = False, output: Optional[str] = None):
        """``output``: a file that receives msrun's own stdout and stderr (then the result's
        ``stdout``/``stderr`` are empty); otherwise they are captured, ``merge_stderr`` joining
        stderr into stdout."""
        self.cmd, self.log_dir, self.nproc = list(cmd), log_dir, nproc
        self.t0 = time.time()
        self._out = open(output, "w") if output else None
        self.proc = subprocess.Popen(
            self.cmd, env=dict(env) if env is not None else launch_env(), cwd=cwd,
            stdout=self._out or subprocess.PIPE,
            stderr=subprocess.STDOUT if merge_stderr or output else subprocess.PIPE,
            stdin=subprocess.DEVNULL, text=True, start_new_session=True)

    def wait(self, timeout: Optional[float] = None) -> LaunchResult:
        """Wait at most ``timeout`` seconds; past it, kill the whole job and report ``TIMEOUT``."""
        try:
            out, err = self.proc.communicate(timeout=timeout)
            rc: Union[int, str] = self.proc.returncode
        except subprocess.TimeoutExpired:
            self.kill()
            out, err = self.proc.communicate()
            rc = TIMEOUT
        except BaseException:   # KeyboardInterrupt, a failing test's teardown: no orphans
            self.kill()
            raise
        if self._out:
            self._out.close()
        return LaunchResult(rc, out or "", err or "", read_worker_logs(self.log_dir, self.nproc),
                            time.time() - self.t0)

    def kill(self) -> None:
        """SIGKILL msrun, its process group and every descendant (the workers)."""
        victims = descendants(self.proc.pid)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for pid in victims + descendants(self.proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def start_msrun(script: str, nproc: int, log_dir: str, args: Sequence[str] = (), *,
                cluster_time_out: int = 120, env: Optional[Mapping[str, str]] = None,
                cwd: Optional[str] = None, merge_stderr: bool = False) -> MsrunJob:
    """Start ``script args`` on ``nproc`` local workers on a free port (see :func:`run_msrun`)."""
    cmd = msrun_command(script, args, worker_num=nproc, master_port=free_port(),
                        log_dir=log_dir, cluster_time_out=cluster_time_out)
    return MsrunJob(cmd, log_dir, nproc, env=env, cwd=cwd, merge_stderr=merge_stderr)


def run_msrun(script: str, nproc: int, log_dir: str, args: Sequence[str] = (), *,
              timeout: float = 300, cluster_time_out: int = 120,
              env: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None,
              merge_stderr: bool = False) -> LaunchResult:
    """Run ``script args`` on ``nproc`` local workers and wait at most ``timeout`` seconds."""
    return start_msrun(script, nproc, log_dir, args, cluster_time_out=cluster_time_out, env=env,
                       cwd=cwd, merge_stderr=merge_stderr).wait(timeout)
