"""``ms-llm evaluate`` under real msrun with 4 workers at tp=2 x dp=2: the questions are dealt
over the two data-parallel groups, each group runs a tensor-parallel model, and the gathered
records (every prediction, HumanEval's executed verdicts) and accuracies equal one process's.
One job covers both kinds of split and a log-likelihood, a generation and an execution task."""
from __future__ import annotations

import json

import pytest

from helpers import eval_fixtures
from helpers.msrun import run_msrun, worker_logs


@pytest.mark.msrun
def test_tp2_dp2_equals_one_process(tmp_path):
    folder = eval_fixtures.make_model(str(tmp_path / "model"))
    ppl = eval_fixtures.write_mmlu(str(tmp_path / "mmlu"))
    gsm8k = eval_fixtures.write_gsm8k(str(tmp_path / "gsm8k"), n=5)
    human = eval_fixtures.write_human_eval(str(tmp_path / "he"))
    args = ["--task", "mmlu_ppl", "gsm8k", "human_eval", "--task-data-path", ppl, gsm8k, human,
            "--load", folder, "--evaluation-batch-size", "2", "--max-new-tokens", "6",
            "--human-eval-timeout", "3"]
    out = tmp_path / "parallel.json"
    r = run_msrun("evaluate_parallel.py", 4, str(tmp_path / "logs"),
                  [*args, "--tensor-model-parallel-size", "2", "--output-json", str(out)],
                  timeout=900)
    assert r.returncode == 0, "\n".join(log[-3000:] for log in worker_logs(str(tmp_path / "logs"), 4))
    from ms_llm.cli.evaluate import main
    single = tmp_path / "single.json"
    assert main([*args, "--output-json", str(single)]) == 0
    got, want = json.loads(out.read_text()), json.loads(single.read_text())
    for task in ("mmlu_ppl", "gsm8k", "human_eval"):
        assert got[task]["total"] == want[task]["total"], task
        assert [(r["subject"], r["index"], r["prediction"], r["correct"])
                for r in got[task]["records"]] == \
            [(r["subject"], r["index"], r["prediction"], r["correct"])
             for r in want[task]["records"]], task
