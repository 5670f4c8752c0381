"""The tiny Qwen3-Next (Gated DeltaNet / gated attention / Gated DeltaNet, every layer MoE with
a gated shared expert; tests/helpers/qwen3_next_parallel_common.py) trains under real msrun (2
workers)
exactly as in one process: dp=2, ep=2 (two experts per rank, all-to-all dispatch), pp=2 with
uneven stages (layers DeltaNet + attention | DeltaNet), fsdp=2, and dp=2 with full activation
recompute of every layer (with the aux loss on, every part but the router re-runs in backward:
norms, the DeltaNet's chunk scan, the gated attention, the experts and the shared expert).
Context parallel (cp=2: four 8-token chunks, rank 0 holding the first and last) hands the conv
inputs and the recurrent state of the DeltaNet layers from chunk to chunk across the ranks.
Tensor parallel (tp=2, and tp=2 with sequence parallel) splits both layer kinds by heads
(DeltaNet: whole key-head groups per rank); MoE under tp is not built (expert tensor parallel),
so those runs use a dense MLP and are compared with a dense one-process run.

Tolerance: rtol 1e-5 on loss and grad norm over 5 AdamW steps (fp32): the parallel runs sum the
same terms in another order (all-reduce, reduce-scatter, per-rank expert blocks), ~1e-7 relative
per step; a wrong split or a missing gradient all-reduce changes them at 1e-3 or more."""
import numpy as np
import pytest

from helpers.msrun import run_spec, run_worker_job
from helpers.parallel_common import run_record
from helpers.qwen3_next_parallel_common import Q3N_BASE, Q3N_CONFIG

from ms_llm.config import load_config
from ms_llm.training.trainer import Trainer

RTOL = 1e-5
RUNS = {
    "dp2": [],
    "ep2": ["--parallel.expert_model_parallel_size", "2"],
    "pp2": ["--parallel.pipeline_model_parallel_size", "2", "--parallel.num_layer_list", "2,1"],
    "fsdp2": ["--parallel.fsdp_size", "2"],
    "dp2_recompute": ["--training.recompute_granularity", "full",
                      "--training.recompute_method", "uniform"],
    "cp2": ["--parallel.context_parallel_size", "2"],
}
DENSE = ["--model.mlp_type", "dense"]
TP_RUNS = {
    "tp2": DENSE + ["--parallel.tensor_model_parallel_size", "2"],
    "tp2_sp": DENSE + ["--parallel.tensor_model_parallel_size", "2",
                       "--parallel.sequence_parallel", "true"],
}


@pytest.mark.msrun
def test_dp2_ep2_pp2_fsdp2_recompute_cp2_tp2_match_one_process(tmp_path):
    ref = run_record(Trainer(load_config(Q3N_CONFIG, Q3N_BASE)))
    assert len(ref.get("expert_counts", [])) == 3      # every layer routed
    dense = run_record(Trainer(load_config(Q3N_CONFIG, Q3N_BASE + DENSE)))
    res = run_worker_job("train_parallel.py", tmp_path, 2,
                         [run_spec(name, args, flags=["@qwen3next"])
                          for name, args in {**RUNS, **TP_RUNS}.items()], timeout=1200)
    for name in list(RUNS) + list(TP_RUNS):
        run, want = res[name], (dense if name in TP_RUNS else ref)
        assert len(run["loss"]) == 5, name
        np.testing.assert_allclose(run["loss"], want["loss"], rtol=RTOL, err_msg=name)
        np.testing.assert_allclose(run["grad_norm"], want["grad_norm"], rtol=RTOL, err_msg=name)
