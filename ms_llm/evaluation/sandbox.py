"""Running model-written code (HumanEval) in a separate, confined Python process.

The candidate runs in a fresh interpreter in isolated mode (``-I``: no user site, no
``PYTHONPATH``, no current directory on the path), in its own session, in a private temporary
folder (its cwd, ``HOME`` and ``TMPDIR``), with an explicit environment (``PATH``, ``LANG``,
``HOME``, ``TMPDIR``, ``PYTHONHASHSEED``, ``OMP_NUM_THREADS``; nothing of the parent's) and no
stdin. ``sandbox_runner.py`` confines it before its first line runs:
resource limits (CPU seconds, address space, file size, process count, no core files); as root,
an own network namespace and a uid / gid of its own (so file permissions stop writes
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

import functools
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
# sandbox ids are drawn here when mapped (far above any distribution's users, < 2**31)
_UID_RANGE = (1_900_000_000, 2_000_000_000)
_SIGNALS = {signal.SIGXCPU: "CPU time limit", signal.SIGXFSZ: "file size limit",
            signal.SIGKILL: "killed"}


class SandboxError(RuntimeError):
    """The runner could not confine itself (the program did not run)."""


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
    boundary: str = field(default="", compare=False)   # what the sandbox enforced, one line
    report: dict = field(default_factory=dict, compare=False)   # the runner's own record of it


def human_eval_program(problem: dict, completion: str) -> str:
    """The program HumanEval runs: the prompt, the completion, the tests and the call of
    ``check`` on the entry point."""
    return (problem["prompt"] + completion + "\n\n" + problem["test"] + "\n\n"
            + f"check({problem['entry_point']})\n")


def _processes(with_session: bool) -> Iterator[tuple]:
    """(pid, real/effective/saved uids, session id or None) of every live process in /proc."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                status = f.read()
            sid = None
            if with_session:
                with open(f"/proc/{name}/stat") as f:
                    sid = int(f.read().rsplit(")", 1)[1].split()[3])
        except (OSError, IndexError, ValueError):       # gone meanwhile
            continue
        state = status[status.find("\nState:") + 8:].lstrip()[:1]
        if state in ("Z", "X", ""):           # dead, only waiting to be reaped
            continue
        uids = status[status.find("\nUid:") + 5:].split(None, 3)[:3]
        yield int(name), {int(u) for u in uids}, sid


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
        left = [pid for pid, uids, sid in _processes(uid is None) if pid != me and (
            uid in uids if uid is not None else sid == pgid)]
        if not left:
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.002)
    raise SandboxError(f"human_eval sandbox: processes of uid {uid} / session {pgid} survive "
                       f"SIGKILL for 10 s")


def _mapped(kind: str) -> list:
    """(first, end) id ranges this process's user namespace maps (``uid_map`` / ``gid_map``)."""
    try:
        with open(f"/proc/self/{kind}_map") as f:
            rows = [[int(v) for v in line.split()] for line in f if line.strip()]
    except (OSError, ValueError):
        return [(0, 1 << 32)]
    return [(first, first + count) for first, _, count in rows]


