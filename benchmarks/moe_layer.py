"""Expert FFN of the dropless MoE layer on CPU: the grouped-matmul forms of ``ms_llm.ops.moe`` vs
a loop of per-expert modules (Megatron ``SequentialMLP``'s structure: each expert's
``linear_fc1 -> swiglu -> linear_fc2`` on its block), forward + backward, PyNative.

    python benchmarks/moe_layer.py                       # default shapes
    python benchmarks/moe_layer.py --tokens 4096 --experts 16 --topk 2 --repeat 7

Rows (same sorted input, same weights; max |diff| to the baseline is printed as a check):

* ``per-expert modules`` (baseline): E x (fc1, swiglu, fc2) on each expert's block, then ``cat``.
* ``grouped loop`` (``impl="loop"``): fc1 over all blocks, ONE swiglu, fc2 over all blocks.
* ``grouped padded_bmm``: weights stacked to ``[E, M, K]`` each call, rows padded to the largest
  block, one ``bmm`` per projection.
* ``GroupedMLP loop`` / ``GroupedMLP padded_bmm``: the same on the ``weight1``/``weight2``
  layout (``moe_grouped_gemm``), where no weight stacking is needed.

Routing is either ``balanced`` (every expert gets about T*k/E rows) or ``skewed`` (Zipf-like:
expert e gets a share proportional to 1/(e+1); the last expert gets none), which is what makes
padding expensive. Timing: min (or --stat median) over --repeat after --warmup, the forms
taking turns; each call ends with ``.asnumpy()``.
Tokens/s counts the T input tokens (each routed to k experts).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import mindspore as ms  # noqa: E402
from mindspore import Tensor  # noqa: E402


def block_sizes(n_rows: int, experts: int, kind: str) -> list:
    if kind == "balanced":
        base = np.full(experts, n_rows // experts)
        base[: n_rows - base.sum()] += 1
        return base.tolist()
    share = np.array([1.0 / (e + 1) for e in range(experts)])
    share[-1] = 0.0
    sizes = np.floor(share / share.sum() * n_rows).astype(int)
    sizes[0] += n_rows - sizes.sum()
    return sizes.tolist()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=256, help="moe_ffn_hidden_size")
    ap.add_argument("--experts", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--ms-threads", type=int, default=1)
    ap.add_argument("--stat", choices=("min", "median"), default="min",
                    help="min is robust to other processes sharing the CPU")
    args = ap.parse_args(argv)

    from ms_llm.compat import setup_device
    setup_device("CPU", threads=args.ms_threads)
    from ms_llm import ops as hot
    from ms_llm.compat import F
    from ms_llm.models import TransformerConfig
    from ms_llm.models.moe import GroupedMLP, SequentialMLP
    from ms_llm.ops import resolve_paths
    paths = resolve_paths()

    print(f"# tokens={args.tokens} hidden={args.hidden} moe_ffn={args.ffn} topk={args.topk} "
          f"linear path={paths['linear']} swiglu path={paths['swiglu']} "
          f"ms threads={args.ms_threads}; fwd+bwd, {args.stat} of {args.repeat}")
    print("| experts | routing | rows per expert (min/max) | form | ms | tokens/s | vs baseline "
          "| max abs diff |")
    print("|---|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    n_rows = args.tokens * args.topk
    for e in args.experts:
        cfg = TransformerConfig(num_layers=1, hidden_size=args.hidden, num_attention_heads=8,
                                ffn_hidden_size=args.ffn, padded_vocab_size=128, mlp_type="moe",
                                num_moe_experts=e, moe_router_topk=args.topk,
                                moe_ffn_hidden_size=args.ffn)
        seq = SequentialMLP(cfg)
        grouped = GroupedMLP(cfg)
        # The same expert weights in both layouts.
        w1 = np.stack([p.linear_fc1.weight.asnumpy().T for p in seq.local_experts])
        w2 = np.stack([p.linear_fc2.weight.asnumpy().T for p in seq.local_experts])
        grouped.weight1.set_data(Tensor(np.ascontiguousarray(w1).reshape(args.hidden, -1)))
        grouped.weight2.set_data(Tensor(np.ascontiguousarray(w2).reshape(-1, args.hidden)))
        x = Tensor(rng.standard_normal((n_rows, args.hidden)).astype(np.float32))
        dy = Tensor(rng.standard_normal((n_rows, args.hidden)).astype(np.float32))

        for kind in ("balanced", "skewed"):
            sizes = block_sizes(n_rows, e, kind)

            def per_expert_modules(inp, sizes=sizes):
                outs = []
                for xe, size, mod in zip(F.split(inp, sizes, 0), sizes, seq.local_experts):
                    if size:
                        outs.append(mod.linear_fc2(hot.swiglu(mod.linear_fc1(xe))))
                return F.cat(outs, 0)

            def seq_form(impl, sizes=sizes):
                def f(inp):
                    seq.gmm_impl = impl
                    return seq(inp, sizes)
                return f, seq.trainable_params()

            def grouped_form(impl, sizes=sizes):
                def f(inp):
                    grouped.gmm_impl = impl
                    return grouped(inp, sizes)
                return f, grouped.trainable_params()

            forms = [("per-expert modules (baseline)", per_expert_modules, seq.trainable_params()),
                     ("grouped loop", *seq_form("loop")),
                     ("grouped padded_bmm", *seq_form("padded_bmm")),
                     ("GroupedMLP loop", *grouped_form("loop")),
                     ("GroupedMLP padded_bmm", *grouped_form("padded_bmm"))]
            # Round-robin over the forms, so load from other processes hits all of them alike.
            grads = []
            for name, fn, params in forms:
                def loss(inp, fn=fn):
                    return (fn(inp) * dy).sum()
                grads.append(ms.value_and_grad(loss, 0, params))
            times = [[] for _ in forms]
            for i in range(args.warmup + args.repeat):
                for j, grad in enumerate(grads):
                    t0 = time.perf_counter()
                    _, (gx, _) = grad(x)
                    gx.asnumpy()
                    if i >= args.warmup:
                        times[j].append(time.perf_counter() - t0)
            base_out = forms[0][1](x).asnumpy()
            base_t = None
            for (name, fn, _), ts in zip(forms, times):
                diff = float(np.abs(fn(x).asnumpy() - base_out).max())
                t = min(ts) if args.stat == "min" else statistics.median(ts)
                base_t = t if base_t is None else base_t
                print(f"| {e} | {kind} | {min(sizes)}/{max(sizes)} | {name} | {t * 1e3:.1f} | "
                      f"{args.tokens / t:.0f} | {base_t / t:.2f}x | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
