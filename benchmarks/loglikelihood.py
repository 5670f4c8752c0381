"""Log-likelihood scoring throughput (``ModelScorer.loglikelihood``, what ``mmlu_ppl``, BoolQ
and the lm-eval backend's ``loglikelihood`` run): samples/s at batch 1 and batch 16.

Model: Llama-style, hidden 512, 4 layers, 8 heads / 2 KV heads, FFN 1408, vocab 32000, fp32,
random weights. Requests: ``--samples`` (context, continuation) pairs with contexts of 96-160
tokens and continuations of 1-4 tokens (a multiple-choice shape), random ids. Batches are
right-padded; the ratio batch 16 / batch 1 is the figure to compare across machines (same run,
same load), and so is batch 1 against the bare model forwards it runs (the scorer's overhead).
Each figure is the best of ``--rounds`` interleaved rounds.

Usage: ``python -m benchmarks.loglikelihood [--samples 64] [--rounds 2]``
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from benchmarks.harness import llama_model, machine

H, LAYERS, HEADS, KV, FFN, VOCAB = 512, 4, 8, 2, 1408, 32000


def build_scorer():
    from ms_llm.evaluation.scorer import ModelScorer
    model = llama_model(LAYERS, H, HEADS, KV, FFN, VOCAB)
    return ModelScorer(model, None, [0], max_length=2048)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    pairs = [(rng.integers(1, VOCAB, rng.integers(96, 161)).tolist(),
              rng.integers(1, VOCAB, rng.integers(1, 5)).tolist()) for _ in range(args.samples)]
    scorer = build_scorer()
    scorer.loglikelihood(pairs[:2], 2)                       # warm-up
    best = {1: float("inf"), 16: float("inf"), "bare": float("inf")}
    from mindspore import Tensor
    for _ in range(args.rounds):
        for bs in (1, 16):
            t = time.perf_counter()
            scorer.loglikelihood(pairs, bs)
            best[bs] = min(best[bs], time.perf_counter() - t)
        t = time.perf_counter()          # baseline: the bare forwards batch 1 runs
        for ctx, cont in pairs:
            scorer.model(Tensor(np.array([ctx + cont[:-1]], np.int32)),
                         logits_to_keep=len(cont)).asnumpy()
        best["bare"] = min(best["bare"], time.perf_counter() - t)
    print(f"CPU: {machine()} (noisy if others run)")
    print(f"model: {scorer.model.num_parameters() / 1e6:.1f} M parameters, fp32; "
          f"{args.samples} requests, context 96-160 + 1-4 tokens")
    for bs in (1, 16):
        print(f"loglikelihood batch {bs:>2}: {args.samples / best[bs]:7.1f} samples/s")
    print(f"batch 16 / batch 1: {best[1] / best[16]:.2f}x; batch 1 / bare model forwards: "
          f"{best[1] / best['bare']:.2f}x (the scorer's own cost)")


if __name__ == "__main__":
    main()
