"""Where the fp32 training step of the ~55M Llama goes: each part timed alone, forward + backward.

Same model as ``benchmarks/train_step.py`` (hidden 512, 8 layers, 8/2 heads, FFN 1408, vocab
32000, seq 512, batch 4). Each component is the real ``ms_llm.ops`` / model code at the model's
shapes, differentiated with ``mindspore.value_and_grad`` (input and weight gradients), timed as
the median of ``--reps`` calls, times its count per step; then the real ``Trainer.train_step``
(PyNative) is timed in the same process, and the table shows each part's share and the
remainder (dispatch, autograd bookkeeping, residual adds, copies). On a shared machine every row
is inflated alike; read the shares, not the seconds. ``--clock cpu`` times with this process'
CPU time instead of the wall clock, which the other processes' load barely changes; run it with
``MS_LLM_BLAS_THREADS=1`` so that no idle BLAS thread spins (the seconds are then one core's).

``--bf16``: the same in bf16 (bf16 activations and weights, ``--training.bf16 true`` for the step),
to see where the bf16 step goes (GEMMs on the registered bf16 GEMM, the fp32 element-wise kernels
with their widen/round casts).

``python -m benchmarks.step_breakdown [--reps 5] [--steps 4] [--clock wall|cpu] [--bf16]``
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from benchmarks.harness import ROOT

H, LAYERS, HEADS, KV, FFN, VOCAB, SEQ, BATCH = 512, 8, 8, 2, 1408, 32000, 512, 4
D = H // HEADS
TOK = BATCH * SEQ


CLOCK = {"now": time.perf_counter}


def timed(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = CLOCK["now"]()
        fn()
        ts.append(CLOCK["now"]() - t0)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    ap.add_argument("--bf16", action="store_true")
    args = ap.parse_args()
    if args.clock == "cpu":
        CLOCK["now"] = time.process_time
    from ms_llm.compat import setup_device
    setup_device("CPU")
    import mindspore as ms
    from mindspore import Parameter, Tensor
    from ms_llm.ops import resolve_paths
    from ms_llm.ops.attention import causal_attention
    from ms_llm.ops.cross_entropy import cross_entropy
    from ms_llm.ops.linear import linear
    from ms_llm.ops.rms_norm import rms_norm
    from ms_llm.ops.rope import apply_rope, rope_cos_sin
    from ms_llm.ops.swiglu import swiglu
    from ms_llm.training import grad as gradlib
    from ms_llm.optim import AdamW
    resolve_paths()
    rng = np.random.default_rng(0)

    dtype = ms.bfloat16 if args.bf16 else ms.float32

    def t(*shape, scale=0.02):
        return Tensor(rng.standard_normal(shape, dtype=np.float32) * scale).astype(dtype)

    def fwd_bwd(fn, inputs, weights=()):
        params = [Parameter(w, name=f"w{i}") for i, w in enumerate(weights)]
        g = ms.value_and_grad(lambda *x: fn(*x, *params).astype(ms.float32).sum(), grad_position=tuple(
            range(len(inputs))), weights=params or None)

        def run():
            loss, grads = g(*inputs)
            loss.asnumpy()
        return run

    x = t(BATCH, SEQ, H, scale=1.0)
    cos, sin = rope_cos_sin(SEQ, D, 10000.0)
    labels = Tensor(rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32))
    q, k, v = t(BATCH, HEADS, SEQ, D, scale=1), t(BATCH, KV, SEQ, D, scale=1), \
        t(BATCH, KV, SEQ, D, scale=1)
    mm = lambda n, kk: 6 * TOK * n * kk          # noqa: E731 fwd+bwd FLOPs of a linear
    parts = [  # (name, count per step, callable, training FLOPs per call)
        ("linear_qkv 512->768", LAYERS, fwd_bwd(linear, [x], [t(H + 2 * KV * D, H)]),
         mm(H + 2 * KV * D, H)),
        ("linear_proj 512->512", LAYERS, fwd_bwd(linear, [x], [t(H, H)]), mm(H, H)),
        ("linear_fc1 512->2816", LAYERS, fwd_bwd(linear, [x], [t(2 * FFN, H)]), mm(2 * FFN, H)),
        ("linear_fc2 1408->512", LAYERS, fwd_bwd(linear, [t(BATCH, SEQ, FFN, scale=1)],
                                                 [t(H, FFN)]), mm(H, FFN)),
        ("attention core (QK^T, softmax, PV)", LAYERS,
         fwd_bwd(lambda a, b, c: causal_attention(a, b, c), [q, k, v]),
         6 * 2 * BATCH * HEADS * SEQ * SEQ * D),
        ("rope q+k", LAYERS, fwd_bwd(lambda a: apply_rope(a, cos, sin),
                                     [t(BATCH, HEADS + KV, SEQ, D, scale=1)]), 0),
        ("rms_norm x2", 2 * LAYERS + 1, fwd_bwd(lambda a, w: rms_norm(a, w, 1e-5), [x],
                                                [Tensor(np.ones(H, np.float32))]), 0),
        ("swiglu", LAYERS, fwd_bwd(swiglu, [t(BATCH, SEQ, 2 * FFN, scale=1)]), 0),
        ("output layer 512->32000 + cross entropy", 1,
         fwd_bwd(lambda a, w: cross_entropy(linear(a, w), labels), [x], [t(VOCAB, H)]),
         mm(VOCAB, H)),
    ]
    rows = []
    for name, count, fn, flops in parts:
        s = timed(fn, args.reps)
        rows.append((name, count, s * count, flops * count))
        print(f"  measured {name}: {s * 1e3:.1f} ms x {count}", flush=True)

    # optimizer and grad norm on the model's parameter set
    from ms_llm.config import load_config
    from ms_llm.training.trainer import Trainer
    from benchmarks import train_step as ts
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), ts.MODEL_OVERRIDES + [
        "--training.jit", "false", "--training.output_dir", "/tmp/ms_llm_bench_breakdown",
        "--training.bf16", str(args.bf16).lower()])
    tr = Trainer(cfg)
    grads = [Tensor(np.full(p.shape, 1e-3, np.float32)) for p in tr.params]
    opt = AdamW([(p.name, Parameter(Tensor(np.zeros(p.shape, np.float32)), name=p.name))
                 for p in tr.params], lr=1e-4, weight_decay=0.1)
    rows.append(("AdamW step (fused AdamWeightDecay)", 1,
                 timed(lambda: (opt.step(grads), opt.params[0].asnumpy()), args.reps), 0))
    rows.append(("grad norm (host) + clip", 1, timed(
        lambda: gradlib.clip_(grads, 1.0, gradlib.global_norm(grads)), args.reps), 0))
    step = statistics.median(timed(tr.train_step, 1) for _ in range(args.steps))
    print(f"\nTrainer.train_step (PyNative{', bf16' if args.bf16 else ''}): {step:.2f} s ({args.clock} clock) median of "
          f"{args.steps}, {TOK / step:.0f} tokens/s\n")
    print(f"| {'part':<40} | {'x/step':>6} | {'s/step':>7} | {'share':>6} | {'GFLOP/s':>8} |")
    print(f"|{'-' * 42}|{'-' * 8}|{'-' * 9}|{'-' * 8}|{'-' * 10}|")
    total = 0.0
    for name, count, s, flops in rows:
        total += s
        rate = f"{flops / s / 1e9:8.1f}" if flops else f"{'':>8}"
        print(f"| {name:<40} | {count:>6} | {s:7.3f} | {100 * s / step:5.1f}% | {rate} |")
    print(f"| {'remainder (dispatch, adds, copies, ...)':<40} | {'':>6} | {step - total:7.3f} |"
          f" {100 * (step - total) / step:5.1f}% | {'':>8} |")


if __name__ == "__main__":
    main()
