"""Automatic restart for real: ``MS_LLM_FAULT_INJECT=4:1 MAX_RESTARTS=1 NPROC=2 bash
scripts/pretrain.sh`` -- rank 1 SIGKILLs itself in step 4, the job exits non-zero within the
time-out, the supervisor relaunches it with resume=auto from the step-2 checkpoint, and
metrics.jsonl (restarted steps appended) gives the uninterrupted curve. The first launch also
has a NaN injected into one gradient at step 3 with training.nan_policy skip (the multi-rank
guard: skipped on both ranks, the parameter named). The same test then resumes the dp=2
checkpoint at dp=1 in this process and checks the samples it consumes. (docs/features/fault_tolerance.md's command,
with the small model of test_launch.)"""
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from ms_llm.config import load_config
from ms_llm.training.trainer import Trainer
from helpers.paths import ROOT

from helpers.msrun import free_port
from helpers.parallel_common import TINY_MODEL

SMALL = TINY_MODEL + ["--training.micro_batch_size", "4", "--training.global_batch_size", "8",
         "--training.log_interval", "1", "--training.jit", "false",
         "--training.progress_bar", "false", "--training.max_steps", "6",
         "--training.lr_warmup_steps", "2"]
CONFIG = os.path.join(ROOT, "configs", "tiny.yaml")
PARAM = "decoder.layers.0.self_attention.linear_qkv.weight"
# dp=2 against one process with 2 accumulated micro-batches: the same sums in another order
# (fp32 all-reduce of two halves vs one accumulation), ~1e-7 relative per step, kept below 1e-5
# over 6 AdamW steps.
RTOL = 1e-5
# msrun start-up (~15-20 s, 2-4x on a loaded machine) twice, the kill detection and 6 tiny steps
TIMEOUT_S = 600


def _unix_time(pattern, text):
    m = re.search(pattern + r".*?at unix time ([0-9.]+)", text)
    assert m, (pattern, text[-3000:])
    return float(m.group(1))


@pytest.mark.msrun
def test_killed_worker_restarts_and_continues_the_curve(tmp_path):
    out, save, logs = tmp_path / "out", tmp_path / "ckpt", tmp_path / "logs"
    env = dict(os.environ, MASTER_PORT=str(free_port()), LOG_DIR=str(logs), NPROC="2",
               CLUSTER_TIME_OUT="60", MAX_RESTARTS="1", MS_LLM_FAULT_INJECT="4:1",
               # MindSpore's scheduler declares a silent node dead after MS_NODE_TIMEOUT (~30 s
               # by default, measured); 15 s ends the failed launch sooner
               MS_NODE_TIMEOUT="15", MS_LLM_NAN_INJECT=f"3:{PARAM}")
    for name in ("NNODES", "NODE_RANK", "NPUS_PER_NODE", "MASTER_ADDR",
                 "MS_LLM_RESTART_ATTEMPT"):
        env.pop(name, None)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    job = subprocess.Popen(["bash", os.path.join(ROOT, "scripts", "pretrain.sh"), CONFIG, *SMALL,
                            "--training.output_dir", str(out), "--checkpoint.save_dir", str(save),
                            "--checkpoint.save_interval", "2", "--training.nan_policy", "skip"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                           cwd=tmp_path)
    # meanwhile, the uninterrupted run in one process (dp=1, two accumulated micro-batches)
    ref_rows = Trainer(load_config(CONFIG, SMALL + [
        "--training.output_dir", str(tmp_path / "ref")])).fit()
    try:
        stdout, err = job.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        job.kill()
        raise
    first_log = open(logs / "worker_1.log", errors="replace").read()
    assert job.returncode == 0, stdout[-3000:] + err[-3000:] + first_log[-3000:]
    assert "attempt 1 failed with exit code" in err and \
        "attempt 2 (restart 1/1) after exit code" in err, err
    assert f"resuming from step 2 ({save}/iter_0000002)" in err, err
    assert "attempt 2 succeeded after 1 restart(s)" in err, err
    killed = _unix_time("rank 1 SIGKILLs itself in step 4", first_log)
    failed = _unix_time("attempt 1 failed", err)
    print(f"\nkill -> job exit: {failed - killed:.1f} s")
    print("\n".join(line for line in err.splitlines() if line.startswith("ms-llm restart")))
    assert failed - killed < 180, "the surviving worker did not end within the time-outs"
    assert os.path.isfile(logs / "restart_1" / "worker_0.log")
    assert "SIGKILLs" not in open(logs / "restart_1" / "worker_1.log").read()

    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    steps = [row["step"] for row in rows]
    # the first launch's rows stay, the relaunch (from step 2) appends 3..6
    assert steps[-4:] == [3, 4, 5, 6] and steps[:2] == [1, 2], steps
    assert all("slowest_rank" in row and row["step_time_max_s"] > 0 for row in rows)
    last = {row["step"]: row for row in rows}
    # the first launch skipped step 3's update on both ranks; its relaunch ran it
    first = rows[:steps.index(3) + 1]
    assert [row["skipped"] for row in first] == [False, False, True]
    assert not any(row["skipped"] for row in rows[-4:])
    for rank in (0, 1):
        log = open(logs / f"worker_{rank}.log", errors="replace").read()
        assert "skipped the update of step 3: " in log and \
            f"first non-finite gradient: {PARAM} (rank {rank})" in log, log[-3000:]
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([last[s][key] for s in range(1, 7)],
                                   [row[key] for row in ref_rows], rtol=RTOL, err_msg=key)
    # the replayed step 3 equals the first launch's loss (same layout, same kernels)
    np.testing.assert_allclose(first[-1]["loss"], last[3]["loss"], rtol=1e-6)

    # resume the dp=2 step-4 checkpoint at dp=1: it consumes exactly the samples of steps 5-6
    one = tmp_path / "ckpt_dp1"
    one.mkdir()
    shutil.copytree(save / "iter_0000004", one / "iter_0000004")
    resumed = Trainer(load_config(CONFIG, SMALL + [
        "--training.output_dir", str(tmp_path / "dp1"), "--checkpoint.save_dir", str(one),
        "--training.resume", "auto"]))
    assert resumed.step == 4
    loader = resumed.data.loader
    loader.trace = []
    rest = resumed.fit()
    n, gbs, seed = len(loader.dataset), 8, loader.seed
    stream = np.concatenate([np.random.RandomState(seed + e).permutation(n)
                             for e in range(6 * gbs // n + 1)])
    for k, step in enumerate((5, 6)):
        got = sorted(i for mb in loader.trace[2 * k:2 * k + 2] for i in mb)
        assert got == sorted(stream[(step - 1) * gbs:step * gbs].tolist()), step
    np.testing.assert_allclose([row["loss"] for row in rest], [last[5]["loss"], last[6]["loss"]],
                               rtol=RTOL)
