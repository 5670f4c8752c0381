"""Open-benchmark evaluation of a checkpoint.

* ``ms-llm evaluate`` (``ms_llm.cli.evaluate``): MindSpeed-LLM's ``evaluation.py`` flags and
  tasks (MMLU, C-Eval, BoolQ, GSM8K, HumanEval) over the benchmarks' local files, split over the
  data-parallel ranks of an msrun job and gathered on every rank.
* ``ms-llm lm-eval`` (``ms_llm.evaluation.lm_eval_backend``): EleutherAI's lm-evaluation-harness
  with this suite registered as the ``ms-llm`` model (the ``eval`` extra).

Both score through ``ModelScorer`` (``scorer.py``), which holds the model, its tokenizer and the
two primitives every benchmark reduces to: log-likelihood of a continuation, and greedy
generation with stop strings.
"""
from __future__ import annotations

__all__ = ["ModelScorer"]


def __getattr__(name):   # lazy: ``ms-llm evaluate --help`` must not import MindSpore
    if name == "ModelScorer":
        from .scorer import ModelScorer
        return ModelScorer
    raise AttributeError(name)
