"""Running model-written code (HumanEval) in a separate, limited Python process.

What the sandbox is: a fresh interpreter in isolated mode (``-I``: no user site, no
``PYTHONPATH``, no current directory on the path) started in an empty temporary directory with
a minimal environment, no stdin, its own session (so a timeout kills every process it forked),
and resource limits: wall time, CPU time, address space, file size and number of processes. What
it is not: a security boundary against hostile code (it can still read files and open sockets
the user can); run untrusted models' code in a container, as the HumanEval authors advise.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Sequence

DEFAULT_STOP = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")
_MEMORY_BYTES = 2 << 30


@dataclass
class ExecResult:
    passed: bool
    status: str            # "passed", "failed", "timeout"
    detail: str = ""


def human_eval_program(problem: dict, completion: str) -> str:
    """The program HumanEval runs: the prompt, the completion, the tests and the call of
    ``check`` on the entry point."""
    return (problem["prompt"] + completion + "\n\n" + problem["test"] + "\n\n"
            + f"check({problem['entry_point']})\n")


# The address-space limit is set by the fresh interpreter itself, before it runs the program: set
# in the forked child of a large parent (a training process maps many GB), any allocation between
# the limit and exec fails ("Cannot allocate memory") because the parent's mappings still count.
_RUNNER = ("import resource, runpy, sys\n"
           f"resource.setrlimit(resource.RLIMIT_AS, ({_MEMORY_BYTES}, {_MEMORY_BYTES}))\n"
           "sys.argv = sys.argv[1:]\n"
           "runpy.run_path(sys.argv[0], run_name='__main__')\n")


def _limits(timeout: float):
    cpu = int(timeout) + 1

    def apply() -> None:
        import resource
        os.setsid()
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    return apply


def run_program(program: str, timeout: float = 10.0) -> ExecResult:
    """Run ``program``; passed means exit status 0 within ``timeout`` seconds."""
    with tempfile.TemporaryDirectory(prefix="ms_llm_humaneval_") as tmp:
        path = os.path.join(tmp, "program.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(program)
        env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "TMPDIR": tmp, "LANG": "C.UTF-8",
               "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
        runner = os.path.join(tmp, "limits.py")
        with open(runner, "w", encoding="utf-8") as f:
            f.write(_RUNNER)
        proc = subprocess.Popen([sys.executable, "-I", "-B", runner, path], cwd=tmp, env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, preexec_fn=_limits(timeout))
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return ExecResult(False, "timeout", f"no exit within {timeout:g} s")
        if proc.returncode == 0:
            return ExecResult(True, "passed")
        tail = err.decode("utf-8", "replace").strip().splitlines()
        return ExecResult(False, "failed", tail[-1] if tail else f"exit {proc.returncode}")


def truncate_completion(text: str, stop: Sequence[str] = DEFAULT_STOP) -> str:
    """The completion up to the first top-level line that starts something new (the HumanEval
    paper's stop sequences)."""
    from .prompts import cut_at_stop
    return cut_at_stop(text, stop)
