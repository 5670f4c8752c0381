"""Running model-written code (HumanEval) in a separate, confined Python process.

The candidate runs in a fresh interpreter in isolated mode (``-I``: no user site, no
``PYTHONPATH``, no current directory on the path), in its own session, in a private temporary
folder (its cwd, ``HOME`` and ``TMPDIR``), with an explicit four-variable environment (nothing of
the parent's) and no stdin. ``sandbox_runner.py`` confines it before its first line runs:
resource limits (CPU seconds, address space, file size, process count, no core files); as root,
an own network namespace and an unused uid / gid of its own (so file permissions stop writes
outside the folder and reads of other processes' ``/proc/<pid>/environ``, and the process-count
limit counts the sandbox alone); and, where the kernel has Landlock, writes only beneath the
folder, no TCP, no signals or ``/proc`` access to processes outside. When the candidate returns
(or times out), every process it left behind is killed: its process group, then every process
of the sandbox uid (as root) or of its session (otherwise) found in ``/proc``.

What was enforced is reported with each result (``ExecResult.boundary``) and printed once by
``ms-llm evaluate``; docs/guides/evaluation.md lists what is not (e.g. as non-root without
Landlock, reads of the parent's ``/proc`` and writes to the user's files are possible).
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

DEFAULT_STOP = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")
RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_runner.py")
# unused ids are picked here (far above any distribution's users, below 2**31)
_UID_RANGE = (1_900_000_000, 2_000_000_000)
_SIGNALS = {signal.SIGXCPU: "CPU time limit", signal.SIGXFSZ: "file size limit",
            signal.SIGKILL: "killed"}


@dataclass
class Limits:
    """Per-program limits; ``cpu_seconds`` None means the wall timeout + 1 s."""
    cpu_seconds: Optional[int] = None
    memory_bytes: int = 2 << 30
    file_bytes: int = 1 << 20
    processes: int = 64


@dataclass
class ExecResult:
    passed: bool
    status: str            # "passed", "failed", "timeout"
    detail: str = ""
    boundary: str = field(default="", compare=False)   # what the sandbox enforced


def human_eval_program(problem: dict, completion: str) -> str:
    """The program HumanEval runs: the prompt, the completion, the tests and the call of
    ``check`` on the entry point."""
    return (problem["prompt"] + completion + "\n\n" + problem["test"] + "\n\n"
            + f"check({problem['entry_point']})\n")


def _processes() -> Iterator[tuple]:
    """(pid, real/effective/saved uids, session id) of every live process in /proc."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                status = f.read()
            with open(f"/proc/{name}/stat") as f:
                stat = f.read().rsplit(")", 1)[1].split()
        except OSError:                       # gone meanwhile
            continue
        if stat[0] in "ZX":                   # dead, only waiting to be reaped
            continue
        uids = next(line.split()[1:4] for line in status.splitlines()
                    if line.startswith("Uid:"))
        yield int(name), {int(u) for u in uids}, int(stat[3])


