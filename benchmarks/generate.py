"""Decoding speed: ``ms_llm.inference.generate`` against transformers' ``generate`` on the same
Hugging Face folder, in one run, plus where an ms-llm decode step goes.

Model: a random-weight Qwen3 written by transformers (``--hf`` reuses a folder): hidden 384,
6 layers, 6 heads / 2 KV heads of 64, QK-norm, FFN 1024, vocab 32000, tied embeddings: 21.7 M
parameters (the ~23M Qwen3 of issue #31), fp32. Both sides decode greedily ``--new`` tokens after
random prompts of each ``--prompts`` length at each ``--batch`` size, with no EOS (every run makes
exactly ``batch * new`` tokens):

* tok/s: ``batch * new`` / wall time of the whole ``generate`` call (prefill included, as the
  issue measures); the ratio column is ms-llm / transformers;
* ms/step: the median time between later tokens (a streamer records each one), the decode step;
  prefill ms: from the call to the first new token (the prompt's forward and the first choice);
* each figure is the best of ``--rounds`` rounds, ms-llm and transformers interleaved, so load
  spikes on a shared machine hit both alike. torch runs with its default threads (the cores);
  ms-llm's whole-model decode step splits its large products and long-cache attention over the
  cores per worker on its own threads, with OpenBLAS at one thread (``generate``'s default).

"where the time goes" comes from the same runs: the prefill's share of each call, and per
decode step the parts of the one C call (``decode.STEP_SECONDS``: attention halves, attention
over the cache, MLP halves, final norm + LM head + argmax) and the rest (Python loop, host).
The path comparison (``--no-breakdown`` skips it) profiles decode steps at batch 1 after a
512-token prompt on each path ms-llm has had: the module path (``fused_decode.set_enabled(False)``),
the per-layer fused calls (``fused_decode.set_model_step(False)``) and the whole-model step (the
default): ms/step and MindSpore op dispatches per step. cProfile's own overhead inflates the
Python-side shares; the ms/step column outside the profiler is the one to compare.

Usage: ``python -m benchmarks.generate [--batch 1,8] [--prompts 128,512,2048] [--new 64]
[--rounds 2] [--no-breakdown] [--torch-threads N] [--hf FOLDER]``
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import tempfile
import time
from typing import Dict, List

import numpy as np

from benchmarks.harness import machine

VOCAB = 32000
QWEN3 = dict(vocab_size=VOCAB, hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
             num_attention_heads=6, num_key_value_heads=2, head_dim=64,
             max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=1e6,
             rms_norm_eps=1e-6)


class Clock:
    """A streamer that only records when each ``put`` happens (prompt first, then tokens)."""

    def __init__(self):
        self.times: List[float] = []

    def put(self, _value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def write_folder(path: str) -> str:
    import torch
    import transformers
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**QWEN3)).save_pretrained(path)
    return path


def run_ms(model, prompt: np.ndarray, new: int) -> Dict[str, float]:
    from ms_llm.inference import generate
    from ms_llm.ops.cpu_kernels.decode import steps as decode
    clock = Clock()
    decode.STEP_SECONDS[:] = 0
    t = time.perf_counter()
    out = generate(model, prompt, new, streamer=clock)
    total = time.perf_counter() - t
    assert out.shape == (prompt.shape[0], prompt.shape[1] + new)
    steps = len(clock.times) - 2                    # one-token steps after the prefill
    parts = {f"part{i}": float(v) / steps for i, v in enumerate(decode.STEP_SECONDS)}
    return {"total": total, "step": statistics.median(np.diff(clock.times[2:])),
            "prefill": clock.times[1] - clock.times[0],
            "steps_mean": (clock.times[-1] - clock.times[1]) / steps, **parts}


def run_hf(model, prompt: np.ndarray, new: int) -> Dict[str, float]:
    import torch
    ids = torch.tensor(prompt)
    clock = Clock()
    t = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, streamer=clock,
                             pad_token_id=0)
    total = time.perf_counter() - t
    assert tuple(out.shape) == (prompt.shape[0], prompt.shape[1] + new)
    return {"total": total, "step": statistics.median(np.diff(clock.times[2:])),
            "prefill": clock.times[1] - clock.times[0]}


class Profiled(Clock):
    """A streamer that records token times and profiles everything after the first new token
    (the decode steps, not the prefill) when ``profile`` is set."""

    def __init__(self, profile: bool):
        super().__init__()
        self.prof = cProfile.Profile() if profile else None

    def put(self, value) -> None:
        super().put(value)
        if self.prof is not None and len(self.times) == 2:
            self.prof.enable()

    def end(self) -> None:
        if self.prof is not None:
            self.prof.disable()


def breakdown(model, new: int = 24, context: int = 512) -> None:
    """Decode steps at batch 1 after ``context`` tokens: time per part, dispatches per step."""
    from ms_llm.inference import generate
    from ms_llm.models import fused_decode
    ids = np.random.default_rng(1).integers(0, VOCAB, (1, context))
    print(f"\nwhere a decode step goes (batch 1, context {context}, {new} steps):")
    print("| path | ms/step (no profiler) | op dispatches / step | AOT kernel calls / step "
          "| top parts (share of profiled step time) |")
    print("|---|---|---|---|---|")
    paths = (("module path", False, False), ("per-layer fused calls", True, False),
             ("whole-model step (default)", True, True))
    for path_label, fused, whole in paths:
        before = fused_decode.set_enabled(fused)
        before_whole = fused_decode.set_model_step(whole)
        try:
            clock = Profiled(False)
            generate(model, ids, new + 1, streamer=clock)
            traced = Profiled(True)
            generate(model, ids, new + 1, streamer=traced)
        finally:
            fused_decode.set_enabled(before)
            fused_decode.set_model_step(before_whole)
        stats = pstats.Stats(traced.prof).stats
        dispatch = aot = 0
        cum: Dict[str, float] = {}
        total = traced.times[-1] - traced.times[1]
        for (path, _line, name), (_cc, ncalls, _tt, ct, _callers) in stats.items():
            if name == "run_op_async" or (name.startswith("<built-in") and "pyboost" in name):
                dispatch += ncalls
            if name == "__call__" and path.endswith("custom_ops.py"):
                aot += ncalls
            label = _part(path, name)
            if label:
                cum[label] = cum.get(label, 0.0) + ct
        shares = sorted(cum.items(), key=lambda kv: -kv[1])
        top = "; ".join(f"{k} {100 * v / total:.0f}%" for k, v in shares if v > 0.02 * total)
        print(f"| {path_label} | "
              f"{1e3 * statistics.median(np.diff(clock.times[1:])):.1f} | {dispatch / new:.0f} "
              f"| {aot / new:.0f} | {top} |")


def per_step_parts(grid, best, new: int) -> None:
    """Where the whole time and an ms-llm decode step go, from the main runs (best round): the
    prefill's share of the call, and per step the C step's parts (``decode.STEP_SECONDS``) and
    the rest (Python loop, streamer, host bookkeeping)."""
    from ms_llm.ops.cpu_kernels.gemm import blas
    from ms_llm.ops.cpu_kernels.decode import steps as decode
    print(f"\nwhere the time goes (ms per decode step, the whole-model step on "
          f"{blas.default_blas_threads()} threads; prefill share of the whole generate call):")
    print("| batch | prompt | prefill share | ms/step (mean) | "
          + " | ".join(decode.STEP_PARTS) + " | rest (Python loop, host) |")
    print("|---" * (5 + len(decode.STEP_PARTS)) + "|")
    for b, s in grid:
        g = lambda key: best[(b, s, "ms", key)]  # noqa: E731
        parts = [1e3 * g(f"part{i}") for i in range(len(decode.STEP_PARTS))]
        step = 1e3 * g("steps_mean")
        print(f"| {b} | {s} | {100 * g('prefill') / g('total'):.0f}% | {step:.2f} | "
              + " | ".join(f"{p:.2f}" for p in parts) + f" | {step - sum(parts):.2f} |")


def _part(path: str, name: str):
    """The breakdown part a profiled function's cumulative time counts towards (parts do not
    nest in each other, so their shares add up to at most 100 %)."""
    table = {
        ("kv_cache.py", "update"): "cache write",
        ("attention.py", "cache_attention"): "attention over the cache (softmax chain)",
        ("rope.py", "apply_rope"): "RoPE",
        ("rms_norm.py", "rms_norm"): "RMSNorm",
        ("linear.py", "forward"): "linears (layers)",
        ("swiglu.py", "swiglu"): "SwiGLU",
        ("decode.py", "__call__"): "fused kernels (C)",
        ("kv_cache.py", "attention_mask"): "mask",
        ("gpt.py", "_cached_cos_sin"): "RoPE table slice",
        ("gpt.py", "_head"): "LM head (logits)",
        ("sampling.py", "greedy"): "sampler (host argmax)",
    }
    for (file, fn), label in table.items():
        if path.endswith(file) and name == fn:
            return label
    if name == "<method 'asnumpy' of 'TensorPy' objects>" or name.endswith("asnumpy"):
        return "logits to host"
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", default="1,8")
    p.add_argument("--prompts", default="128,512,2048")
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--hf", default=None, help="an HF folder to use instead of the random Qwen3")
    p.add_argument("--no-breakdown", action="store_true")
    p.add_argument("--torch-threads", type=int, default=0,
                   help="torch.set_num_threads for transformers (0: torch's default)")
    args = p.parse_args()
    started = time.perf_counter()
    import torch
    import transformers
    from ms_llm.checkpoint import from_pretrained
    from ms_llm.compat import setup_device
    setup_device("CPU")
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    with tempfile.TemporaryDirectory(prefix="ms_llm_bench_generate_") as tmp:
        folder = args.hf or write_folder(os.path.join(tmp, "qwen3"))
        ms_model = from_pretrained(folder)
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32).eval()
    print(f"CPU: {machine()} (figures are noisy when other jobs run)")
    print(f"model: {ms_model.num_parameters() / 1e6:.1f} M parameters, fp32; greedy, "
          f"{args.new} new tokens; torch {torch.__version__} threads {torch.get_num_threads()}, "
          f"transformers {transformers.__version__}")
    warm = np.random.default_rng(0).integers(0, VOCAB, (1, 16))
    run_ms(ms_model, warm, 4)
    run_hf(hf_model, warm, 4)
    if not args.no_breakdown:
        breakdown(ms_model)
    grid = [(int(b), int(s)) for b in args.batch.split(",") for s in args.prompts.split(",")]
    best: Dict[tuple, Dict[str, float]] = {}
    for _ in range(args.rounds):
        for b, s in grid:
            prompt = np.random.default_rng(s + b).integers(0, VOCAB, (b, s))
            for side, fn, model in (("ms", run_ms, ms_model), ("hf", run_hf, hf_model)):
                r = fn(model, prompt, args.new)
                print(f"  batch {b} prompt {s} {side}: {b * args.new / r['total']:.1f} tok/s, "
                      f"prefill {1e3 * r['prefill']:.0f} ms", flush=True)
                for key, value in r.items():
                    k = (b, s, side, key)
                    best[k] = min(best.get(k, float("inf")), value)
    print(f"\n| batch | prompt | ms-llm tok/s | transformers tok/s | ratio | ms-llm ms/step "
          f"| transformers ms/step | ms-llm prefill ms | transformers prefill ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for b, s in grid:
        ms_tps = b * args.new / best[(b, s, "ms", "total")]
        hf_tps = b * args.new / best[(b, s, "hf", "total")]
        print(f"| {b} | {s} | {ms_tps:.1f} | {hf_tps:.1f} | {ms_tps / hf_tps:.2f}x | "
              f"{1e3 * best[(b, s, 'ms', 'step')]:.1f} | {1e3 * best[(b, s, 'hf', 'step')]:.1f} | "
              f"{1e3 * best[(b, s, 'ms', 'prefill')]:.0f} | "
              f"{1e3 * best[(b, s, 'hf', 'prefill')]:.0f} |")
    per_step_parts(grid, best, args.new)
    print(f"\nCPU at the end: {machine()}; run took {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
