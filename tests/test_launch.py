"""scripts/pretrain.sh end to end under real msrun (one job each: success and a failing worker)."""
import json
import os
import socket
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--model.num_layers", "2", "--model.hidden_size", "64", "--model.ffn_hidden_size", "128",
         "--model.num_attention_heads", "4", "--model.num_query_groups", "2",
         "--model.kv_channels", "16", "--data.seq_length", "32",
         "--training.micro_batch_size", "4", "--training.global_batch_size", "8",
         "--training.log_interval", "1"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tmp_path, *args, timeout=300):
    env = dict(os.environ, MASTER_PORT=str(free_port()), LOG_DIR=str(tmp_path / "logs"),
               CLUSTER_TIME_OUT="60")
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return subprocess.run(["bash", os.path.join(ROOT, "scripts", "pretrain.sh"), *args],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path)


@pytest.mark.msrun
def test_pretrain_sh_trains_and_plots(tmp_path):
    out = tmp_path / "out"
    r = launch(tmp_path, *SMALL, "--training.max_steps", "4", "--training.output_dir", str(out))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    assert "iteration        4/       4" in r.stdout and "lm loss:" in r.stdout
    p = subprocess.run([sys.executable, "-m", "ms_llm.cli", "plot", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and os.path.isfile(out / "loss.png")


@pytest.mark.msrun
def test_pretrain_sh_fails_when_the_worker_fails(tmp_path):
    # The config is valid (the launcher's pre-check passes); the worker then fails on the data.
    r = launch(tmp_path, *SMALL, "--data.corpus", str(tmp_path / "missing.jsonl"),
               "--training.output_dir", str(tmp_path / "out"))
    assert r.returncode != 0
    log = open(tmp_path / "logs" / "worker_0.log").read()
    assert "missing.jsonl" in log