def _sandbox_range() -> Optional[tuple]:
    """Where the sandbox's id is drawn: ``_UID_RANGE`` when mapped (any ordinary host), else
    the upper half of the widest range both maps share above 1000 (a rootless container maps
    only e.g. 0-65535), nobody's 65534-65535 left out; None when there is none."""
    spans = [(max(u0, g0), min(u1, g1)) for u0, u1 in _mapped("uid") for g0, g1 in _mapped("gid")]
    if any(lo <= _UID_RANGE[0] and _UID_RANGE[1] <= hi for lo, hi in spans):
        return _UID_RANGE
    spans = [(max(lo, 1000), min(hi, 65534) if hi <= 65536 else hi) for lo, hi in spans]
    spans = [(lo, hi) for lo, hi in spans if hi - lo >= 256]
    if not spans:
        return None
    lo, hi = max(spans, key=lambda s: s[1] - s[0])
    return ((lo + hi) // 2, hi)


def _unused_uid() -> Optional[int]:
    """A random id of the sandbox range: two sandboxes alive at once share one with odds of 1
    in 10^8 on an ordinary host (a scan of /proc for a free one would cost more than the
    candidate's own run); None when this (root) process can switch to no other id."""
    span = _sandbox_range()
    return None if span is None else span[0] + secrets.randbelow(span[1] - span[0])


def _user_threads(uid: int) -> int:
    """Threads of ``uid`` now: RLIMIT_NPROC counts them all, so a non-root sandbox's limit is
    set this many above them."""
    count = 0
    for pid, uids, _ in _processes(False):
        if uid in uids:
            try:
                with open(f"/proc/{pid}/status") as f:
                    count += int(next(line.split()[1] for line in f
                                      if line.startswith("Threads:")))
            except (OSError, StopIteration):
                pass
    return count


@functools.lru_cache(maxsize=None)
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
    """One line: what the runner reported it enforced, then what is not enforced here."""
    landlock = str(report.get("landlock", "not reached"))
    abi = int(landlock[4:]) if landlock.startswith("abi ") else 0
    netns = report.get("netns", "not tried (not root)")
    parts = [(f"own uid {report['uid']}" + (" (reads every file: Python is installed where "
                                              "others cannot read)" if report["read_all"] else ""))
             if "uid" in report else "same uid as ms-llm",
             "limits " + ", ".join(report.get("limits", [])),
             "network namespace" + ("" if netns is True else f": {netns}"),
             "landlock " + landlock]
    own = "uid" in report
    missing = []
    if not abi:
        missing.append("writes to " + ("world-writable folders (/tmp ...)" if own else
                                       "every file ms-llm may write") + " outside the folder")
        if not own:
            missing.append("reading the parent's /proc/<pid>/environ")
    if netns is not True and abi < 4:
        missing.append("network")
    elif netns is not True:
        missing.append("UDP network")
    if not own:
        missing.append("processes that call setsid survive")
    if root and not own:
        missing.append("the process limit (runs as root: no other id is mapped)")
    if missing:
        parts.append("NOT enforced: " + ", ".join(missing))
    return "; ".join(parts)


def _private_folder(tmp: str, program: str, uid: Optional[int]) -> str:
    """Write the program into ``tmp``; as root both belong to the sandbox ``uid``."""
    path = os.path.join(tmp, "program.py")
    with open(path, "w", encoding="utf-8") as f:
        f.write(program)
    if uid is not None:
        for p in (tmp, path):
            os.chown(p, uid, uid)
    os.chmod(tmp, 0o700)
    return path


def _failure_detail(err, returncode: int) -> str:
    """The last line the program wrote to stderr, or the signal / exit status."""
    err.seek(max(0, os.fstat(err.fileno()).st_size - 65536))
    tail = err.read().decode("utf-8", "replace").strip().splitlines()
    if tail:
        return tail[-1]
    if -returncode in _SIGNALS:
        return f"{_SIGNALS[-returncode]} ({signal.Signals(-returncode).name})"
    return f"exit {returncode}"


def run_program(program: str, timeout: float = 10.0,
                limits: Optional[Limits] = None) -> ExecResult:
    """Run ``program``; passed means exit status 0 within ``timeout`` seconds."""
    limits = limits or Limits()
    root = os.geteuid() == 0
    uid = _unused_uid() if root else None
    with tempfile.TemporaryDirectory(prefix="ms_llm_humaneval_") as tmp, \
            tempfile.TemporaryFile() as err:
        path = _private_folder(tmp, program, uid)
        read_fd, write_fd = os.pipe()
        own = uid is not None
        cfg = {"uid": uid, "gid": uid, "read_all": own and not _python_readable_by_others(),
               "folder": tmp, "program": path, "report_fd": write_fd,
               "cpu_seconds": limits.cpu_seconds or int(timeout) + 1,
               "memory_bytes": limits.memory_bytes, "file_bytes": limits.file_bytes,
               "processes": limits.processes + (0 if own else _user_threads(os.getuid()))}
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
        except BaseException:
            os.close(read_fd)
            raise
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
        if not report and not timed_out:
            raise SandboxError("human_eval sandbox: the runner stopped before the program ran: "
                               + _failure_detail(err, proc.returncode))
        boundary = _describe(report, root)
        if timed_out:
            return ExecResult(False, "timeout", f"no exit within {timeout:g} s", boundary, report)
        if proc.returncode == 0:
            return ExecResult(True, "passed", "", boundary, report)
        return ExecResult(False, "failed", _failure_detail(err, proc.returncode), boundary,
                          report)


def truncate_completion(text: str, stop: Sequence[str] = DEFAULT_STOP) -> str:
    """The completion up to the first top-level line that starts something new (the HumanEval
    paper's stop sequences)."""
    from .prompts import cut_at_stop
    return cut_at_stop(text, stop)
