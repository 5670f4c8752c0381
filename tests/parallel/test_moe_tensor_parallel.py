"""MoE under tensor parallel (Megatron-Core's layout) under real msrun equals one process.

Four workers, the tiny MoE of ``parallel_common`` (8 experts, top-2, aux loss) with a gated
shared expert, 5 AdamW steps in fp32; each layout's loss and gradient-norm curve and its final
parameters (read back from the run's distributed checkpoint) against the single-process run:

* tp 2 x ep 2 with sequence parallel (expert tensor parallel 2, Megatron's default etp = tp);
* the same with MindSpeed's ``moe_tp_extend_ep`` (4 expert ranks, experts whole);
* expert tensor parallel 1 at tp 2 (the expert grid folded across the tensor ranks), and tp 2
  without sequence parallel (each tensor rank routes its piece of the sequence);
* tp 2 x ep 2 with MegaMoE and the distributed optimizer (etp 1).

Tolerance: rtol 1e-5 on the loss and gradient-norm curves and on the parameters, with atol 3e-6
on the parameters. Every row is computed exactly as in one process; only the order of fp32 sums
differs (the experts' FFN split over etp ranks and summed on the way back, gradients summed over
ranks, norms over shards): a few ulp per step. Adam's normalised update turns that into an
absolute difference for elements whose gradient is itself at rounding level (embedding rows of
tokens seen once or twice: their step is ~lr whatever the gradient's size); measured at most
1.0e-6 absolute over the 5 steps (weights ~1e-2, total movement up to 5 x lr = 1.5e-2).
"""
import numpy as np
import pytest

from helpers.msrun import run_spec as spec, run_worker_job
from helpers.parallel_common import BASE, CONFIG, MOE, run_record

from ms_llm.checkpoint.native import dcp
from ms_llm.config import load_config
from ms_llm.training.trainer import Trainer

RTOL, ATOL = 1e-5, 3e-6
SHARED = ["--model.moe_shared_expert_intermediate_size", "32",
          "--model.moe_shared_expert_gate", "true"]
TP2_SP = ["--parallel.tensor_model_parallel_size", "2", "--parallel.sequence_parallel", "true"]
EP2 = ["--parallel.expert_model_parallel_size", "2"]


def _save(path):
    return ["--checkpoint.save_dir", str(path)]


def _final_params(save_dir, optimizer=False):
    """Every tensor of the run's last checkpoint (model parameters, or the optimizer's)."""
    ck = dcp.find_latest_complete(str(save_dir))
    with dcp.DCPReader(ck) as reader:
        stored = {n: reader.read(n) for n in reader.names()
                  if n.startswith("optimizer.") == optimizer}
    # a tensor-split [gate; up] weight is stored as its halves (a whole one under its name)
    out = {n: v for n, v in stored.items() if ":" not in n}
    for n in stored:
        if n.endswith(":gate"):
            base = n[:-len(":gate")]
            out[base] = np.concatenate([stored[n], stored[base + ":up"]], 0)
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    save = tmp_path_factory.mktemp("ref")
    rec = run_record(Trainer(load_config(CONFIG, BASE + MOE + SHARED + _save(save))))
    rec["params"] = _final_params(save)
    rec["moments"] = _final_params(save, optimizer=True)
    return rec


GROUPED = ["--model.moe_grouped_gemm", "true"]


@pytest.fixture(scope="module")
def reference_grouped():
    return run_record(Trainer(load_config(CONFIG, BASE + MOE + SHARED + GROUPED)))


def assert_equal_curves(run, ref, name):
    assert len(run["loss"]) == 5, name
    np.testing.assert_allclose(run["loss"], ref["loss"], rtol=RTOL, err_msg=name)
    np.testing.assert_allclose(run["grad_norm"], ref["grad_norm"], rtol=RTOL, err_msg=name)


def assert_equal_run(run, params, ref, name):
    assert_equal_curves(run, ref, name)
    assert sorted(params) == sorted(ref["params"]), name
    for key, value in ref["params"].items():
        np.testing.assert_allclose(params[key], value, rtol=RTOL, atol=ATOL,
                                   err_msg=f"{name}: {key}")


