"""Fault tolerance in one process: the non-finite guard (training.nan_policy stop | skip, the
checkpoint's finite check), the exact-resume state (RNG incl. dropout, LR schedule), the data
position across data-parallel sizes (sample indices), the restart supervisor's loop and the test
hooks' parsing. The real kill-and-restart under msrun is tests/launch/test_restart.py."""
import json
import os
import subprocess

import numpy as np
import pytest
from helpers.parallel_common import TINY_MODEL

from ms_llm.checkpoint.native import dcp
from ms_llm.config import ConfigError, load_config
from ms_llm.data.dataset import BatchIterator
from ms_llm.training import faults, restart
from ms_llm.training.nonfinite import NonFiniteError, NonFiniteGuard
from ms_llm.training.lr_schedule import check_lr_schedule
from ms_llm.training.trainer import Trainer
from helpers.paths import ROOT

TINY = TINY_MODEL + ["--training.micro_batch_size", "4",
        "--training.global_batch_size", "4", "--training.progress_bar", "false",
        "--training.lr_warmup_steps", "2", "--training.lr", "3e-3", "--training.log_interval", "1",
        "--training.jit", "false"]
CONFIG = os.path.join(ROOT, "configs", "tiny.yaml")
PARAM = "decoder.layers.1.mlp.linear_fc2.weight"


def cfg_of(tmp_path, name, *extra):
    return load_config(CONFIG, TINY + ["--training.output_dir", str(tmp_path / name), *extra])


# ------------------------------------------------------------------ data position
class _Samples:
    """A dataset whose sample i is just i (the loader's index bookkeeping is what is tested)."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"tokens": np.array([i])}


def _steps(dp, accum, mbs, seed, n, steps, state=None):
    """Per global step, the sorted dataset indices all dp ranks consumed (as the trainer does:
    every rank draws ``accum`` micro-batches per step); plus rank 0's loader state."""
    loaders = [BatchIterator(_Samples(n), mbs, seed, dp_rank=r, dp_size=dp) for r in range(dp)]
    for ld in loaders:
        ld.trace = []
        if state:
            ld.load_state_dict(state)
    out = []
    for _ in range(steps):
        before = [len(ld.trace) for ld in loaders]
        for ld in loaders:
            for _ in range(accum):
                next(ld)
        out.append(sorted(i for ld, b in zip(loaders, before) for mb in ld.trace[b:] for i in mb))
    return out, loaders[0].state_dict()


