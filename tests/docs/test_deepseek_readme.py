"""docs/features/moe.md's DeepSeek-V3 command runs as typed (2 steps): the proxy config trains at ep=2 with an
MTP depth under msrun through scripts/pretrain.sh with finite losses (the MTP loss logged). Its
numerics
against one process are checked in test_deepseek_parallel."""
import json
import os
import subprocess

import numpy as np
import pytest

from helpers.paths import ROOT
from helpers.pretrain_sh import pretrain_env


@pytest.mark.msrun
def test_readme_deepseek_proxy_ep2_command(tmp_path):
    out = tmp_path / "out"
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "pretrain.sh"),
                        os.path.join(ROOT, "configs", "deepseek_v3_proxy.yaml"),
                        "--parallel.expert_model_parallel_size", "2",
                        "--model.mtp_num_layers", "1",
                        "--training.max_steps", "2", "--training.log_interval", "1",
                        "--training.output_dir", str(out)],
                       capture_output=True, text=True, timeout=600,
                       env=pretrain_env(tmp_path, NPROC="2"), cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert len(rows) == 2 and all(np.isfinite(row["loss"]) for row in rows)
    assert all(np.isfinite(row["mtp_1_loss"]) for row in rows)