@pytest.mark.slow
@pytest.mark.msrun
def test_moe_tp2_ep2_layouts_equal_one_process(tmp_path, reference):
    runs = {
        "tp2_ep2_sp": [],
        "tp2_ep2_sp_extend": ["--parallel.moe_tp_extend_ep", "true"],
        "tp2_ep2_sp_etp1": ["--parallel.expert_tensor_parallel_size", "1"],
    }
    specs = [spec(name, MOE, SHARED, TP2_SP, EP2, extra, _save(tmp_path / name))
             for name, extra in runs.items()]
    res = run_worker_job("train_parallel.py", tmp_path, 4, specs)
    for name in runs:
        assert_equal_run(res[name], _final_params(tmp_path / name), reference, name)
    assert_moments_match(tmp_path / "tp2_ep2_sp_extend", reference)
    assert_resumes_in_one_process(tmp_path / "tp2_ep2_sp", reference)


def assert_moments_match(save_dir, ref):
    """The saved Adam first moments (expert moments written by their edp writers, tp-split ones
    by every tensor rank) equal one process's. They are averages of gradients, whose reordered
    fp32 sums differ relative to the largest terms summed, so each is compared at 1e-4 of its
    tensor's largest value; a moment from a wrong shard or replica is off by O(1) of it."""
    mine = _final_params(save_dir, optimizer=True)
    theirs = ref["moments"]
    assert sorted(mine) == sorted(theirs)
    for key, value in theirs.items():
        if ".exp_avg." in key:
            np.testing.assert_allclose(mine[key], value, rtol=1e-4,
                                       atol=1e-4 * float(np.abs(value).max()), err_msg=key)


def assert_resumes_in_one_process(save_dir, ref):
    """The tp 2 x ep 2 x etp 2 checkpoint (expert and shared-expert ``linear_fc1`` stored as
    halves) resumes in one process (whole tensors): the loaded weights are the final ones."""
    from ms_llm.parallel.placement import checkpoint_name, placement_of
    trainer = Trainer(load_config(CONFIG, BASE + MOE + SHARED + _save(save_dir)
                                  + ["--training.resume", "auto"]))
    assert trainer.step == 5
    loaded = {checkpoint_name(n, placement_of(p)): p.asnumpy()
              for n, p in trainer.model.parameters_and_names()}
    for key, value in ref["params"].items():
        np.testing.assert_allclose(loaded[key], value, rtol=RTOL, atol=ATOL, err_msg=key)


@pytest.mark.slow
@pytest.mark.msrun
@pytest.mark.extended
def test_moe_tp2_without_sp_cp2_and_megamoe_distopt_equal_one_process(tmp_path, reference,
                                                                     reference_grouped):
    """Tensor parallel without sequence parallel (each tensor rank routes its piece of the
    replicated sequence and the pieces are gathered after the experts), tp 2 x cp 2 (the
    balancing losses pool counts over both), and MegaMoE's pipelined
    dispatcher over the 4 tp-extended expert ranks with the distributed optimizer (expert
    moments cut over the expert-data-parallel group, here 1 rank); grouped experts
    (``moe_grouped_gemm``) split over etp 2 train equal to one process (curves only: their
    checkpoint is not built)."""
    runs = {
        "tp2_ep2_nosp": (["--parallel.tensor_model_parallel_size", "2"], EP2),
        "tp2_cp2_sp": (TP2_SP, ["--parallel.context_parallel_size", "2"]),
        "tp2_extend_megamoe_distopt": (TP2_SP + EP2, [
            "--parallel.moe_tp_extend_ep", "true", "--moe.dispatcher", "megamoe",
            "--parallel.use_distributed_optimizer", "true"]),
    }
    specs = [spec(name, MOE, SHARED, *extra, _save(tmp_path / name))
             for name, extra in runs.items()]
    specs.append(spec("tp2_ep2_sp_grouped", MOE, SHARED, GROUPED, TP2_SP, EP2))
    res = run_worker_job("train_parallel.py", tmp_path, 4, specs)
    for name in runs:
        assert_equal_run(res[name], _final_params(tmp_path / name), reference, name)
    assert_equal_curves(res["tp2_ep2_sp_grouped"], reference_grouped, "tp2_ep2_sp_grouped")
