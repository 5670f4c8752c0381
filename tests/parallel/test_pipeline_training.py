"""Pipeline-parallel training under real msrun matches the single-process run.

Tolerance: rtol 1e-5 on loss and gradient norm over 5 AdamW steps (fp32), as for the other
parallel layouts: a stage computes exactly what the single process computes for its layers; only
the order of fp32 sums differs (gradients accumulated per micro-batch, norms summed over stages,
the tied embedding's two gradient halves summed over the embedding group).
"""
import numpy as np
import pytest

from helpers.msrun import run_spec as spec, run_worker_job
from helpers.parallel_common import BASE, CONFIG, MOE, MOE_DEAD

from ms_llm.config import load_config
from ms_llm.training.trainer import Trainer

RTOL = 1e-5
LAYERS = ["--model.num_layers", "4", "--training.max_steps", "5", "--training.lr_decay_steps", "5"]
UNTIED = ["--model.untie_embeddings_and_output_weights", "true"]
NOOP = ["--parallel.noop_layers", "1"]
MB2 = ["--training.micro_batch_size", "2"]
DUALPIPEV = ["--parallel.schedules_method", "dualpipev"]
L8 = ["--model.num_layers", "8"]


def _record(extra):
    recs = Trainer(load_config(CONFIG, BASE + LAYERS + extra)).fit()
    return {"loss": [r["loss"] for r in recs], "grad_norm": [r["grad_norm"] for r in recs]}


@pytest.fixture(scope="module")
def refs():
    return {"tied": _record([]), "untied": _record(UNTIED), "noop": _record(NOOP),
            "moe": _record(MOE), "moe_bias": _record(MOE + MOE_DEAD), "l8": _record(L8)}


def pp(n, vpp=1):
    return ["--parallel.pipeline_model_parallel_size", str(n),
            "--parallel.virtual_pipeline_model_parallel_size", str(vpp)]


def check(run, ref, name, steps=slice(None)):
    np.testing.assert_allclose(run["loss"], ref["loss"][steps], rtol=RTOL, err_msg=name)
    np.testing.assert_allclose(run["grad_norm"], ref["grad_norm"][steps], rtol=RTOL,
                               err_msg=name)


def _megatron_pp2_folder(root) -> str:
    """A tiny Qwen3 (the test model's shapes, the embedded tokenizer's 4096 rows) converted to a
    Megatron folder with 2 pipeline stages x 2 virtual stages, as MindSpeed writes it."""
    from helpers.hf_fixtures import make_hf_checkpoint
    from ms_llm.checkpoint.convert import main as convert_main
    make_hf_checkpoint(root / "hf", "qwen3", hidden=64, layers=4, heads=4, kv_heads=2,
                       head_dim=16, ffn=128, vocab=4096, tied=True)
    assert convert_main(["--load-model-type", "hf", "--save-model-type", "mg",
                         "--model-type-hf", "qwen3", "--load-dir", str(root / "hf"),
                         "--save-dir", str(root / "mg"), "--target-pipeline-parallel-size", "2",
                         "--num-layers-per-virtual-pipeline-stage", "1"]) == 0
    return str(root / "mg")


