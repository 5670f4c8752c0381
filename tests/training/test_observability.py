"""Seeing a run (issue #29): TensorBoard event files read back by tensorboard's own
EventAccumulator, Megatron's timers, the CPU profiler trace, and the deterministic mode under
msrun (one shared 2-worker job)."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from ms_llm.config import load_config
from ms_llm.training.observability.timers import (Timers, format_block, gather_min_max,
                                                  min_max_over_ranks)
from ms_llm.training.trainer import Trainer
from helpers.msrun import ROOT, run_worker_job
from helpers.parallel_common import CONFIG, TINY

PLAIN = TINY + ["--training.jit", "false"]


def _scalars(logdir: str, tag: str):
    from tensorboard.backend.event_processing.event_accumulator import (SCALARS,
                                                                        EventAccumulator)
    acc = EventAccumulator(logdir, size_guidance={SCALARS: 0})   # 0: keep every event
    acc.Reload()
    return acc, [(e.step, e.value) for e in acc.Scalars(tag)]


def _rows(path: str):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# --------------------------------------------------------------------------- TensorBoard
def test_tensorboard_event_files_equal_metrics_jsonl_and_resume_has_each_step_once(tmp_path):
    out, tb, ck = tmp_path / "out", tmp_path / "tb", tmp_path / "ckpt"
    common = PLAIN + ["--training.output_dir", str(out), "--training.tensorboard_dir", str(tb),
                      "--checkpoint.save_dir", str(ck), "--checkpoint.save_interval", "2",
                      "--data.split", "90,10,0", "--training.eval_interval", "2",
                      "--training.eval_iters", "1", "--training.lr_decay_steps", "5"]
    Trainer(load_config(CONFIG, common + ["--training.max_steps", "4"])).fit()
    # The run dies after logging step 4 but before its checkpoint: steps 3-4 get re-run.
    shutil.rmtree(ck / "iter_0000004")
    Trainer(load_config(CONFIG, common + ["--training.max_steps", "5",
                                          "--training.resume", "auto"])).fit()
    rows = _rows(out / "metrics.jsonl")
    # metrics.jsonl keeps the first run's rows of steps 3-4 and appends the resumed run's (the
    # later row counts, as after an automatic restart); the event files hold each step once.
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 3, 4, 5]
    steps = list({r["step"]: r for r in rows if "loss" in r}.values())
    evals = list({r["step"]: r for r in rows if "eval_loss" in r}.values())
    acc, loss = _scalars(str(tb), "lm loss")
    assert [s for s, _ in loss] == [1, 2, 3, 4, 5]
    # Event scalars are float32 (simple_value): equal to the JSONL value rounded to float32.
    for key, tag in (("loss", "lm loss"), ("lr", "learning-rate"), ("grad_norm", "grad-norm"),
                     ("tokens_per_s", "tokens-per-sec")):
        _, got = _scalars(str(tb), tag)
        assert got == [(r["step"], float(np.float32(r[key]))) for r in steps], tag
    _, batch = _scalars(str(tb), "batch-size")
    assert [v for _, v in batch] == [4.0] * 5
    _, val = _scalars(str(tb), "lm loss validation")
    assert val == [(r["step"], float(np.float32(r["eval_loss"]))) for r in evals]
    assert [s for s, _ in val] == [2, 4, 5]
    _, ppl = _scalars(str(tb), "lm loss validation ppl")
    assert [v for _, v in ppl] == [float(np.float32(r["eval_ppl"])) for r in evals]
    # Megatron's second x-axis: consumed samples, in the samples/ sub-run.
    _, vs = _scalars(str(tb / "samples"), "lm loss vs samples")
    assert vs == [(r["consumed_samples"], float(np.float32(r["loss"]))) for r in steps]
    # The resolved config as text.
    text = acc.Tensors("config")[-1].tensor_proto.string_val[0].decode()
    assert json.loads(text.strip("`\n"))["training"]["tensorboard_dir"] == str(tb)


# --------------------------------------------------------------------------- timers
def test_timers_levels_and_min_max():
    assert Timers(0).names() == [] and not Timers(0).enabled
    t0 = Timers(0)
    with t0("forward-backward"):       # level 0: a no-op, nothing recorded, no sync
        pass
    assert t0._timers == {}
    syncs = []
    t1 = Timers(1, sync=lambda: syncs.append(1))
    with t1("optimizer"):
        pass
    with t1("forward-compute"):        # a level-2 timer is a no-op at level 1
        pass
    assert "forward-compute" not in t1._timers and len(syncs) == 2
    with pytest.raises(KeyError, match="unknown timer"):
        t1("optimiser")
    t2 = Timers(2, sync=lambda: None)
    t2("forward-backward").add(0.010)
    t2("forward-compute").add(0.004)
    t2("grads-all-reduce").add(0.001)
    stats = gather_min_max(t2, normalizer=1)
    # backward-compute = forward-backward - forward-compute - gradient reduction
    assert stats["backward-compute"]["max"] == pytest.approx(5.0)
    assert "optimizer" not in stats                      # never ran: not reported
    per_rank = np.array([[3.0, 0.0], [5.0, 2.0]])        # rank 0 did not run timer "b"
    assert min_max_over_ranks(["a", "b"], per_rank) == {"a": {"min": 3.0, "max": 5.0},
                                                        "b": {"min": 2.0, "max": 2.0}}
    assert format_block({"a": {"min": 3.0, "max": 5.0}}).splitlines()[1].endswith(": (3.00, 5.00)")


# --------------------------------------------------------------------------- profiler
@pytest.mark.slow
def test_profile_two_steps_on_cpu_has_the_matmuls(tmp_path):
    """``ms-llm train`` profiles steps 2-3; the trace is Chrome trace JSON with the step's
    matmuls. ms-llm's own OpenBLAS kernels are AOT custom ops, which MindSpore's profiler names
    ``Custom-opN``; with them off (MS_LLM_DISABLE_BLAS=1) the linears are MindSpore's MatMul
    kernels and show up by name."""
    env = dict(os.environ, PYTHONPATH=ROOT, MS_LLM_DISABLE_BLAS="1", GLOG_v="3")
    cmd = [sys.executable, "-m", "ms_llm.cli.train", CONFIG, *PLAIN,
           "--training.output_dir", str(tmp_path / "out"), "--training.max_steps", "3",
           "--training.profile", "true", "--training.profile_step_start", "2",
           "--training.profile_step_end", "4"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    line = next(ln for ln in r.stdout.splitlines() if "profile of steps 2-3:" in ln)
    path = line.split("profile of steps 2-3: ", 1)[1].split(" (open it in", 1)[0]
    assert path.startswith(str(tmp_path / "out" / "profile" / "rank_0"))
    assert "ui.perfetto.dev" in line
    with open(path) as f:
        events = json.load(f)
    spans = [e for e in events if e.get("ph") == "X"]
    matmuls = [e for e in spans if "MatMul" in e["name"]]
    # 2 layers x (qkv, proj, fc1, fc2) + the output layer = 9 forward linears per step, each
    # with two gradient matmuls in backward: at least 2 steps x 9 x 3.
    assert len(matmuls) >= 2 * 9 * 3, sorted({e["name"] for e in spans})
    assert all(float(e["dur"]) >= 0 for e in matmuls)


# --------------------------------------------------------------------------- msrun: timers, determinism
DET = ["--training.deterministic=true", "--training.max_steps=3", "--training.jit=false"]
MOE = ["--model.mlp_type=moe", "--model.num_moe_experts=4", "--model.moe_router_topk=2",
       "--model.moe_ffn_hidden_size=32", "--model.moe_aux_loss_coeff=0.01",
       "--training.micro_batch_size=2"]
LAYOUTS = {
    "dp2": [],
    "tp2": ["--parallel.tensor_model_parallel_size=2"],
    "ep2": ["--parallel.expert_model_parallel_size=2", *MOE],
    "cp2": ["--parallel.context_parallel_size=2"],
    "pp2": ["--parallel.pipeline_model_parallel_size=2"],
}


@pytest.fixture(scope="module")
def observe_job(tmp_path_factory):
    """One 2-worker msrun job: a timed dp=2 run (timing_log_level 2), then every layout twice
    in deterministic mode."""
    tmp = tmp_path_factory.mktemp("observe_job")
    out = f"--training.output_dir={tmp / 'runs'}"   # not BASE's folder, which other jobs share
    specs = ["timers:--training.timing_log_level=2,--training.max_steps=4,--training.jit=false,"
             + out]
    specs.append("timers_distopt:--training.timing_log_level=1,--training.max_steps=2,"
                 "--training.jit=false,--parallel.use_distributed_optimizer=true," + out)
    specs.append("profile:--training.profile=true,--training.profile_ranks=0|1,"
                 "--training.profile_step_start=2,--training.profile_step_end=3,"
                 f"--training.max_steps=2,--training.jit=false,--training.profile_dir={tmp}/prof,"
                 + out)
    for name, flags in LAYOUTS.items():
        for k in (1, 2):
            specs.append(f"{name}_{k}:" + ",".join(DET + flags + [out]))
    result = run_worker_job("observe_train.py", tmp, 2, specs, timeout=1200)
    result["profile_dir"] = str(tmp / "prof")
    return result


@pytest.mark.msrun
def test_profile_writes_one_trace_per_profiled_rank(observe_job):
    from ms_llm.training.observability.profiling import trace_files
    for rank in (0, 1):
        traces = trace_files(os.path.join(observe_job["profile_dir"], f"rank_{rank}"))
        assert len(traces) == 1, (rank, traces)
        with open(traces[0]) as f:
            assert any(e.get("ph") == "X" for e in json.load(f))


@pytest.mark.msrun
def test_timers_on_dp2_sum_to_the_step_time(observe_job):
    run = observe_job["timers"]
    for rows in run["timers_ms"]:
        assert set(rows) >= {"batch-generator", "forward-backward", "grads-all-reduce",
                             "optimizer", "forward-compute", "backward-compute"}
        for mm in rows.values():
            assert 0 <= mm["min"] <= mm["max"]
    for mine in run["local"][1:]:     # rank 0's own timers against its own step time
        # The disjoint top-level timers make up the step (each rank waits for the other in
        # different timers, so rank 0 is compared with itself, not with max over ranks).
        top = sum(mine["timers_ms"][n] for n in ("batch-generator", "forward-backward",
                                                  "optimizer")) / 1000.0
        step_time = mine["step_time_s"]
        print(f"timers {top * 1000:.1f} ms vs step {step_time * 1000:.1f} ms "
              f"({top / step_time:.3f})")
        assert abs(top - step_time) <= 0.10 * step_time, (top, step_time, mine)


@pytest.mark.msrun
def test_distributed_optimizer_times_its_reduce_scatter_and_params_all_gather(observe_job):
    """Level 1 under the distributed optimizer: Megatron's ``grads-reduce-scatter`` and
    ``params-all-gather`` (nested in ``optimizer``, so at most its time)."""
    for mine in observe_job["timers_distopt"]["local"]:
        t = mine["timers_ms"]
        assert {"grads-reduce-scatter", "params-all-gather", "optimizer"} <= set(t), t
        assert "grads-all-reduce" not in t and "forward-compute" not in t   # level 2 only
        assert 0 < t["params-all-gather"] <= t["optimizer"], t


@pytest.mark.msrun
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_deterministic_reruns_are_bit_identical(observe_job, layout):
    a, b = observe_job[f"{layout}_1"], observe_job[f"{layout}_2"]
    assert len(a["loss"]) == 3
    assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"], (a, b)


def test_tensorboard_moe_load_balancing_and_mtp_tags(tmp_path):
    tb = tmp_path / "tb"
    Trainer(load_config(CONFIG, PLAIN + [
        "--training.output_dir", str(tmp_path / "out"), "--training.tensorboard_dir", str(tb),
        "--training.max_steps", "2", *MOE, "--model.mtp_num_layers", "1"])).fit()
    steps = [r for r in _rows(tmp_path / "out" / "metrics.jsonl") if "loss" in r]
    _, lb = _scalars(str(tb), "load_balancing_loss")
    assert lb == [(r["step"], float(np.float32(r["moe_aux_loss"]))) for r in steps]
    assert all(v > 0 for _, v in lb)
    _, mtp = _scalars(str(tb), "mtp_1 loss")
    assert mtp == [(r["step"], float(np.float32(r["mtp_1_loss"]))) for r in steps]


@pytest.mark.msrun
def test_deterministic_collectives_sum_in_rank_order(observe_job):
    """Deterministic mode's CPU all-reduce (sum, async avg) and the all-reduce form of
    reduce-scatter equal a NumPy float32 sum in rank order, bit for bit."""
    assert observe_job["rank_order"] == {"sum": True, "avg": True, "reduce_scatter": True}


def test_megatron_and_mindspeed_flags_reach_the_observability_keys():
    from helpers.mindspeed_examples import load
    from ms_llm.mindspeed.flags import to_overrides, translate
    argv = load()["qwen3/pretrain_qwen3_0point6b_4K_ptd.sh"]["argv"] + [
        "--tensorboard-dir", "/tmp/tb", "--log-timers-to-tensorboard", "--timing-log-level", "2",
        "--profile", "--profile-step-start", "3", "--profile-step-end", "5", "--profile-ranks",
        "0", "1", "--profile-save-path", "/tmp/prof", "--use-deter-comp",
        "--log-validation-ppl-to-tensorboard"]
    keys = translate(argv, world_size=64).keys
    keys.pop("checkpoint.load", None)
    t = load_config(None, to_overrides(keys)).training
    assert (t.tensorboard_dir, t.log_timers_to_tensorboard, t.timing_log_level) == \
        ("/tmp/tb", True, 2)
    assert (t.profile, t.profile_step_start, t.profile_step_end, t.profile_ranks,
            t.profile_dir) == (True, 3, 5, [0, 1], "/tmp/prof")
    assert t.deterministic
