"""The HumanEval sandbox as a boundary (``ms_llm.evaluation.sandbox``): hostile programs are
run and what they tried is checked from outside (processes left in /proc, files written, secrets
read). A test skips only where the platform cannot enforce its property: the uid-based parts need
root (CI runs as root), the rest need root or Landlock; the skip reason names which."""
from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys

import pytest

from ms_llm.evaluation.sandbox import Limits, run_program

if sys.platform != "linux":
    pytest.skip("the sandbox's boundary is built from Linux features", allow_module_level=True)
REPORT = run_program("pass").report      # what the runner could enforce on this machine
LANDLOCK_ABI = int(REPORT["landlock"][4:]) if REPORT["landlock"].startswith("abi ") else 0
LANDLOCK = LANDLOCK_ABI > 0
OWN_UID = "uid" in REPORT
needs_own_uid = pytest.mark.skipif(not OWN_UID, reason="no uid of its own for the sandbox (not "
                                   "root, or no other id mapped): RLIMIT_NPROC counts all the "
                                   "user's processes; a process that calls setsid leaves the "
                                   "session the cleanup covers")
needs_own_uid_or_landlock = pytest.mark.skipif(
    not (OWN_UID or LANDLOCK), reason="neither an own uid (root) nor Landlock: not enforced")


def _marked(marker: str) -> list:
    """Pids of live processes whose command line holds ``marker``."""
    found = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{name}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in cmd and state not in "ZX":
            found.append(int(name))
    return found


def _sleep_argv(marker: str) -> str:
    return f"['sleep', '3600.{marker}']"


@needs_own_uid
def test_fork_bomb_hits_the_process_limit_and_nothing_is_left():
    marker = str(secrets.randbelow(10**9))
    program = f"""
import errno, os
n = 0
while True:
    try:
        pid = os.fork()
    except OSError as e:
        assert e.errno == errno.EAGAIN, e
        break
    if pid == 0:
        os.execv('/bin/sleep', {_sleep_argv(marker)})
    n += 1
assert 0 < n < 16, n
"""
    r = run_program(program, timeout=10, limits=Limits(processes=16))
    assert r.status == "passed", r
    assert _marked(marker) == []


@needs_own_uid
def test_daemonized_process_is_gone_when_the_program_returns():
    marker = str(secrets.randbelow(10**9))
    program = f"""
import os
execd_r, execd_w = os.pipe()               # close-on-exec: EOF once the daemon has exec'd
pid_r, pid_w = os.pipe()
if os.fork() == 0:
    os.setsid()
    pid = os.fork()
    if pid == 0:
        os.execv('/bin/sleep', {_sleep_argv(marker)})
    os.write(pid_w, str(pid).encode())
    os._exit(0)
os.close(execd_w)
os.close(pid_w)
os.wait()
assert os.read(execd_r, 1) == b''
pid = int(os.read(pid_r, 20))
assert b'{marker}' in open(f'/proc/{{pid}}/cmdline', 'rb').read()
"""
    r = run_program(program, timeout=10)
    assert r.status == "passed", r                # the daemon ran while the program did
    assert _marked(marker) == []


@needs_own_uid_or_landlock
def test_writes_outside_the_private_folder_fail(tmp_path):
    targets = [str(tmp_path / "outside")]
    if LANDLOCK:                 # world-writable folders: only Landlock stops those
        targets.append(f"/tmp/ms_llm_sandbox_test_{secrets.token_hex(4)}")
    for target in targets:
        r = run_program(f"open({target!r}, 'w').write('x')")
        assert r.status == "failed" and "Permission" in r.detail, (target, r)
        assert not os.path.exists(target)
    assert run_program("open('inside', 'w').write('x')\n"
                       "import tempfile\ntempfile.TemporaryFile().write(b'x')").passed


