"""``ms-llm plan``: exact parameter counts, predicted peaks against measured ones, the README.

Peak here is what a training process adds above its RSS just before the model is built (the
trainer logs ``rss_before_model_gb``; the OS high-water mark is the only honest figure on CPU,
where MindSpore's pool never returns memory). The acceptance band is the issue's: the plan
within +-20 % of the measurement, on five single-process configs (run concurrently: each is its
own process, so their peaks do not mix) and one msrun layout (tp 2 + sp, pp 2: both stages).
"""
import contextlib
import io
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from msrun_util import ROOT, run_msrun, worker_logs

from ms_llm.config import load_config
from ms_llm.models import GPTModel
from ms_llm.parallel.plan_shapes import full_shapes, rank_params
from ms_llm.parallel.state import ParallelSizes
from ms_llm.training.memory_plan import plan_memory
from ms_llm.training.memory_plan_cli import main as plan_main, plan_with_fix

TINY = os.path.join(ROOT, "configs", "tiny.yaml")
TINY_MOE = os.path.join(ROOT, "configs", "tiny_moe.yaml")
QWEN3_8B = os.path.join(ROOT, "configs", "qwen3_8b.yaml")
TOLERANCE = 0.20      # the acceptance band


def _plan_text(*argv) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert plan_main(list(argv)) == 0
    return out.getvalue()


# --------------------------------------------------------------------------- exact counts
@pytest.mark.parametrize("config,extra", [
    (TINY, []),
    (TINY, ["--model.untie_embeddings_and_output_weights", "true", "--model.add_qkv_bias",
            "true"]),
    (TINY_MOE, ["--model.moe_shared_expert_intermediate_size", "96"]),
    (TINY_MOE, ["--model.moe_grouped_gemm", "true"]),
])
def test_shape_only_model_has_the_real_models_parameters(config, extra):
    cfg = load_config(config, extra + ["--model.padded_vocab_size", "512"])
    real = {n: tuple(p.shape) for n, p in GPTModel(cfg.model).parameters_and_names()}
    planned = {n: shape for n, (shape, _, _) in full_shapes(cfg.model).items()}
    assert planned == real


def test_uneven_fsdp_and_ep_shards_add_up_to_the_model():
    """Over the ranks of one layout, the planned shards cover every element exactly once per
    replica (FSDP's uneven chunk rule over dp = 3; experts over ep = 2 x edp = 2)."""
    cfg = load_config(TINY, ["--model.padded_vocab_size", "515", "--parallel.fsdp_size", "3",
                                 "--model.ffn_hidden_size", "200"])
    shapes = full_shapes(cfg.model)
    total = sum(int(np.prod(s)) for s, _, _ in shapes.values())
    sizes = ParallelSizes(world=3)
    held = sum(q.numel for r in range(3) for q in rank_params(cfg, cfg.model, sizes, r, shapes))
    assert held == total
    cfg = load_config(TINY_MOE, ["--model.padded_vocab_size", "512",
                                 "--parallel.expert_model_parallel_size", "2"])
    shapes = full_shapes(cfg.model)
    total = sum(int(np.prod(s)) for s, _, _ in shapes.values())
    sizes = ParallelSizes(ep=2, world=4)
    per_rank = [rank_params(cfg, cfg.model, sizes, r, shapes) for r in range(4)]
    experts = [sum(q.numel for q in ps if q.expert) for ps in per_rank]
    dense = [sum(q.numel for q in ps if not q.expert) for ps in per_rank]
    # two expert-parallel ranks hold the experts between them; dense weights are replicated
    assert experts == [experts[0]] * 4 and dense == [dense[0]] * 4
    assert dense[0] + experts[0] + experts[1] == total


# --------------------------------------------------------------------------- the CLI
def test_plan_json_distributed_optimizer_and_refusals(capsys):
    base = ["--model.padded_vocab_size", "512", "--training.global_batch_size", "32"]
    plain = json.loads(_plan_text(TINY, "--nproc", "4", "--json", *base))
    dist = json.loads(_plan_text(TINY, "--nproc", "4", "--json", "--distributed-optimizer",
                                 *base))
    assert plain["stages"][0]["num_params"] == plain["total_params"]
    opt, opt_d = plain["stages"][0]["optimizer"], dist["stages"][0]["optimizer"]
    assert opt == 2 * 4 * plain["total_params"]
    # each rank keeps a quarter of the AdamW moments and of the fp32 main parameters (3 x the
    # shard, the moments being 2 x) + at most one element of padding per tensor
    assert 1.5 * opt / 4 <= opt_d <= 1.5 * (opt / 4 + 8 * 40)
    assert plan_main([TINY, "--nproc", "2", "--parallel.context_parallel_size", "2"]) == 2
    assert "the planner does not model context parallel yet" in capsys.readouterr().err
    assert plan_main([TINY, "--nproc", "3", "--parallel.tensor_model_parallel_size", "2"]) == 2
    assert "not divisible" in capsys.readouterr().err


def test_a_layout_that_does_not_fit_gets_the_cheapest_fix():
    cfg = load_config(TINY, ["--model.padded_vocab_size", "512", "--data.seq_length", "2048",
                             "--training.micro_batch_size", "2", "--training.global_batch_size",
                             "8"])
    plain = plan_memory(cfg, 4)
    budget = plain.peak_gb * 0.6
    plan = plan_with_fix(cfg, 4, device_memory_gb=budget)
    assert plan.fits is False
    sug = plan.suggestion
    assert sug["what"] and sug["peak_gb"] <= budget
    # the suggestion is a config change: applying it plans to the predicted peak
    overrides = []
    for key, value in sug["change"].items():
        if key != "parallel.use_distributed_optimizer":
            overrides += [f"--{key}", "null" if value is None else str(value).lower()]
    fixed = plan_memory(load_config(TINY, ["--model.padded_vocab_size", "512",
                                           "--data.seq_length", "2048",
                                           "--training.micro_batch_size", "2",
                                           "--training.global_batch_size", "8", *overrides]),
                        4, budget, "parallel.use_distributed_optimizer" in sug["change"])
    assert fixed.fits and abs(fixed.peak_gb - sug["peak_gb"]) < 1e-3