@pytest.mark.msrun
def test_two_stages(tmp_path, refs):
    save = ["--training.max_steps", "3", "--checkpoint.save_dir", str(tmp_path / "ck")]
    load = ["--checkpoint.load", _megatron_pp2_folder(tmp_path)]
    save_b = ["--training.max_steps", "3", "--checkpoint.save_dir", str(tmp_path / "ck_b")]
    resume_b = ["--checkpoint.save_dir", str(tmp_path / "ck_b"), "--training.resume", "auto"]
    res = run_worker_job("train_parallel.py", tmp_path, 2, [
        spec("pp2_load_megatron_pp2_vpp2", LAYERS, load, pp(2)),
        spec("pp2", LAYERS, pp(2)),
        spec("pp2_untied", LAYERS, UNTIED, pp(2)),
        spec("pp2_uneven", LAYERS, pp(2), ["--parallel.num_layer_list", "1,3"]),
        spec("pp2_noop", LAYERS, NOOP, pp(2)),
        spec("pp2_vpp2", LAYERS, pp(2, 2)),
        spec("pp2_vpp2_save", LAYERS, UNTIED, pp(2, 2), save),
        # resumed at the same layout: each stage loads only its own layers
        spec("pp2_save_b", LAYERS, UNTIED, pp(2), save_b),
        spec("pp2_resume_b", LAYERS, UNTIED, pp(2), resume_b),
        # MoE: every stage's routers get their aux-loss gradient; the expert-bias counts of the
        # backward's forward re-run are not counted twice (the bias update would differ).
        spec("pp2_moe", LAYERS, MOE, pp(2)),
        spec("pp2_moe_bias", LAYERS, MOE, MOE_DEAD, pp(2)),
        # GPipe keeps every backward closure (no forward re-run), ZB-H1 splits B and W
        # (4 micro-batches of 2: the reference's 2 of 4 differ only in the order of fp32 sums)
        spec("pp2_gpipe", LAYERS, pp(2), MB2, ["--parallel.schedules_method", "gpipe"]),
        spec("pp2_zbh1", LAYERS, UNTIED, pp(2), MB2, ["--parallel.schedules_method", "zbh1"]),
        # DualPipe-V: 4 stages in a V (rank 0 holds layer 0 and layer 3, the embedding and the
        # loss: the tied embedding is one module there), B/W split, rank 1's chunk 0 handing
        # over to its own chunk 1; saved, then resumed in one process below
        spec("pp2_dualpipev", LAYERS, pp(2, 2), MB2, DUALPIPEV),
        spec("pp2_dualpipev_untied_save", LAYERS, UNTIED, pp(2, 2), MB2, DUALPIPEV,
             ["--training.max_steps", "3", "--checkpoint.save_dir", str(tmp_path / "ck_v")]),
        spec("pp2_dualpipev_moe", LAYERS, MOE, pp(2, 2), MB2, DUALPIPEV),
    ])
    for name, key in (("pp2_gpipe", "tied"), ("pp2_zbh1", "untied"),
                      ("pp2", "tied"), ("pp2_untied", "untied"), ("pp2_uneven", "tied"),
                      ("pp2_noop", "noop"), ("pp2_vpp2", "tied"), ("pp2_moe", "moe"),
                      ("pp2_moe_bias", "moe_bias"), ("pp2_dualpipev", "tied"),
                      ("pp2_dualpipev_moe", "moe")):
        check(res[name], refs[key], name)
    check(res["pp2_dualpipev_untied_save"], refs["untied"], "pp2_dualpipev_untied_save",
          slice(0, 3))
    check(res["pp2_vpp2_save"], refs["untied"], "pp2_vpp2_save", slice(0, 3))
    check(res["pp2_save_b"], refs["untied"], "pp2_save_b", slice(0, 3))
    check(res["pp2_resume_b"], refs["untied"], "pp2_resume_b", slice(3, 5))
    # A Megatron folder written with pp=2 x vpp=2 trains at pp=2 as it does in one process.
    check(res["pp2_load_megatron_pp2_vpp2"], _record(load), "pp2_load_megatron_pp2_vpp2")
    # Layers are stored under their global index: the pp=2 x vpp=2 checkpoint resumes in one
    # process (pp=1) and continues the uninterrupted curve.
    cfg = load_config(CONFIG, BASE + LAYERS + UNTIED + [
        "--checkpoint.save_dir", str(tmp_path / "ck"), "--training.resume", "auto"])
    recs = Trainer(cfg).fit()
    check({"loss": [r["loss"] for r in recs], "grad_norm": [r["grad_norm"] for r in recs]},
          refs["untied"], "resumed at pp=1", slice(3, 5))
    cfg = load_config(CONFIG, BASE + LAYERS + UNTIED + [
        "--checkpoint.save_dir", str(tmp_path / "ck_v"), "--training.resume", "auto"])
    recs = Trainer(cfg).fit()
    check({"loss": [r["loss"] for r in recs], "grad_norm": [r["grad_norm"] for r in recs]},
          refs["untied"], "dualpipev resumed at pp=1", slice(3, 5))


