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


# Every limit is set by the fresh interpreter itself, before it runs the program, and the child
# is started without a ``preexec_fn``: with one, Python must fork() the parent, and fork() of a
# large parent (a training process maps many GB) fails with "Cannot allocate memory" when the
# kernel cannot commit a copy of its writable mappings; without one it uses vfork/posix_spawn,
# which copy nothing. (An RLIMIT_AS set in such a forked child also broke every allocation
# before exec, since the parent's mappings still counted.)
_RUNNER = ("import resource, runpy, sys\n"
           "cpu, fsize, mem = (int(v) for v in sys.argv[1:4])\n"
           "resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))\n"
           "resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))\n"
           "resource.setrlimit(resource.RLIMIT_AS, (mem, mem))\n"
           "sys.argv = sys.argv[4:]\n"
           "runpy.run_path(sys.argv[0], run_name='__main__')\n")
_FILE_BYTES = 1 << 20


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
        limits = [str(int(timeout) + 1), str(_FILE_BYTES), str(_MEMORY_BYTES)]
        proc = subprocess.Popen([sys.executable, "-I", "-B", runner, *limits, path], cwd=tmp,
                                env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, start_new_session=True)
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