@needs_own_uid_or_landlock
def test_parent_environment_is_not_visible(tmp_path):
    """The secret is in the parent's environment from its start, so /proc/<ppid>/environ
    would show it (a variable set later with putenv would not be there)."""
    secret = "sandbox-secret-" + secrets.token_hex(8)
    program = (f"import os\nassert {secret!r} not in repr(os.environ)\n"
               "assert set(os.environ) <= {'PATH', 'LANG', 'HOME', 'TMPDIR', 'PYTHONHASHSEED',"
               " 'OMP_NUM_THREADS', 'LC_CTYPE'}, os.environ\n"
               "try:\n    data = open(f'/proc/{os.getppid()}/environ', 'rb').read()\n"
               "except PermissionError:\n    data = b''\n"
               f"assert {secret.encode()!r} not in data\n")
    parent = ("import sys\nfrom ms_llm.evaluation.sandbox import run_program\n"
              f"r = run_program({program!r})\nprint(r.status, r.detail)\n")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, MS_LLM_TEST_SECRET=secret, PYTHONPATH=repo)
    out = subprocess.run([sys.executable, "-c", parent], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "passed", (out.stdout, out.stderr)


def test_sandbox_limits():
    assert run_program("print('ok')").status == "passed"
    r = run_program("raise SystemExit(3)")
    assert r.status == "failed"
    r = run_program("import time\nwhile True: time.sleep(0.1)", timeout=1)
    assert r.status == "timeout"
    r = run_program("import os\nassert os.getcwd().startswith(os.environ['TMPDIR'])")
    assert r.passed
    r = run_program("x = bytearray(3 << 30)")       # over the 2 GiB address-space limit
    assert r.status == "failed" and "MemoryError" in r.detail, r
    r = run_program("open('big', 'wb').write(bytes(2 << 20))")   # over the 1 MiB file limit
    assert r.status == "failed", r
    # a child it forked dies with it on timeout (its own session)
    r = run_program("import os, time\nif os.fork() == 0: time.sleep(60)\ntime.sleep(60)",
                    timeout=1)
    assert r.status == "timeout"


def test_sandbox_starts_without_forking_the_parent(monkeypatch):
    """No ``preexec_fn`` (nor ``user`` / ``group``): with one, Python fork()s the (possibly
    many-GB) parent, which failed in CI with 'Cannot allocate memory'; without one it uses vfork
    / posix_spawn."""
    from ms_llm.evaluation import sandbox
    seen = []
    real = subprocess.Popen

    def recording(*args, **kwargs):
        seen.append(kwargs)
        return real(*args, **kwargs)
    monkeypatch.setattr(sandbox.subprocess, "Popen", recording)
    assert sandbox.run_program("print('ok')").passed
    assert seen and seen[0].get("preexec_fn") is None and seen[0].get("start_new_session")
    assert not any(seen[0].get(k) is not None for k in ("user", "group", "extra_groups"))


def test_cpu_and_memory_limits_trip():
    r = run_program("while True: pass", timeout=8, limits=Limits(cpu_seconds=1))
    assert r.status == "failed" and "CPU time limit" in r.detail, r
    r = run_program("x = bytearray(1 << 30)", limits=Limits(memory_bytes=512 << 20))
    assert r.status == "failed" and "MemoryError" in r.detail, r


def test_network_is_unreachable():
    if REPORT.get("netns") is not True and LANDLOCK_ABI < 4:
        pytest.skip(f"no network namespace and no Landlock with TCP rules (ABI 4): {REPORT}")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        r = run_program(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), 2)")
    assert r.status == "failed" and ("Permission" in r.detail or "refused" in r.detail
                                     or "unreachable" in r.detail), r


def test_a_runner_that_cannot_confine_itself_is_an_error(tmp_path, monkeypatch):
    """Not a failed candidate: every HumanEval problem would silently score 0."""
    from ms_llm.evaluation import sandbox
    bad = tmp_path / "runner.py"
    bad.write_text("raise SystemExit('sandbox: landlock_restrict_self: Invalid argument')\n")
    monkeypatch.setattr(sandbox, "RUNNER", str(bad))
    with pytest.raises(sandbox.SandboxError, match="stopped before the program ran: sandbox: "
                                                   "landlock_restrict_self"):
        run_program("pass")


@pytest.mark.parametrize("mapped, expected", [
    ([(0, 1 << 32)], (1_900_000_000, 2_000_000_000)),      # an ordinary host
    ([(0, 65536)], (33267, 65534)),                         # a rootless container
    ([(0, 1)], None),                                       # only root mapped
])
def test_the_sandbox_id_is_drawn_from_mapped_ids(monkeypatch, mapped, expected):
    """Root inside a user namespace cannot switch to an unmapped id (EINVAL)."""
    from ms_llm.evaluation import sandbox
    monkeypatch.setattr(sandbox, "_mapped", lambda kind: mapped)
    assert sandbox._sandbox_range() == expected
