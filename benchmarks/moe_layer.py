"""Expert FFN of the dropless MoE layer on CPU: the grouped-matmul forms of ``ms_llm.ops.moe`` vs
a loop of per-expert modules (Megatron ``SequentialMLP``'s structure: each expert's
``linear_fc1 -> swiglu -> linear_fc2`` on its block), forward + backward, PyNative.

    python -m benchmarks.moe_layer                       # default shapes
    python -m benchmarks.moe_layer --tokens 4096 --experts 16 --topk 2 --repeat 7
    python -m benchmarks.moe_layer --breakdown           # one MoE layer, stage by stage

``--breakdown`` (defaults there: 1024 tokens, hidden 512, 64 experts of FFN 256, top-8: the MoE
goal of issue #31): forward + backward of each stage of a whole ``MoELayer`` -- router (linear,
top-k, softmax, aux + z loss), sort by expert (with its host copy of the counts on the composed
path), permutation, expert FFN, combine -- and the whole layer, on the composed ops
(``ms_llm.ops.moe.composed_only``, per-expert ``loop``) and on the fused CPU kernels.

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
import statistics
import time

import numpy as np


import mindspore as ms
from mindspore import Tensor


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
    ap.add_argument("--breakdown", action="store_true",
                    help="stage-by-stage time of one MoE layer, composed vs fused")
    args = ap.parse_args(argv)
    if args.breakdown:
        return breakdown(args, argv or [])

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


def breakdown(args, argv) -> None:
    """Stage-by-stage forward + backward of one MoE layer, composed vs fused."""
    def given(flag):
        return any(a == flag or a.startswith(flag + "=") for a in argv)
    tokens = args.tokens if given("--tokens") else 1024
    experts = args.experts[0] if given("--experts") else 64
    topk = args.topk if given("--topk") else 8
    from benchmarks.harness import machine
    from ms_llm.compat import manual_seed, setup_device
    setup_device("CPU", threads=args.ms_threads)
    from ms_llm.models import TransformerConfig
    from ms_llm.models.moe import MoELayer
    from ms_llm.ops import moe as mo, resolve_paths
    paths = resolve_paths()
    h = args.hidden
    cfg = TransformerConfig(num_layers=1, hidden_size=h, num_attention_heads=8,
                            ffn_hidden_size=args.ffn, padded_vocab_size=128, mlp_type="moe",
                            num_moe_experts=experts, moe_router_topk=topk,
                            moe_ffn_hidden_size=args.ffn, moe_aux_loss_coeff=0.001,
                            moe_z_loss_coeff=0.001)
    manual_seed(0)
    layer = MoELayer(cfg)
    layer.set_train(True)
    rng = np.random.default_rng(0)
    x = Tensor(rng.standard_normal((tokens, h)).astype(np.float32))
    dy = Tensor(rng.standard_normal((tokens, h)).astype(np.float32))
    probs, top = layer.router(x)
    slots, restore, sizes = mo.sort_by_expert(top, experts)
    d_slots, d_restore, d_sizes = mo.sort_by_expert_device(top, experts)
    rows = mo.permute(x, slots, topk)
    dy_rows = Tensor(rng.standard_normal(rows.shape).astype(np.float32))
    y_rows = layer.experts(rows, sizes)
    exp_params = layer.experts.trainable_params()

    def stage_router():
        def f(inp):
            p, _ = layer.router(inp)
            return (p * 1.0).sum() + layer.router.aux_loss
        return ms.value_and_grad(f, 0, layer.router.trainable_params())

    def run_sort(device):
        def f():
            if device:
                return mo.sort_by_expert_device(top, experts)[2].asnumpy()
            with mo.composed_only():
                return mo.sort_by_expert(top, experts)[2]
        return f

    perm_old = ms.value_and_grad(lambda a: (mo.permute(a, slots, topk) * dy_rows).sum(), 0)
    perm_new = ms.value_and_grad(
        lambda a: (mo.permute_rows(a, d_slots, d_restore) * dy_rows).sum(), 0)

    def ffn(impl):
        def f(r):
            layer.experts.gmm_impl = impl
            return (layer.experts(r, sizes if impl == "loop" else d_sizes) * dy_rows).sum()
        return ms.value_and_grad(f, 0, exp_params)

    def combine(fused):
        def f(o, p):
            if fused:
                return (mo.unpermute(o, d_restore, p) * dy).sum()
            with mo.composed_only():
                return (mo.unpermute(o, restore, p) * dy).sum()
        return ms.value_and_grad(f, (0, 1))

    def whole(fused):
        def f(inp):
            return (layer(inp) * dy).sum() + layer.router.aux_loss
        g = ms.value_and_grad(f, 0, layer.trainable_params())

        def run():
            layer.experts.gmm_impl = "auto" if fused else "loop"
            if fused:
                return g(x)
            with mo.composed_only():
                return g(x)
        return run

    r_grad, p_old, p_new = stage_router(), perm_old, perm_new
    f_old, f_new, c_old, c_new = ffn("loop"), ffn("fused"), combine(False), combine(True)
    stages = [("router: linear, top-k, softmax, aux + z loss", lambda: r_grad(x), lambda: r_grad(x)),
              ("sort by expert (+ host copy of counts: composed)", run_sort(False), run_sort(True)),
              ("permute rows", lambda: p_old(x), lambda: p_new(x)),
              ("expert FFN (fc1, SwiGLU, fc2)", lambda: f_old(rows), lambda: f_new(rows)),
              ("unpermute + weighted combine", lambda: c_old(y_rows, probs),
               lambda: c_new(y_rows, probs)),
              ("whole MoE layer", whole(False), whole(True))]

    def sync(r):
        leaves = r if isinstance(r, (tuple, list)) else [r]
        for leaf in leaves:
            if isinstance(leaf, (tuple, list)):
                sync(leaf)
            elif isinstance(leaf, Tensor):
                leaf.asnumpy()

    times = {(i, j): [] for i in range(len(stages)) for j in (0, 1)}
    for it in range(args.warmup + args.repeat):
        for i, (_, old, new) in enumerate(stages):
            for j, fn in enumerate((old, new)):
                t0 = time.perf_counter()
                sync(fn())
                if it >= args.warmup:
                    times[(i, j)].append(time.perf_counter() - t0)
    stat = min if args.stat == "min" else statistics.median
    print(f"# {machine()} (noisy on a shared machine)")
    print(f"# MoE layer breakdown, fwd+bwd: tokens={tokens} hidden={h} experts={experts} "
          f"moe_ffn={args.ffn} top-{topk}, rows per expert {min(sizes)}-{max(sizes)}; linear "
          f"path={paths['linear']}; {args.stat} of {args.repeat} after {args.warmup} warm-up")
    print("| stage | composed ms | fused ms | speed-up |")
    print("|---|---|---|---|")
    for i, (name, _, _) in enumerate(stages):
        a, b = stat(times[(i, 0)]) * 1e3, stat(times[(i, 1)]) * 1e3
        print(f"| {name} | {a:.1f} | {b:.1f} | {a / b:.1f}x |")


if __name__ == "__main__":
    main()
