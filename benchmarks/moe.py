"""MoE benchmarks. Default (``--mode train``): the one-process MoE training step, ``ms-llm train``
vs transformers' Qwen3-MoE with torch eager AdamW, same shapes, ratio column
(``benchmarks/moe_train.py``, which documents the rows; its flags pass through).

    python -m benchmarks.moe                      # training step vs transformers (~5-8 min)
    python -m benchmarks.moe --steps 6 --variants cli,torch

``--mode ep``: the expert-parallel MoE layer under msrun, the ``alltoall`` dispatcher vs
``megamoe``:

    python -m benchmarks.moe --mode ep                      # 2 workers, ep=2, default shapes
    python -m benchmarks.moe --mode ep --nproc 2 --tokens 4096 --experts 8 --repeat 7

Each worker builds the same MoE layer (same seed), shards its experts over the ep group (= all
workers) and times forward + backward of ``sum(layer(x) * dy)`` on its own ``--tokens`` tokens,
the variants taking turns (so load from other processes hits all alike); each timing ends with a
barrier and ``.asnumpy()``. Rank 0 prints, per variant: median ms, tokens/s over all ranks, the
ratio against ``alltoall`` (same script, same run), and for MegaMoE the all-to-all time measured
on the communication thread, the time the main thread was blocked waiting for it, and the
fraction hidden = 1 - blocked / all-to-all.

Variants: ``alltoall`` (Megatron's dispatcher, autograd through the all-to-alls), ``megamoe G=g``
(experts in g pipelined groups), and ``megamoe G=2 serial`` (the same pipeline with the CPU
communication thread disabled, ``runtime.comm_thread: false``: what the overlap itself is worth).
Every variant's output and input gradient are checked against ``alltoall``'s (max |diff|).

Afterwards, the local expert FFN forms (grouped matmul vs a loop of per-expert modules) are
measured by ``benchmarks/moe_layer.py`` at this run's per-rank shapes, and a timeline of one
MegaMoE step (real event timestamps of rank 0 and 1) is drawn to ``--timeline``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from benchmarks.harness import ROOT


def worker(args) -> None:
    from ms_llm.compat import setup_device
    setup_device("CPU")
    import numpy as np
    import mindspore as ms
    from mindspore import Tensor
    from ms_llm.compat import manual_seed
    from ms_llm.compat.environment import configure
    from ms_llm.models import TransformerConfig
    from ms_llm.models.moe import MoELayer
    from ms_llm.ops import resolve_paths
    from ms_llm.parallel import comm
    from ms_llm.parallel.expert_parallel import apply_expert_parallel
    from ms_llm.parallel.megamoe import Timeline
    from ms_llm.parallel.runtime import init_distributed

    info = init_distributed()
    resolve_paths()
    group = comm.world_group()
    cfg = TransformerConfig(num_layers=1, hidden_size=args.hidden, num_attention_heads=8,
                            ffn_hidden_size=args.ffn, padded_vocab_size=128, mlp_type="moe",
                            num_moe_experts=args.experts, moe_router_topk=args.topk,
                            moe_ffn_hidden_size=args.ffn, moe_grouped_gemm=args.grouped)
    variants = [("alltoall", "alltoall", 1, True)]
    variants += [(f"megamoe G={g}", "megamoe", g, True) for g in args.groups]
    variants += [("megamoe G=2 serial", "megamoe", 2, False)]
    rng = np.random.default_rng(100 + info.rank)
    x = Tensor(rng.standard_normal((1, args.tokens, args.hidden)).astype(np.float32))
    dy = Tensor(rng.standard_normal((1, args.tokens, args.hidden)).astype(np.float32))
    runs = []
    for name, dispatcher, groups, thread in variants:
        manual_seed(0)
        layer = MoELayer(cfg)
        layer.set_train(True)
        timeline = Timeline()
        apply_expert_parallel(layer, group, dispatcher=dispatcher, expert_groups=groups,
                              timeline=timeline)
        params = [p for p in layer.trainable_params()]

        def loss(inp, layer=layer):
            return (layer(inp) * dy).sum()
        runs.append({"name": name, "thread": thread, "timeline": timeline,
                     "grad": ms.value_and_grad(loss, 0, params), "times": [], "comm": [],
                     "wait": []})
    outs = []
    for i in range(args.warmup + args.repeat):
        for run in runs:
            configure({"runtime.comm_thread": bool(run["thread"])})
            run["timeline"].clear()
            comm.barrier()
            t0 = time.perf_counter()
            value, (gx, _) = run["grad"](x)
            gx.asnumpy()
            comm.barrier()
            dt = time.perf_counter() - t0
            if i >= args.warmup:
                ev = run["timeline"].events
                run["times"].append(dt)
                run["comm"].append(sum(e["t1"] - e["t0"] for e in ev if e["kind"] == "comm"))
                run["wait"].append(sum(e["t1"] - e["t0"] for e in ev if e["kind"] == "wait"))
            if i == args.warmup + args.repeat - 1:
                outs.append((float(value.asnumpy()), gx.asnumpy()))
                if run["name"] == f"megamoe G={max(args.groups)}":
                    with open(f"{args.out}.timeline.{info.rank}.json", "w") as f:
                        json.dump(ev, f)
    base_value, base_gx = outs[0]
    table = []
    for run, (value, gx) in zip(runs, outs):
        diff = max(abs(value - base_value) / max(abs(base_value), 1e-30),
                   float(np.abs(gx - base_gx).max()))
        row = {"name": run["name"], "ms": statistics.median(run["times"]) * 1e3,
               "comm_ms": statistics.median(run["comm"]) * 1e3,
               "wait_ms": statistics.median(run["wait"]) * 1e3, "diff": diff}
        table.append(row)
    # Rank 0 reports the slowest rank's time per variant (a step is as slow as its slowest rank).
    worst = Tensor(np.array([r["ms"] for r in table], np.float32))
    comm.all_reduce(worst, op="max")
    for r, ms_max in zip(table, worst.asnumpy()):
        r["ms_max"] = float(ms_max)
    if info.rank == 0:
        with open(args.out, "w") as f:
            json.dump({"table": table, "world": info.world_size}, f)


def draw_timeline(paths, out_png: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    colors = {"compute": "#4C72B0", "comm": "#DD8452", "wait": "#C44E52"}
    lanes = []
    for p in paths:
        ev = json.load(open(p))
        if not ev:
            continue
        t0 = min(e["t0"] for e in ev)
        r = ev[0]["rank"]
        lanes.append((f"rank {r} compute", [e for e in ev if e["kind"] == "compute"], t0))
        lanes.append((f"rank {r} blocked", [e for e in ev if e["kind"] == "wait"], t0))
        lanes.append((f"rank {r} all-to-all", [e for e in ev if e["kind"] == "comm"], t0))
    fig, ax = plt.subplots(figsize=(10, 0.5 + 0.45 * len(lanes)), dpi=110)
    for y, (label, ev, t0) in enumerate(lanes):
        for e in ev:
            ax.barh(y, (e["t1"] - e["t0"]) * 1e3, left=(e["t0"] - t0) * 1e3, height=0.6,
                    color=colors[e["kind"]], edgecolor="black", linewidth=0.3)
            ax.text((e["t0"] - t0) * 1e3, y, f"{e['phase']} {e['group']}", fontsize=5,
                    va="center")
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels([lab for lab, _, _ in lanes], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the rank's first event (one forward + backward)")
    ax.set_title("MegaMoE schedule, measured (CPU, ep=2): expert groups g, fwd then bwd",
                 fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out_png)), exist_ok=True)
    fig.savefig(out_png)
    return out_png


def main() -> None:
    mode = argparse.ArgumentParser(add_help=False)
    mode.add_argument("--mode", choices=("train", "ep"), default="train")
    known, rest = mode.parse_known_args()
    if known.mode == "train" and "--as-worker" not in rest:
        from benchmarks import moe_train
        return moe_train.main(rest)
    sys.argv = [sys.argv[0], *rest]
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=512, help="moe_ffn_hidden_size")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--groups", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--grouped", action="store_true", help="GroupedMLP weights")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--timeline", default=os.path.join(ROOT, "docs", "megamoe_timeline.png"))
    ap.add_argument("--skip-local", action="store_true", help="skip the grouped-matmul table")
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--as-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.as_worker:
        return worker(args)
    import tempfile
    from benchmarks.harness import check, launch, machine
    tmp = tempfile.mkdtemp(prefix="ms_llm_moe_bench_")
    out = os.path.join(tmp, "result.json")
    r = launch(os.path.abspath(__file__), args.nproc, os.path.join(tmp, "logs"),
               [*sys.argv[1:], "--mode", "ep", "--as-worker", "--out", out])
    check(r, "msrun")
    print(f"# {machine()} (figures are noisy on a shared machine)")
    res = json.load(open(out))
    w = res["world"]
    print(f"# MoE layer fwd+bwd, ep={w} on {w} msrun workers: tokens/rank={args.tokens} "
          f"hidden={args.hidden} moe_ffn={args.ffn} experts={args.experts} top-{args.topk} "
          f"{'GroupedMLP' if args.grouped else 'SequentialMLP'}; median of {args.repeat} "
          f"after {args.warmup} warm-up, slowest rank")
    print("| variant | ms/step | tokens/s (all ranks) | vs alltoall | all-to-all ms (comm "
          "thread) | blocked ms | hidden | max diff vs alltoall |")
    print("|---|---|---|---|---|---|---|---|")
    base = res["table"][0]["ms_max"]
    for row in res["table"]:
        hidden = "-" if row["comm_ms"] <= 0 else \
            f"{max(0.0, 1 - row['wait_ms'] / row['comm_ms']):.0%}"
        comm_ms = f"{row['comm_ms']:.1f}" if row["comm_ms"] > 0 else "-"
        wait_ms = f"{row['wait_ms']:.1f}" if row["name"] != "alltoall" else "-"
        print(f"| {row['name']} | {row['ms_max']:.1f} | {args.tokens * w / row['ms_max'] * 1e3:.0f}"
              f" | {base / row['ms_max']:.2f}x | {comm_ms} | {wait_ms} | {hidden} | "
              f"{row['diff']:.1e} |")
    paths = [f"{out}.timeline.{r}.json" for r in range(w)]
    print(f"\ntimeline: {draw_timeline([p for p in paths if os.path.isfile(p)], args.timeline)}")
    if not args.skip_local:
        print(f"\n# local expert FFN at this run's per-rank shapes (benchmarks/moe_layer.py: "
              f"{args.experts // w} local experts, ~{args.tokens * args.topk} rows)")
        from benchmarks import moe_layer
        moe_layer.main(["--tokens", str(args.tokens), "--hidden", str(args.hidden), "--ffn",
                        str(args.ffn), "--experts", str(args.experts // w), "--topk",
                        str(args.topk), "--repeat", str(args.repeat)])


if __name__ == "__main__":
    main()
