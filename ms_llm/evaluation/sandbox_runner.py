"""The first code a HumanEval sandbox runs, in a fresh ``python -I`` started by ``sandbox.py``.

A standalone script (run by path; it imports nothing from ms_llm, since ``-I`` keeps the
package off the path). It confines its own process, then runs the candidate program in it, so the
parent never needs a ``preexec_fn`` (which would fork() a possibly many-GB parent; see
``sandbox.py``). In order, each step only where the platform allows it, and every step taken is
written as JSON to the report pipe before the candidate's first line runs:

1. resource limits (CPU seconds, address space, file size, no core files, process count);
2. as root: an own network namespace (no interface but a down loopback), then every group
   dropped and the uid / gid switched to the parent-chosen unused id that owns the private
   folder (keeping CAP_DAC_READ_SEARCH alone when Python is installed where others cannot
   read, e.g. under a 0700 ``/root``);
3. ``no_new_privs`` (no setuid program can give privileges back) and a Landlock domain: writes
   only beneath the private folder (and to ``/dev/null``), no TCP bind / connect, no signals or
   abstract sockets to processes outside the sandbox; Landlock also refuses ``/proc/<pid>``
   access (``environ``, ``mem``) to processes outside it.
"""
import ctypes
import json
import os
import resource
import runpy
import struct
import sys

CLONE_NEWNET = 0x40000000
PR_SET_NO_NEW_PRIVS, PR_SET_KEEPCAPS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE = 38, 8, 47, 2
CAP_DAC_READ_SEARCH = 2
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_CREATE_RULESET_VERSION = 1
LANDLOCK_RULE_PATH_BENEATH = 1
WRITE_FILE, TRUNCATE = 1 << 1, 1 << 14
# every right that creates, changes or removes something (ABI 1), REFER (2), TRUNCATE (3)
WRITES_ABI1 = WRITE_FILE | sum(1 << b for b in range(4, 13))
NET_TCP = (1 << 0) | (1 << 1)                          # bind, connect (ABI 4)
SCOPES = (1 << 0) | (1 << 1)                           # abstract unix sockets, signals (ABI 6)

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long


def _errno_text() -> str:
    return os.strerror(ctypes.get_errno())


def set_limits(cfg: dict) -> list:
    done = []
    for name, key in (("RLIMIT_CPU", "cpu_seconds"), ("RLIMIT_FSIZE", "file_bytes"),
                      ("RLIMIT_CORE", None), ("RLIMIT_NPROC", "processes"),
                      ("RLIMIT_AS", "memory_bytes")):
        value = 0 if key is None else cfg[key]
        # CPU: SIGXCPU at the soft limit (named in the result), SIGKILL a second later
        hard = value + 1 if name == "RLIMIT_CPU" else value
        resource.setrlimit(getattr(resource, name), (value, hard))
        done.append(f"{name}={value}")
    return done


def drop_to(uid: int, gid: int, read_all: bool) -> None:
    """Become ``uid`` / ``gid`` with no groups; with ``read_all``, keep only
    CAP_DAC_READ_SEARCH (also across exec), for a Python installed where others cannot read."""
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    if read_all and libc.prctl(PR_SET_KEEPCAPS, 1, 0, 0, 0):
        raise SystemExit(f"sandbox: keepcaps: {_errno_text()}")
    os.setresuid(uid, uid, uid)
    if os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid):
        raise SystemExit("sandbox: the uid / gid switch did not take")
    if read_all:
        cap = 1 << CAP_DAC_READ_SEARCH
        header = struct.pack("=Ii", _LINUX_CAPABILITY_VERSION_3, 0)
        data = struct.pack("=6I", cap, cap, cap, 0, 0, 0)   # effective, permitted, inheritable
        if libc.capset(header, data) or libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE,
                                                   CAP_DAC_READ_SEARCH, 0, 0):
            raise SystemExit(f"sandbox: capset: {_errno_text()}")


def landlock(folder: str) -> str:
    """Confine this process; the ABI version used, or why not."""
    abi = libc.syscall(SYS_LANDLOCK_CREATE_RULESET, None, 0, LANDLOCK_CREATE_RULESET_VERSION)
    if abi < 1:
        return f"unavailable ({_errno_text()})"
    writes = WRITES_ABI1 | (1 << 13 if abi >= 2 else 0) | (TRUNCATE if abi >= 3 else 0)
    fields = [writes] + ([NET_TCP] if abi >= 4 else []) + ([SCOPES] if abi >= 6 else [])
    attr = struct.pack(f"={len(fields)}Q", *fields)
    ruleset = libc.syscall(SYS_LANDLOCK_CREATE_RULESET, attr, len(attr), 0)
    if ruleset < 0:
        return f"unavailable (create_ruleset: {_errno_text()})"
    for path, access in ((folder, writes), ("/dev/null", WRITE_FILE | (writes & TRUNCATE))):
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        rule = struct.pack("=Qi", access, fd)
        if libc.syscall(SYS_LANDLOCK_ADD_RULE, ruleset, LANDLOCK_RULE_PATH_BENEATH, rule, 0):
            raise SystemExit(f"sandbox: landlock rule for {path}: {_errno_text()}")
        os.close(fd)
    if libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset, 0):
        raise SystemExit(f"sandbox: landlock_restrict_self: {_errno_text()}")
    os.close(ruleset)
    return f"abi {abi}"


def main() -> None:
    cfg = json.loads(sys.argv[1])
    report = {"limits": set_limits(cfg)}
    if os.geteuid() == 0:
        report["netns"] = (libc.unshare(CLONE_NEWNET) == 0) or f"unavailable ({_errno_text()})"
    if cfg["uid"] is not None:
        drop_to(cfg["uid"], cfg["gid"], cfg["read_all"])
        report["uid"] = cfg["uid"]
        report["read_all"] = cfg["read_all"]
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0):
        raise SystemExit(f"sandbox: no_new_privs: {_errno_text()}")
    report["landlock"] = landlock(cfg["folder"])
    os.write(cfg["report_fd"], json.dumps(report).encode())
    os.close(cfg["report_fd"])
    sys.argv = [cfg["program"]]
    runpy.run_path(cfg["program"], run_name="__main__")


if __name__ == "__main__":
    main()
