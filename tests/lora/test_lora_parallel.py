"""LoRA under tensor parallel (with and without sequence parallel), FSDP and pipeline parallel,
in one msrun job of two workers, equals the single-process LoRA run over 5 AdamW steps, and
saves the same adapters (and nothing of the frozen base).

Tolerance: rtol 1e-5 on loss and gradient norm (fp32), as tests/parallel/test_parallel_training.py:
the
parallel runs sum the same terms in another order (all-reduces, sharded matmuls, the adapters'
partial gradients summed over tp), i.e. fp32 rounding only.
"""
import numpy as np
import pytest

from helpers.hf_fixtures import make_hf_checkpoint
from helpers.msrun import run_spec as spec, run_worker_job
from helpers.parallel_common import BASE, CONFIG, small_data_overrides

from ms_llm.config import load_config
from ms_llm.training.trainer import Trainer

RTOL = 1e-5
STEPS = ["--training.max_steps", "5", "--training.jit", "false"]


def lora_args(base_dir):
    # all four Megatron targets: column-parallel qkv / fc1 (B split like W's rows, fc1 as
    # [gate_r; up_r]) and row-parallel proj / fc2 (A split like W's columns)
    return ["--checkpoint.load", str(base_dir), "--lora.r", "4", "--lora.alpha", "8",
            "--training.lr", "0.01"] + STEPS


@pytest.mark.msrun
def test_lora_tp_sp_fsdp_pp_equal_one_process(tmp_path):
    # the tiny parallel-test model (BASE's model keys) as an HF folder: the LoRA base
    make_hf_checkpoint(tmp_path / "base", "qwen3", hidden=64, layers=2, heads=4, kv_heads=2,
                       head_dim=16, ffn=128, vocab=64, tied=False, seed=11)
    # a 12-word tokenizer, so the head is 64 rows (the default 4096 would dominate the time)
    args = lora_args(tmp_path / "base") + small_data_overrides(str(tmp_path / "data"))
    recs = Trainer(load_config(CONFIG, BASE + args + [
        "--training.output_dir", str(tmp_path / "ref"),
        "--checkpoint.save_dir", str(tmp_path / "ck_ref")])).fit()
    ref = {"loss": [r["loss"] for r in recs], "grad_norm": [r["grad_norm"] for r in recs]}
    runs = {"tp2": ["--parallel.tensor_model_parallel_size", "2"],
            "tp2sp": ["--parallel.tensor_model_parallel_size", "2",
                      "--parallel.sequence_parallel", "true"],
            "fsdp2": ["--parallel.fsdp_size", "2"],
            "pp2": ["--parallel.pipeline_model_parallel_size", "2"]}
    out = run_worker_job("train_parallel.py", tmp_path, 2,
                         [spec(name, args + extra + ["--training.output_dir",
                                                     str(tmp_path / name),
                                                     "--checkpoint.save_dir",
                                                     str(tmp_path / f"ck_{name}")])
                          for name, extra in runs.items()])
    for name in runs:
        assert len(out[name]["loss"]) == 5, name
        np.testing.assert_allclose(out[name]["loss"], ref["loss"], rtol=RTOL, err_msg=name)
        np.testing.assert_allclose(out[name]["grad_norm"], ref["grad_norm"], rtol=RTOL,
                                   err_msg=name)
    # the checkpoints hold the adapters only (no base shard under tp), equal to one process's
    # (the same fp32 rounding, through 5 Adam updates of lr 0.01: atol 1e-5)
    ref_ad = adapters(tmp_path / "ck_ref")
    for name in runs:
        got = adapters(tmp_path / f"ck_{name}")
        assert sorted(got) == sorted(ref_ad), name
        for k, v in ref_ad.items():
            np.testing.assert_allclose(got[k], v, rtol=1e-4, atol=1e-5, err_msg=f"{name} {k}")


def adapters(save_dir):
    from ms_llm.checkpoint.native.dcp import DCPReader, find_latest_complete
    r = DCPReader(find_latest_complete(str(save_dir)))
    names = r.names()
    model = [n for n in names if not n.startswith("optimizer.")]
    assert model and all(".lora_A.weight" in n or ".lora_B.weight" in n for n in model), model
    out = {n: r.read(n) for n in model}
    r.close()
    return out
