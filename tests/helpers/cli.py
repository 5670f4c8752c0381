"""Run the installed ``ms-llm`` console script from a test, as a user would: this interpreter's
entry point (``pip install -e .``), MindSpore's C++ logs at errors only (so stderr holds just
the command's own messages), a bounded wait."""
import os
import subprocess
import sys
from typing import Optional


def ms_llm_exe() -> str:
    """The ``ms-llm`` script next to this interpreter (a clear failure when it is missing)."""
    exe = os.path.join(os.path.dirname(sys.executable), "ms-llm")
    assert os.path.isfile(exe), "the ms-llm entry point is missing: pip install -e ."
    return exe


def run_ms_llm(*args, cwd=None, stdin: Optional[str] = None, timeout: float = 300,
               env: Optional[dict] = None) -> subprocess.CompletedProcess:
    """``ms-llm ARGS`` with captured text output; ``env`` adds to this process's environment."""
    full = dict(os.environ, **(env or {}))
    full.setdefault("GLOG_v", "3")
    return subprocess.run([ms_llm_exe(), *[str(a) for a in args]], input=stdin,
                          capture_output=True, text=True, cwd=cwd, timeout=timeout, env=full)


def with_key(argv, key: str, value: str) -> list:
    """``argv`` (``--section.key VALUE`` pairs) with ``--key`` set to ``value``: replaced where
    it is given, else appended (a key given twice on the command line is refused)."""
    out = list(argv)
    flag = f"--{key}"
    if flag in out:
        out[out.index(flag) + 1] = value
        return out
    return out + [flag, value]


def last_wins(argv) -> list:
    """A command line composed in a test (a base list and its changes) with each
    ``--section.key`` given once, its last value kept (``ms_llm.config.merge_overrides``):
    ``ms-llm train`` refuses a key given twice. Arguments that are not ``--section.key`` pairs
    (the command, a YAML path) stay first."""
    from ms_llm.config import merge_overrides
    head, pairs, i, argv = [], [], 0, [str(a) for a in argv]
    while i < len(argv):
        a = argv[i]
        if a.startswith("--") and "." in a.split("=")[0]:
            n = 1 if "=" in a else 2
            pairs += argv[i:i + n]
            i += n
        else:
            head.append(a)
            i += 1
    return head + merge_overrides(pairs)