@pytest.mark.msrun
@pytest.mark.extended   # pp=4 schedules; pp=2 x vpp of each schedule: test_two_stages
def test_four_workers(tmp_path, refs):
    res = run_worker_job("train_parallel.py", tmp_path, 4, [
        spec("pp2_ep2_megamoe", LAYERS, MOE, pp(2), ["--parallel.expert_model_parallel_size", "2",
                                                      "--moe.dispatcher", "megamoe"]),
        spec("pp4", LAYERS, pp(4)),
        # middle ranks: kept and re-run closures mixed, B/W split, transfers to two neighbours
        spec("pp4_zbh1", LAYERS, pp(4), MB2, ["--parallel.schedules_method", "zbh1"]),
        # DualPipe-V at pp=4: 8 stages, 8 micro-batches of 1; middle ranks send both ways
        spec("pp4_dualpipev", LAYERS, L8, pp(4, 2), ["--training.micro_batch_size", "1"],
             DUALPIPEV),
        spec("pp2_tp2_sp_dualpipev", LAYERS, UNTIED, pp(2, 2), MB2, DUALPIPEV,
             ["--parallel.tensor_model_parallel_size", "2", "--parallel.sequence_parallel", "true"]),
        spec("pp2_dp2", LAYERS, pp(2)),
        spec("pp2_tp2_sp", LAYERS, UNTIED, pp(2), ["--parallel.tensor_model_parallel_size", "2",
                                                   "--parallel.sequence_parallel", "true"]),
        spec("pp2_fsdp2", LAYERS, pp(2), ["--parallel.fsdp_size", "2"]),
        # Saved at pp=2 x dp=2 after 3 steps, resumed by the next run at tp=2 x dp=2.
        spec("pp2_dp2_save", LAYERS, UNTIED, pp(2), ["--training.max_steps", "3",
                                                    "--checkpoint.save_dir", str(tmp_path / "ck")]),
        spec("tp2_dp2_resume", LAYERS, UNTIED, ["--parallel.tensor_model_parallel_size", "2",
                                                "--checkpoint.save_dir", str(tmp_path / "ck"),
                                                "--training.resume", "auto"]),
        # Recompute inside a stage whose backward already re-runs its forward, with the tensor
        # parallel collectives issued again in backward.
        spec("pp2_tp2_recompute", LAYERS, UNTIED, pp(2), [
            "--parallel.tensor_model_parallel_size", "2", "--training.recompute_granularity",
            "full", "--training.recompute_norm", "true"]),
    ])
    check(res["pp4"], refs["tied"], "pp4")
    check(res["pp4_zbh1"], refs["tied"], "pp4_zbh1")
    check(res["pp4_dualpipev"], refs["l8"], "pp4_dualpipev")
    check(res["pp2_tp2_sp_dualpipev"], refs["untied"], "pp2_tp2_sp_dualpipev")
    check(res["pp2_dp2"], refs["tied"], "pp2_dp2")
    check(res["pp2_tp2_sp"], refs["untied"], "pp2_tp2_sp")
    check(res["pp2_fsdp2"], refs["tied"], "pp2_fsdp2")
    check(res["pp2_dp2_save"], refs["untied"], "pp2_dp2_save", slice(0, 3))
    check(res["tp2_dp2_resume"], refs["untied"], "resumed at tp=2 x dp=2", slice(3, 5))
    check(res["pp2_tp2_recompute"], refs["untied"], "pp2_tp2_recompute")
    check(res["pp2_ep2_megamoe"], refs["moe"], "pp2_ep2_megamoe")


def test_stage_config_errors():
    from ms_llm.config import ConfigError
    cases = [(pp(2) + ["--model.num_layers", "3"], "not divisible by pipeline"),
             (pp(2) + ["--parallel.num_layer_list", "1,2"], "sums to 3"),
             (pp(2, 2) + ["--model.num_layers", "2"], "not divisible"),
             (["--parallel.noop_layers", "7"], "out of range"),
             (["--parallel.virtual_pipeline_model_parallel_size", "2"], "needs parallel."
                                                                        "pipeline_model")]
    for args, msg in cases:
        with pytest.raises(ConfigError, match=msg) as e:
            load_config(CONFIG, BASE + LAYERS + args)
        assert "\n" not in str(e.value) and "command line" in str(e.value)


def test_schedule_command_prints_the_config_schedule(capsys):
    from ms_llm.cli import main
    args = [CONFIG, "--parallel.pipeline_model_parallel_size", "2",
            "--parallel.virtual_pipeline_model_parallel_size", "2", "--training.micro_batch_size",
            "4", "--training.global_batch_size", "16"]
    assert main(["schedule", *args]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("interleaved 1F1B: pp=2 vpp=2 micro-batches=4 (dp=1)")
    rows = [line.split(":", 1)[1].split() for line in out if line.startswith("rank ")]
    assert len(rows) == 2
    for row in rows:   # every (micro-batch, chunk) forward and backward once per rank
        acts = sorted(a for a in row if a != ".")
        assert acts == sorted(f"{k}{m}.{c}" for k in "FB" for m in range(4) for c in range(2))
    assert rows[0][0] == "F0.0" and rows[1][0] == "."    # rank 1 waits for rank 0's output
    assert main(["schedule", *args, "--workers", "3"]) == 2
    assert "not divisible" in capsys.readouterr().err
    assert main(["schedule", *args, "--parallel.schedules_method", "dualpipev"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("DualPipe-V: pp=2 vpp=2 micro-batches=4 (dp=1)")
    rows = [line.split(":", 1)[1].split() for line in out if line.startswith("rank ")]
    for row in rows:
        assert sorted(a for a in row if a != ".") == \
            sorted(f"{k}{m}.{c}" for k in "FBW" for m in range(4) for c in range(2))
    assert rows[0][:2] == ["F0.0", "F1.0"] and rows[1][0] == "."
    assert "ZB-H1 on the same ranks" in out[-1]


def test_unknown_schedules_method_is_refused_at_launch():
    from ms_llm.config import ConfigError
    for method, vpp, match in (("dualpipe", 1, "'dualpipe' is unknown"),
                               ("zbh1", 2, "one model chunk"),
                               ("dualpipev", 1, "two model chunks per rank in a V"),
                               ("dualpipev", 2, "at least 2 x parallel.pipeline")):
        args = pp(2, vpp) + ["--parallel.schedules_method", method]
        with pytest.raises(ConfigError, match=match) as e:
            load_config(CONFIG, BASE + LAYERS + args, world_size=2)
        assert "\n" not in str(e.value) and "parallel.schedules_method" in str(e.value)