def _kill_leftovers(pgid: int, uid: Optional[int]) -> None:
    """SIGKILL the candidate's process group, then every live process of the sandbox ``uid``
    (as root) or of its session (``pgid``, the session leader) until none is left; a fork
    bomb's new children are found by the next pass."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    me = os.getpid()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        left = [pid for pid, uids, sid in _processes() if pid != me and (
            uid in uids if uid is not None else sid == pgid)]
        if not left:
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.002)
    raise RuntimeError(f"sandbox: processes of uid {uid} / session {pgid} survive SIGKILL")


def _unused_uid() -> int:
    in_use = set().union(*(uids for _, uids, _ in _processes()))
    while True:
        uid = _UID_RANGE[0] + secrets.randbelow(_UID_RANGE[1] - _UID_RANGE[0])
        if uid not in in_use:
            return uid


def _user_threads(uid: int) -> int:
    """Threads of ``uid`` now: RLIMIT_NPROC counts them all, so a non-root sandbox's limit is
    set this many above them."""
    count = 0
    for pid, uids, _ in _processes():
        if uid in uids:
            try:
                with open(f"/proc/{pid}/status") as f:
                    count += int(next(line.split()[1] for line in f
                                      if line.startswith("Threads:")))
            except (OSError, StopIteration):
                pass
    return count


def _python_readable_by_others() -> bool:
    """Whether a process of another uid can import the standard library and the packages of
    this interpreter (every folder on the way searchable, the folders themselves readable)."""
    import sysconfig
    for folder in {sysconfig.get_path(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}:
        if not folder or not os.path.isdir(folder):
            continue
        folder = os.path.realpath(folder)
        if not os.stat(folder).st_mode & stat.S_IROTH:
            return False
        while True:
            if not os.stat(folder).st_mode & stat.S_IXOTH:
                return False
            if folder == os.path.dirname(folder):
                break
            folder = os.path.dirname(folder)
    return True


def _describe(report: dict, root: bool) -> str:
    parts = [(f"own uid {report['uid']}" + (" (reads every file: Python is installed where "
                                              "others cannot read)" if report["read_all"] else ""))
             if "uid" in report else "same uid as ms-llm",
             "limits " + ", ".join(report.get("limits", [])),
             "network namespace" + ("" if report.get("netns") is True else
                                    f": {report.get('netns', 'not tried (not root)')}"),
             "landlock " + str(report.get("landlock", "?"))]
    if not root and not str(report.get("landlock", "")).startswith("abi"):
        parts.append("NOT enforced: writes outside the folder, reading the parent's /proc, "
                     "network, processes that leave the session")
    return "; ".join(parts)


def run_program(program: str, timeout: float = 10.0,
                limits: Optional[Limits] = None) -> ExecResult:
    """Run ``program``; passed means exit status 0 within ``timeout`` seconds."""
    limits = limits or Limits()
    root = os.geteuid() == 0
    uid = _unused_uid() if root else None
    with tempfile.TemporaryDirectory(prefix="ms_llm_humaneval_") as tmp, \
            tempfile.TemporaryFile() as err:
        path = os.path.join(tmp, "program.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(program)
        if root:                                  # the folder and program belong to the sandbox
            for p in (tmp, path):
                os.chown(p, uid, uid)
        os.chmod(tmp, 0o700)
        processes = limits.processes + (0 if root else _user_threads(os.getuid()))
        read_fd, write_fd = os.pipe()
        cfg = {"uid": uid, "gid": uid, "read_all": root and not _python_readable_by_others(),
               "folder": tmp, "program": path, "report_fd": write_fd,
               "cpu_seconds": limits.cpu_seconds or int(timeout) + 1,
               "memory_bytes": limits.memory_bytes, "file_bytes": limits.file_bytes,
               "processes": processes}
        env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "TMPDIR": tmp, "LANG": "C.UTF-8",
               "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
        try:
            # no preexec_fn, user= or group=: any of them makes Python fork() the parent
            # (copying a many-GB training process can fail with "Cannot allocate memory")
            # instead of vfork / posix_spawn; the runner confines itself instead
            proc = subprocess.Popen([sys.executable, "-I", "-B", RUNNER, json.dumps(cfg)],
                                    cwd=tmp, env=env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=err,
                                    start_new_session=True, pass_fds=(write_fd,))
        finally:
            os.close(write_fd)
        try:
            proc.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            _kill_leftovers(proc.pid, uid)
            proc.wait()
        with os.fdopen(read_fd, "rb") as f:
            report = json.loads(f.read() or b"{}")
        boundary = _describe(report, root)
        if timed_out:
            return ExecResult(False, "timeout", f"no exit within {timeout:g} s", boundary)
        if proc.returncode == 0:
            return ExecResult(True, "passed", "", boundary)
        err.seek(max(0, os.fstat(err.fileno()).st_size - 65536))
        tail = err.read().decode("utf-8", "replace").strip().splitlines()
        if tail:
            detail = tail[-1]
        elif -proc.returncode in _SIGNALS:
            detail = f"{_SIGNALS[-proc.returncode]} ({signal.Signals(-proc.returncode).name})"
        else:
            detail = f"exit {proc.returncode}"
        return ExecResult(False, "failed", detail, boundary)


def truncate_completion(text: str, stop: Sequence[str] = DEFAULT_STOP) -> str:
    """The completion up to the first top-level line that starts something new (the HumanEval
    paper's stop sequences)."""
    from .prompts import cut_at_stop
    return cut_at_stop(text, stop)