def _reference_stream(seed, n, count):
    """The global sample order written out independently: epoch e is
    RandomState(seed + e).permutation(n)."""
    perms = np.concatenate([np.random.RandomState(seed + e).permutation(n)
                            for e in range(count // n + 1)])
    return perms[:count].tolist()


def test_resume_at_another_dp_size_consumes_the_same_samples():
    # global batch 8, micro-batch 1: dp=4 runs 2 micro-batches per step, dp=2 runs 4; 23 samples
    # so the 6 steps cross two epoch boundaries
    seed, n, gbs = 7, 23, 8
    full, _ = _steps(4, 2, 1, seed, n, 6)
    first, state = _steps(4, 2, 1, seed, n, 3)
    rest, _ = _steps(2, 4, 1, seed, n, 3, state)
    assert state == {"consumed_samples": 3 * gbs}
    assert first + rest == full
    ref = _reference_stream(seed, n, 6 * gbs)
    assert full == [sorted(ref[s * gbs:(s + 1) * gbs]) for s in range(6)]


# ------------------------------------------------------------------ non-finite guard
def test_guard_policies():
    grads = [np.ones(2, np.float32), np.array([1.0, np.inf], np.float32)]
    assert not NonFiniteGuard("stop", 0).check(1, 2.0, 3.0, ["a", "b"], grads)
    with pytest.raises(NonFiniteError, match=r"step 5: .*first non-finite gradient: b"):
        NonFiniteGuard("stop", 0).check(5, 2.0, float("inf"), ["a", "b"], grads)
    skip = NonFiniteGuard("skip", 1)
    assert skip.check(2, float("nan"), float("nan"), ["a", "b"], grads) and skip.skipped == 1
    with pytest.raises(NonFiniteError, match="2 steps skipped, more than training.max_skipped"):
        skip.check(3, 1.0, float("nan"), ["a", "b"], grads)


def test_nan_stop_names_the_parameter_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch,
                                                                          capsys):
    from ms_llm.cli.train import main
    save = tmp_path / "ckpt"
    monkeypatch.setenv(faults.NAN_ENV, f"3:{PARAM}")
    rc = main([CONFIG, *TINY, "--training.output_dir", str(tmp_path / "stop"),
               "--training.max_steps", "5", "--checkpoint.save_dir", str(save),
               "--checkpoint.save_interval", "1"])
    err = capsys.readouterr().err
    assert rc == 3, err
    assert "step 3: " in err and f"first non-finite gradient: {PARAM}" in err, err
    latest = dcp.find_latest_complete(str(save))
    assert latest.endswith("iter_0000002") and sorted(os.listdir(save)) == [
        "iter_0000001", "iter_0000002", "latest_checkpointed_iteration.txt", "run.json"]
    rows = [json.loads(line) for line in open(tmp_path / "stop" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]


def test_nan_skip_logs_the_step_and_a_nan_checkpoint_is_never_written(tmp_path, monkeypatch):
    monkeypatch.setenv(faults.NAN_ENV, f"2:{PARAM}")
    trainer = Trainer(cfg_of(tmp_path, "skip", "--training.max_steps", "4",
                             "--training.nan_policy", "skip",
                             "--training.max_skipped_steps", "1",
                             "--checkpoint.save_dir", str(tmp_path / "ckpt")))
    records = trainer.fit()
    assert [r["skipped"] for r in records] == [False, True, False, False]
    assert [r["skipped_steps"] for r in records] == [0, 1, 1, 1]
    assert np.isnan(records[1]["grad_norm"]) and np.isfinite([r["loss"] for r in records]).all()
    assert all(np.isfinite(p.asnumpy()).all() for p in trainer.params)
    # a NaN in the weights: the save is refused, the step-4 checkpoint stays the newest
    w = dict(trainer.named_params)[PARAM]
    w.set_data(w * float("nan"))
    trainer.step = 5
    with pytest.raises(NonFiniteError, match=f"checkpoint step 5 not written: {PARAM}"):
        trainer.save()
    assert dcp.find_latest_complete(str(tmp_path / "ckpt")).endswith("iter_0000004")
    assert not [n for n in os.listdir(tmp_path / "ckpt") if "0000005" in n]


# ------------------------------------------------------------------ exact resume
def _expert_bias(trainer):
    return {n: q.asnumpy().copy() for n, q in trainer.named_params if n.endswith("expert_bias")}


def test_resume_restores_dropout_rng_lr_schedule_and_expert_bias(tmp_path):
    # dropout (MindSpore's legacy kernel-seed counters), the LR schedule, and an MoE model with
    # aux-loss-free routing (expert_bias updated after every step)
    moe = ["--model.mlp_type", "moe", "--model.num_moe_experts", "4", "--model.moe_router_topk",
           "2", "--model.moe_ffn_hidden_size", "64", "--model.moe_router_score_function",
           "sigmoid", "--model.moe_router_enable_expert_bias", "true",
           "--model.moe_router_bias_update_rate", "0.01"]
    drop = ["--model.hidden_dropout", "0.2", "--training.lr_decay_steps", "4",
            "--training.lr_warmup_steps", "1", *moe]
    ref = Trainer(cfg_of(tmp_path, "full", "--training.max_steps", "4", *drop))
    full = ref.fit()
    save = str(tmp_path / "ckpt")
    Trainer(cfg_of(tmp_path, "a", "--training.max_steps", "2", "--checkpoint.save_dir", save,
                   *drop)).fit()
    state = dcp.read_state(os.path.join(save, "iter_0000002"))
    assert state["lr_schedule"]["lr_decay_steps"] == 4
    assert state["rng"]["mindspore_kernel_seeds"], "dropout's seed counter is saved"
    resumed = Trainer(cfg_of(tmp_path, "b", "--training.max_steps", "4",
                             "--checkpoint.save_dir", save, "--training.resume", "auto", *drop))
    rest = resumed.fit()
    bias, ref_bias = _expert_bias(resumed), _expert_bias(ref)
    assert bias and bias.keys() == ref_bias.keys()
    assert any(np.abs(b).max() > 0 for b in bias.values())   # the bias did move
    for name in bias:   # sign updates of +-0.01 from identical counts: exact
        np.testing.assert_array_equal(bias[name], ref_bias[name], err_msg=name)
    # same process layout, same kernels: only summation-order-free replays, so 1e-6
    np.testing.assert_allclose([r["loss"] for r in rest], [r["loss"] for r in full[2:]],
                               rtol=1e-6)
    np.testing.assert_allclose([r["lr"] for r in rest], [r["lr"] for r in full[2:]], rtol=1e-12)
    # a changed schedule is reported on resume (the config's is used)
    said = []
    check_lr_schedule(state, cfg_of(tmp_path, "c", "--training.max_steps", "4", *drop[:4]),
                      said.append)
    assert len(said) == 1 and "LR schedule differs from the checkpoint's (lr_warmup_steps 1 -> 2)" \
        in said[0]


# ------------------------------------------------------------------ restart supervisor
def test_restart_loop_relaunches_with_resume_and_gives_up(tmp_path, capsys):
    calls = []

    def run(cmd, env):
        calls.append((cmd, env[faults.ATTEMPT_ENV]))
        return 0 if len(calls) == 3 else 7

    template = ["msrun", "--master_port", restart.PORT, "--log_dir", restart.LOG_DIR, "e.py",
                "c.yaml"]
    assert restart.run_with_restarts(template, 2, str(tmp_path), 9000, "L", run) == 0
    assert [c[1] for c in calls] == ["0", "1", "2"]
    assert calls[0][0] == ["msrun", "--master_port", "9000", "--log_dir", "L", "e.py", "c.yaml"]
    assert calls[2][0] == ["msrun", "--master_port", "9002", "--log_dir", "L/restart_2", "e.py",
                           "c.yaml", "--training.resume", "auto"]
    err = capsys.readouterr().err
    assert "attempt 2 (restart 1/2) after exit code 7; resuming from step 0" in err
    calls.clear()
    assert restart.run_with_restarts(template, 1, str(tmp_path), 9000, "L",
                                     lambda c, e: calls.append(c) or 5) == 5
    assert len(calls) == 2 and "giving up after 1 restart(s); last exit code 5" in \
        capsys.readouterr().err


def test_restart_needs_a_save_dir_and_hooks_parse(monkeypatch, capsys):
    rc = restart.main(["--max-restarts", "1", "--save-dir", "", "--master-port", "1",
                       "--log-dir", "L", "--", "msrun", "e.py", CONFIG])
    assert rc == 2 and "needs checkpoint.save_dir" in capsys.readouterr().err
    # the launcher: MAX_RESTARTS without a save_dir stops before msrun, in one line
    env = dict(os.environ, MAX_RESTARTS="1", NPROC="1")
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "pretrain.sh"), CONFIG],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 2 and r.stderr.strip() == (
        "pretrain.sh: MAX_RESTARTS=1 needs checkpoint.save_dir (a restart resumes from it)")
    with pytest.raises(ConfigError, match="training.max_restarts needs checkpoint.save_dir"):
        load_config(CONFIG, ["--training.max_restarts", "1"])
    monkeypatch.setenv(faults.FAULT_ENV, "4:1")
    assert faults.fault_target() == (4, 1)
    monkeypatch.setenv(faults.ATTEMPT_ENV, "1")
    assert faults.fault_target() is None        # relaunches never re-inject
    monkeypatch.setenv(faults.ATTEMPT_ENV, "0")
    monkeypatch.setenv(faults.FAULT_ENV, "four")
    with pytest.raises(ValueError, match="MS_LLM_FAULT_INJECT='four': expected STEP:RANK"):
        faults.fault_target()