# --------------------------------------------------------------------------- vs measurement
SMALL = ["--data.seq_length", "512", "--training.micro_batch_size", "2",
         "--training.global_batch_size", "2", "--training.max_steps", "2",
         "--training.log_interval", "1", "--training.progress_bar", "false",
         "--training.jit", "false"]
SINGLE = {
    "dense": (TINY, SMALL),
    "selective": (TINY, SMALL + ["--training.recompute_granularity", "selective"]),
    "full block": (TINY, SMALL + ["--training.recompute_granularity", "full",
                                  "--training.recompute_method", "block",
                                  "--training.recompute_num_layers", "3"]),
    "moe, 2 micro-batches": (TINY_MOE, SMALL + ["--data.seq_length", "256",
                                                "--training.global_batch_size", "4"]),
    "wide, untied, vocab 32000": (TINY, SMALL + [
        "--model.hidden_size", "512", "--model.ffn_hidden_size", "1408", "--model.kv_channels",
        "64", "--model.num_layers", "3", "--model.padded_vocab_size", "32000",
        "--model.untie_embeddings_and_output_weights", "true", "--data.seq_length", "128"]),
}
PARALLEL = ["--model.num_layers", "4", "--data.seq_length", "384", "--training.micro_batch_size",
            "2", "--training.global_batch_size", "6", "--parallel.tensor_model_parallel_size",
            "2", "--parallel.sequence_parallel", "true",
            "--parallel.pipeline_model_parallel_size", "2", "--training.max_steps", "2",
            "--training.log_interval", "1", "--training.progress_bar", "false",
            "--training.jit", "false"]


def _measured(out_dir: str) -> float:
    rows = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]
    return max(r["peak_rss_gb"] for r in rows) - rows[0]["rss_before_model_gb"]


# Off in the default suite for its cost (five trainings and a 4-worker job: 5 min on a loaded
# 2-core machine); run it with MS_LLM_MEASURE_MEMORY=1. It once failed on a CI dry run where three
# configs measured the same 0.331 GB: the high-water mark held a transient of the data set-up
# (before the model is built), which the trainer now clears (metrics.reset_peak_rss); since then
# every config is within 0.88-1.14 of its plan, also with five runs started at once.
@pytest.mark.msrun
@pytest.mark.skipif(os.environ.get("MS_LLM_MEASURE_MEMORY") != "1",
                    reason="measured-peak check: set MS_LLM_MEASURE_MEMORY=1 (see comment)")
def test_predicted_peak_within_20_percent_of_measured(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT)
    procs = {}
    for name, (config, extra) in SINGLE.items():
        out = str(tmp_path / name.replace(" ", "_").replace(",", ""))
        cmd = [sys.executable, "-m", "ms_llm.cli", "train", config, *extra,
               "--training.output_dir", out]
        procs[name] = (subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, env=env, cwd=ROOT), out)
    # the parallel layout's msrun job runs while the single-process ones do
    # (a generous cluster time-out: the five single-process runs start at the same time)
    r = run_msrun("plan_memory.py", 4, str(tmp_path / "logs"),
                  [str(tmp_path / "par"), TINY, *PARALLEL], timeout=1200, cluster_time_out=600)
    assert r.returncode == 0, "\n".join(log[-3000:] for log in
                                        worker_logs(str(tmp_path / "logs"), 4))
    report = []
    for name, (p, out) in procs.items():
        log = p.communicate(timeout=900)[0]
        assert p.returncode == 0, log[-3000:]
        config, extra = SINGLE[name]
        cfg = load_config(config, extra)
        report.append((name, _measured(out), plan_memory(cfg, 1).peak_gb))
    for rank in range(4):
        rec = json.loads((tmp_path / f"par.{rank}.json").read_text())
        # training's own per-rank parameters, counted exactly by the planner
        assert rec["planned_numel"] == rec["real_numel"]
        assert rec["planned_count"] == rec["real_count"]
        report.append((f"tp2+sp pp2 rank {rank} (stage {rec['stage']})", rec["measured_gb"],
                       rec["planned_gb"]))
    text = "\n".join(f"{n}: measured {m:.3f} GB, planned {p:.3f} GB ({p / m:.2f})"
                     for n, m, p in report)
    print(text)
    for name, measured, planned in report:
        assert abs(planned - measured) <= TOLERANCE * measured, text


# --------------------------------------------------------------------------- README
def _readme_block(marker: str) -> str:
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    m = re.search(re.escape(f"$ {marker}") + r"\n(.*?)```", readme, re.S)
    assert m, f"README has no block for `{marker}`"
    return m.group(1).strip()


@pytest.mark.parametrize("nproc", [8, 16])
def test_readme_shows_what_plan_prints(nproc):
    cmd = f"ms-llm plan configs/qwen3_8b.yaml --nproc {nproc} --device-memory-gb 64"
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        text = _plan_text(*cmd.split()[2:])
    finally:
        os.chdir(cwd)
    assert _readme_block(cmd) == text.strip()
