"""scripts/pretrain.sh run as a user types it (bash, a fresh port, logs under the test's folder):
the launcher tests and the README's training commands."""
import json
import os
import subprocess
import sys

import numpy as np

from ms_llm.launch.msrun import free_port

from .paths import ROOT

PRETRAIN_SH = os.path.join(ROOT, "scripts", "pretrain.sh")


def pretrain_env(tmp_path, **extra) -> dict:
    """This environment for one pretrain.sh launch: a free MASTER_PORT, worker logs in
    ``tmp_path/logs``, a 60 s cluster time-out, this interpreter first on PATH, and none of the
    caller's node settings (NPROC, NNODES, ...) unless given in ``extra``."""
    env = dict(os.environ, MASTER_PORT=str(free_port()), LOG_DIR=str(tmp_path / "logs"),
               CLUSTER_TIME_OUT="60")
    env.update(extra)
    for name in ("NPROC", "NNODES", "NODE_RANK", "NPUS_PER_NODE", "MASTER_ADDR"):
        if name not in extra:
            env.pop(name, None)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return env


def run_readme_training(tmp_path, *args, nproc="2") -> str:
    """A README training command (pretrain.sh ``args``) for two logged steps on ``nproc``
    workers; asserts it succeeds with finite losses and returns its stdout."""
    out = tmp_path / "out"
    env = pretrain_env(tmp_path, NPROC=nproc)
    r = subprocess.run(["bash", PRETRAIN_SH, *args,
                        "--training.max_steps", "2", "--training.log_interval", "1",
                        "--training.output_dir", str(out)],
                       capture_output=True, text=True, timeout=400, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert len(rows) == 2 and all(np.isfinite(row["loss"]) for row in rows)
    return r.stdout
