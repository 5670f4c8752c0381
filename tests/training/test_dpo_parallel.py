"""DPO with evaluation under real msrun (one job, two workers): data parallel, tensor parallel,
fully-sharded data parallel and context parallel each equal the single-process run over 5 steps
(losses, grad norms, reward metrics, and the eval rows at steps 2, 4 and the end).

Tolerance rtol 1e-5 (atol 1e-6 for rewards and margins that are near 0): the parallel runs sum
the same fp32 terms in another order (all-reduce, sharded matmuls), as in
test_parallel_training; the reward accuracy is a count and must be equal.
"""
import numpy as np
import pytest

from helpers.finetune_fixtures import make_hf_folder, pairwise_rows, preprocess, write_jsonl
from helpers.msrun import run_spec as spec, run_worker_job
from helpers.parallel_common import BASE, CONFIG, run_record

from ms_llm.config import load_config
from ms_llm.training.trainer import Trainer

RTOL, ATOL = 1e-5, 1e-6
LAYOUTS = {"dp2": [], "tp2": ["--parallel.tensor_model_parallel_size", "2"],
           "fsdp2": ["--parallel.fsdp_size", "2"],
           # context parallel: each rank holds two chunks of every row; a row's log-prob sum
           # adds both ranks' pieces (with gradient) before the DPO loss
           "cp2": ["--parallel.context_parallel_size", "2"]}


def dpo_args(root) -> list:
    return ["--data.data_path", str(root / "pairs"), "--data.tokenizer", str(root / "hf"),
            "--training.stage", "dpo", "--data.split", "80,20,0", "--training.eval_interval",
            "2", "--training.eval_iters", "1", "--training.max_steps", "5",
            "--training.output_dir", str(root / "out")]


@pytest.mark.msrun
def test_dpo_parallel_layouts_equal_one_process(tmp_path):
    hf = make_hf_folder(tmp_path / "hf")      # its tokenizer; the model is tiny.yaml's, random
    preprocess(write_jsonl(tmp_path / "pairs.jsonl", pairwise_rows(32)), hf,
               str(tmp_path / "pairs"), "AlpacaStylePairwiseHandler")
    ref = run_record(Trainer(load_config(CONFIG, BASE + dpo_args(tmp_path))))
    assert [e["step"] for e in ref["eval"]] == [2, 4, 5]
    runs = run_worker_job("train_parallel.py", tmp_path, 2,
                          [spec(n, dpo_args(tmp_path) + extra) for n, extra in LAYOUTS.items()])
    for name in LAYOUTS:
        run = runs[name]
        for key in ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margin"):
            np.testing.assert_allclose(run[key], ref[key], rtol=RTOL, atol=ATOL,
                                       err_msg=f"{name} {key}")
        assert run["rewards/accuracy"] == ref["rewards/accuracy"], name
        assert [e["step"] for e in run["eval"]] == [2, 4, 5], name
        for key in ref["eval"][0]:
            np.testing.assert_allclose([e[key] for e in run["eval"]],
                                       [e[key] for e in ref["eval"]], rtol=RTOL, atol=ATOL,
                                       err_msg=f"{name} {key}")
