"""Muon under real msrun (2 workers) against one process: data parallel (each matrix orthogonalised
on its owner rank, updates all-gathered), FSDP (shards gathered to the owner, uneven ones included:
hidden size 65 and ffn 99 make linear_proj and linear_fc2 65 rows, cut 33/32; each rank keeps its
rows of the update), the distributed optimizer (its fp32 main shards and momentum on the same
uneven cut, gathered to the owner the same way), tensor parallel in Megatron's ``duplicated``
(shards all-gathered, whole matrix orthogonalised) and ``distributed`` (Gram matrices all-reduced
over the shards) modes, QK-clip under FSDP and the distributed optimizer (the per-head max logits
reduced over the replicas, the shards clipped on their uneven rows) and pp (the logged max reduced
over the stages), expert parallel with grouped experts (each rank's experts whole,
orthogonalised per expert), pipeline parallel, and bf16 with fp32 main parameters.

Tolerance: rtol 1e-5 on loss and gradient norm (fp32), as test_parallel_training: the parallel
runs sum the gradients in another order (~1e-7 relative), and Newton-Schulz, a smooth matrix
polynomial of the normalised momentum, carries that rounding on unamplified at these sizes.
bf16: test_parallel_training's bounds (one bf16 rounding flip carried on, 1e-3 / 1e-2).
"""
import numpy as np
import pytest

from helpers.msrun import run_worker_job
from helpers.parallel_common import BASE, CONFIG, MOE, run_record

from ms_llm.config import load_config
from ms_llm.training.trainer import Trainer

RTOL = 1e-5
BF16_RTOL = {"loss": 1e-3, "grad_norm": 1e-2}
MUON = ["--training.optimizer", "muon", "--training.jit", "false", "--training.max_steps", "5"]
GROUPED = MOE + ["--model.moe_grouped_gemm", "true"]
BF16 = ["--training.bf16", "true", "--training.max_steps", "4"]
TP2 = ["--parallel.tensor_model_parallel_size", "2"]   # muon_tp_mode duplicated (the default)
# a threshold every query group passes: each step clips, from maxima reduced over dp
QK_CLIP = ["--model.qk_clip", "true", "--model.qk_clip_threshold", "0.05"]
PP2 = ["--parallel.pipeline_model_parallel_size", "2"]
DISTOPT = ["--parallel.use_distributed_optimizer", "true"]
UNEVEN = ["--model.hidden_size", "65", "--model.ffn_hidden_size", "99"]   # odd dim-0 rows


def spec(name, *arg_lists):
    args = [a for lst in arg_lists for a in lst]
    return name + ":" + ",".join(f"{a}={b}" for a, b in zip(args[::2], args[1::2]))


def one_process(tmp_path, name, *arg_lists):
    """The single-process reference (its own output folder: BASE's is shared by sessions)."""
    args = [a for lst in arg_lists for a in lst]
    out = ["--training.output_dir", str(tmp_path / f"one_{name}")]
    return run_record(Trainer(load_config(CONFIG, BASE + args + out)))


@pytest.mark.msrun
def test_muon_two_workers_match_one_process(tmp_path):
    out = ["--training.output_dir", str(tmp_path / "runs")]
    res = run_worker_job("train_parallel.py", tmp_path, 2, [
        spec("dp2", MUON, out), spec("ep2_grouped", MUON, GROUPED, out,
                                     ["--parallel.expert_model_parallel_size", "2"]),
        spec("pp2", MUON, PP2, out), spec("dp2_bf16", MUON, BF16, out),
        spec("fsdp2_uneven", MUON, UNEVEN, out, ["--parallel.fsdp_size", "2"]),
        spec("distopt2_uneven", MUON, UNEVEN, out, DISTOPT),
        spec("tp2_duplicated", MUON, TP2, out),
        spec("tp2_distributed", MUON, TP2, out, ["--training.muon_tp_mode", "distributed"]),
        spec("fsdp2_qk_clip", MUON, UNEVEN, QK_CLIP, out, ["--parallel.fsdp_size", "2"]),
        spec("distopt2_qk_clip", MUON, UNEVEN, QK_CLIP, out, DISTOPT),
        spec("pp2_qk_clip", MUON, UNEVEN, QK_CLIP, out, PP2)])
    ref = one_process(tmp_path, "muon", MUON)
    for name in ("dp2", "pp2", "tp2_duplicated", "tp2_distributed"):
        for key in ("loss", "grad_norm"):
            np.testing.assert_allclose(res[name][key], ref[key], rtol=RTOL, err_msg=name)
    ref_uneven = one_process(tmp_path, "uneven", MUON, UNEVEN)
    for name in ("fsdp2_uneven", "distopt2_uneven"):
        for key in ("loss", "grad_norm"):
            np.testing.assert_allclose(res[name][key], ref_uneven[key], rtol=RTOL, err_msg=name)
    assert res["distopt2_uneven"]["optimizer_bytes"][0] < ref_uneven["optimizer_bytes"][0]
    ref_moe = one_process(tmp_path, "moe", MUON, GROUPED)
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(res["ep2_grouped"][key], ref_moe[key], rtol=RTOL)
    # QK-clip: FSDP and the distributed optimizer reduce the maxima over dp and clip their
    # (uneven) shards; pp logs the max of every stage's layers (reduced over pp)
    ref_clip = one_process(tmp_path, "qk_clip", MUON, UNEVEN, QK_CLIP)
    for name in ("fsdp2_qk_clip", "distopt2_qk_clip", "pp2_qk_clip"):
        for key in ("loss", "grad_norm"):
            np.testing.assert_allclose(res[name][key], ref_clip[key], rtol=RTOL, err_msg=name)
    np.testing.assert_allclose(res["pp2_qk_clip"]["max_attention_logit"],
                               ref_clip["max_attention_logit"], rtol=RTOL)
    ref_bf16 = one_process(tmp_path, "bf16", MUON, BF16)
    for key, rtol in BF16_RTOL.items():
        np.testing.assert_allclose(res["dp2_bf16"][key], ref_bf16[key], rtol=rtol)
    assert len(ref["loss"]) == 5 and ref["loss"][-1] < ref["loss"][0]
