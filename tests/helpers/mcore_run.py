"""Megatron-Core's side of the torch_dist checkpoint tests: ``mcore_dist_ckpt.py`` (beside this
file) run in a child process, one gloo process on CPU, so torch's process group never meets
MindSpore's in the test process."""
import os
import subprocess
import sys

import numpy as np

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mcore_dist_ckpt.py")


def run_mcore(mode: str, ckpt, out) -> None:
    """``python mcore_dist_ckpt.py mode ckpt out`` in ``out``'s folder; fails the test with its
    stderr tail when it fails."""
    r = subprocess.run([sys.executable, SCRIPT, mode, str(ckpt), str(out)], capture_output=True,
                       text=True, timeout=600, cwd=str(os.path.dirname(str(out))))
    assert r.returncode == 0, r.stderr[-3000:]


def mcore(mode: str, ckpt, out) -> dict:
    """:func:`run_mcore`, then the arrays the script wrote to ``out`` (an ``.npz``)."""
    run_mcore(mode, ckpt, out)
    return dict(np.load(out))
