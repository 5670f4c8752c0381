"""``ms-llm plan``: exact parameter counts, predicted peaks against measured ones, the docs' example
(docs/features/memory.md).

Peak here is what a training process adds above its RSS just before the model is built (the
trainer logs ``rss_before_model_gb``; the OS high-water mark is the only honest figure on CPU,
where MindSpore's pool never returns memory). The acceptance band is the issue's: the plan
within +-20 % of the measurement, on five single-process configs (each in a child forked from
one interpreter, two at a time: their peaks do not mix) and one msrun layout (context parallel
ring x tensor parallel + sp, all four ranks); MS_LLM_MEASURE_MEMORY=1 adds tp 2 + sp x pp 2 and
Ulysses cp 4.
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

from helpers.cli import last_wins
from helpers.msrun import ROOT, msrun_command, worker_logs

from ms_llm.config import load_config
from ms_llm.models import GPTModel
from ms_llm.parallel.plan_shapes import full_shapes, rank_params
from ms_llm.parallel.state import ParallelSizes
from ms_llm.planning.memory_plan import plan_memory
from ms_llm.cli.plan import main as plan_main
from ms_llm.planning.memory_plan_fit import plan_with_fix

TINY = os.path.join(ROOT, "configs", "tiny.yaml")
TINY_MOE = os.path.join(ROOT, "configs", "tiny_moe.yaml")
QWEN3_8B = os.path.join(ROOT, "configs", "qwen3_8b.yaml")
TOLERANCE = 0.20      # the acceptance band


def _plan_text(*argv) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert plan_main(last_wins(argv)) == 0   # a composed line: each key once
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
    assert plan_main([TINY, "--nproc", "3", "--parallel.tensor_model_parallel_size", "2"]) == 2
    assert "not divisible" in capsys.readouterr().err


def test_context_parallel_plan():
    """cp replicates the weights and AdamW state and cuts each sequence: per rank, the same
    parameters and optimizer state as one process, fewer activations (no [s, s] scores: the
    blockwise kernel); the distributed optimizer cuts over data x context parallel."""
    base = ["--model.padded_vocab_size", "512", "--data.seq_length", "1024",
            "--training.micro_batch_size", "1", "--training.global_batch_size", "1"]
    one = json.loads(_plan_text(TINY, "--nproc", "1", "--json", *base))["stages"][0]
    runs = {}
    for algo in ("megatron_cp_algo", "ulysses_cp_algo", "hybrid_cp_algo"):
        extra = ["--parallel.ulysses_degree_in_cp", "2"] if algo == "hybrid_cp_algo" else []
        plan = json.loads(_plan_text(TINY, "--nproc", "4", "--json", *base, *extra,
                                     "--parallel.context_parallel_size", "4",
                                     "--parallel.context_parallel_algo", algo))
        assert plan["layout"]["cp"] == 4 and plan["layout"]["dp"] == 1
        runs[algo] = st = plan["stages"][0]
        assert st["params"] == one["params"] and st["optimizer"] == one["optimizer"]
        assert st["activations"] < one["activations"] / 4
    two = json.loads(_plan_text(TINY, "--nproc", "2", "--json", *base,
                                "--parallel.context_parallel_size", "2"))["stages"][0]
    assert runs["megatron_cp_algo"]["activations"] < two["activations"] < one["activations"]
    dist = json.loads(_plan_text(TINY, "--nproc", "4", "--json", "--distributed-optimizer",
                                 *base, "--parallel.context_parallel_size", "2",
                                 "--training.global_batch_size", "2"))
    # dp 2 x cp 2: each rank keeps a quarter of the moments and fp32 mains (3 x the shard)
    opt = one["optimizer"]
    assert 1.5 * opt / 4 <= dist["stages"][0]["optimizer"] <= 1.5 * (opt / 4 + 8 * 40)
    assert plan_main([TINY, "--nproc", "2", "--parallel.context_parallel_size", "2",
                      "--data.seq_length", "6"]) == 2


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
# peak_tflops set: no MFU probe (a GEMM run after the model is built, on the first run of a
# fresh cache) inside the measured window
ONE_STEP = ["--training.max_steps", "1", "--training.log_interval", "1",
            "--training.progress_bar", "false", "--training.jit", "false",
            "--training.peak_tflops", "1.0"]
SMALL = ["--data.seq_length", "512", "--training.micro_batch_size", "2",
         "--training.global_batch_size", "2", *ONE_STEP]
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
# The distributed layouts: one msrun job each (one layout per job: a worker's peak is only its
# first training's). The default suite runs context parallel (ring) x tensor parallel + sp;
# MS_LLM_MEASURE_MEMORY=1 adds pipeline and Ulysses layouts (one more job each).
PARALLEL = {
    "cp2 ring x tp2+sp": ["--data.seq_length", "1024", "--training.micro_batch_size", "2",
                          "--training.global_batch_size", "2",
                          "--parallel.context_parallel_size", "2",
                          "--parallel.tensor_model_parallel_size", "2",
                          "--parallel.sequence_parallel", "true", *ONE_STEP],
}
EXTRA_PARALLEL = {
    "tp2+sp pp2": ["--model.num_layers", "4", "--data.seq_length", "384",
                   "--training.micro_batch_size", "2", "--training.global_batch_size", "6",
                   "--parallel.tensor_model_parallel_size", "2",
                   "--parallel.sequence_parallel", "true",
                   "--parallel.pipeline_model_parallel_size", "2", *ONE_STEP],
    "cp4 ulysses": ["--data.seq_length", "1024", "--training.micro_batch_size", "2",
                    "--training.global_batch_size", "2", "--parallel.context_parallel_size", "4",
                    "--parallel.context_parallel_algo", "ulysses_cp_algo", *ONE_STEP],
}


# Peak = the RSS high-water mark minus the RSS just before the model is built (the trainer
# resets the mark there: metrics.reset_peak_rss), each training in a process of its own
# (MindSpore's pool never returns memory): the single-process configs in children forked from
# one interpreter (plan_memory_single.py: they get a fresh process's page state; checked
# against fresh processes: 0.3656 vs 0.3658 GB), the layouts in one msrun job each, all started
# at once. History: a CI dry run once measured three configs at the same 0.331 GB, a transient
# of the data set-up, which the reset removed; since then every config is within 0.88-1.14.
@pytest.mark.msrun
@pytest.mark.extended   # the hybrid model's check stays: test_qwen3_next_plan
def test_predicted_peak_within_20_percent_of_measured(tmp_path):
    layouts = dict(PARALLEL)
    if os.environ.get("MS_LLM_MEASURE_MEMORY") == "1":
        layouts.update(EXTRA_PARALLEL)
    env = dict(os.environ, PYTHONPATH=ROOT)
    spec = tmp_path / "single.json"
    spec.write_text(json.dumps({name: [config, extra] for name, (config, extra)
                                in SINGLE.items()}))
    single = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "tests", "dist_workers", "plan_memory_single.py"),
         str(tmp_path / "single_out.json"), str(spec)], stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    jobs = {}
    for i, (name, extra) in enumerate(layouts.items()):
        cmd, job_env = msrun_command("plan_memory.py", 4, str(tmp_path / f"logs{i}"),
                                     [str(tmp_path / f"par{i}"), TINY, *extra,
                                      "--training.output_dir", str(tmp_path / f"run{i}")],
                                     cluster_time_out=600)
        jobs[name] = (subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True, env=job_env), i)
    report = []
    for name, (proc, i) in jobs.items():
        proc.communicate(timeout=1200)
        assert proc.returncode == 0, "\n".join(log[-3000:] for log in
                                                worker_logs(str(tmp_path / f"logs{i}"), 4))
        for rank in range(4):
            rec = json.loads((tmp_path / f"par{i}.{rank}.json").read_text())
            # training's own per-rank parameters, counted exactly by the planner
            assert rec["planned_numel"] == rec["real_numel"], (name, rank)
            assert rec["planned_count"] == rec["real_count"], (name, rank)
            report.append((f"{name} rank {rank} (stage {rec['stage']})", rec["measured_gb"],
                           rec["planned_gb"]))
    log = single.communicate(timeout=1200)[0]
    assert single.returncode == 0, log[-3000:]
    for name, rec in json.loads((tmp_path / "single_out.json").read_text()).items():
        report.append((name, rec["measured_gb"], rec["planned_gb"]))
    text = "\n".join(f"{n}: measured {m:.3f} GB, planned {p:.3f} GB ({p / m:.2f})"
                     for n, m, p in report)
    print(text)
    assert len(report) >= 6
    for name, measured, planned in report:
        assert abs(planned - measured) <= TOLERANCE * measured, text


# Qwen3-0.6B shape (vocab 151936, hidden 1024, tied) at seq 512, micro-batch 1, fp32: the peak
# above the pre-model RSS that ``python -m benchmarks.memory --layers L --steps 3`` measured
# (max over steps: the allocator's second step holds more than the first), GiB; too large for
# CI to re-measure (6-14 GiB), so the figures are recorded here as the small configs' are above.
# With ``--model.cross_entropy_loss_fusion true`` (``--ms-llm-extra``), 2026-12-02 15:00: 5.27.
QWEN3_0P6B_MEASURED = {(4, False): 6.19, (8, False): 6.65, (4, True): 5.27}


@pytest.mark.parametrize("layers,fused", sorted(QWEN3_0P6B_MEASURED))
def test_large_vocabulary_plan_within_20_percent_of_measured(layers, fused):
    cfg = load_config(os.path.join(ROOT, "configs", "qwen3_0p6b.yaml"),
                      ["--model.num_layers", str(layers), "--data.seq_length", "512",
                       "--training.global_batch_size", "1",
                       "--model.cross_entropy_loss_fusion", str(fused).lower()])
    measured = QWEN3_0P6B_MEASURED[layers, fused]
    planned = plan_memory(cfg, 1).peak_gb
    assert abs(planned - measured) <= TOLERANCE * measured, (layers, fused, planned, measured)


# --------------------------------------------------------------------------- docs
def _readme_block(marker: str) -> str:
    readme = open(os.path.join(ROOT, "docs", "features", "memory.md"), encoding="utf-8").read()
    m = re.search(re.escape(f"$ {marker}") + r"\n(.*?)```", readme, re.S)
    assert m, f"docs/features/memory.md has no block for `{marker}`"
    return m.group(1).strip()


@pytest.mark.parametrize("nproc", [8])
def test_readme_shows_what_plan_prints(nproc):
    cmd = f"ms-llm plan configs/qwen3_8b.yaml --nproc {nproc} --device-memory-gb 64"
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        text = _plan_text(*cmd.split()[2:])
    finally:
        os.chdir(cwd)
    assert _readme_block(cmd) == text.strip()
