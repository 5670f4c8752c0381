"""Context parallel: peak memory per rank and step time at long sequences (msrun, CPU).

For each sequence length (default 2K, 4K, 8K) it trains a small Llama-style model (2 layers,
hidden 256, 8 heads, 2 KV groups, micro-batch 1) for a few steps with cp = 1 (one process,
plain attention), cp = 2 and cp = 4, ring (``megatron_cp_algo``) and Ulysses
(``ulysses_cp_algo``); every cp rank is its own process (dp = 1). Per job it reports the
median step time (first step dropped) and, over the ranks, the largest peak RSS and the largest
growth of RSS during training (peak minus the RSS after the model was built: activations,
gradients and optimizer state, the part context parallel divides). MindSpore's CPU memory pool
never shrinks, so peak RSS is the honest high-water mark.

``python -m benchmarks.context_parallel [--seqs 2048,4096,8192] [--cps 1,2,4]
[--algos ring,ulysses] [--steps 3]``
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import time

from benchmarks.harness import ROOT

MODEL = ["--model.family", "llama", "--model.num_layers", "2", "--model.hidden_size", "256",
         "--model.ffn_hidden_size", "704", "--model.num_attention_heads", "8",
         "--model.num_query_groups", "2", "--model.kv_channels", "32",
         "--model.max_position_embeddings", "8192", "--model.qk_layernorm", "false",
         "--training.jit", "false", "--training.progress_bar", "false",
         "--training.micro_batch_size", "1", "--training.global_batch_size", "1",
         "--training.output_dir", "/tmp/ms_llm_bench_cp"]
ALGOS = {"ring": "megatron_cp_algo", "ulysses": "ulysses_cp_algo"}


def _rss_gb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 30


def worker(out: str, steps: int, overrides) -> None:
    from ms_llm.compat import setup_device
    setup_device("CPU")
    from ms_llm.config import load_config
    from ms_llm.parallel.runtime import init_distributed
    from ms_llm.training.metrics import peak_rss_gb
    from ms_llm.training.trainer import Trainer

    info = init_distributed()
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), MODEL + list(overrides))
    tr = Trainer(cfg, info)
    base = _rss_gb()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        tr.train_step()
        times.append(time.perf_counter() - t0)
    with open(f"{out}.{info.rank}", "w") as f:
        json.dump({"step_s": statistics.median(times[1:] or times), "peak_rss_gb": peak_rss_gb(),
                   "growth_gb": peak_rss_gb() - base}, f)


def launch(seq: int, cp: int, algo: str, steps: int) -> dict:
    out = f"/tmp/ms_llm_bench_cp_{seq}_{cp}_{algo}.json"
    for old in glob.glob(out + ".*"):
        os.remove(old)
    overrides = ["--data.seq_length", str(seq), "--parallel.context_parallel_size", str(cp),
                 "--parallel.context_parallel_algo", ALGOS[algo]]
    from benchmarks.harness import check, launch as launch_worker
    r = check(launch_worker(os.path.abspath(__file__), cp, f"/tmp/ms_llm_bench_cp_logs_{cp}",
                            ["--as-worker", out, "--steps", str(steps), "--", *overrides],
                            cluster_time_out=300), f"job seq={seq} cp={cp} {algo}")
    ranks = sorted(glob.glob(out + ".*"))
    if len(ranks) != cp:
        raise SystemExit(f"job seq={seq} cp={cp} {algo}: {len(ranks)} of {cp} ranks wrote "
                         f"results:\n{r.failure_report(3000)}")
    per_rank = [json.load(open(p)) for p in ranks]
    return {"step_s": max(x["step_s"] for x in per_rank),
            "peak_rss_gb": max(x["peak_rss_gb"] for x in per_rank),
            "growth_gb": max(x["growth_gb"] for x in per_rank)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="2048,4096,8192")
    ap.add_argument("--cps", default="1,2,4")
    ap.add_argument("--algos", default="ring,ulysses")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--as-worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("rest", nargs="*")
    args = ap.parse_args()
    if args.as_worker:
        worker(args.as_worker, args.steps, args.rest)
        return
    rows = []
    for seq in (int(s) for s in args.seqs.split(",")):
        for cp in (int(c) for c in args.cps.split(",")):
            for algo in (["-"] if cp == 1 else args.algos.split(",")):
                r = launch(seq, cp, "ring" if algo == "-" else algo, args.steps)
                rows.append((seq, cp, algo, r))
                print(f"  seq {seq} cp {cp} {algo}: {r}", flush=True)
    print(f"\n2-layer Llama (hidden 256, 8 heads, 2 KV groups), fp32 AdamW, micro-batch 1, "
          f"median of {args.steps} steps (first dropped), PyNative, every cp rank a process")
    print(f"{'seq':>6} {'cp':>3} {'algo':>8} {'step s':>8} {'peak RSS GB/rank':>17} "
          f"{'growth GB/rank':>15} {'growth vs cp=1':>15}")
    base = {seq: r["growth_gb"] for seq, cp, _, r in rows if cp == 1}
    for seq, cp, algo, r in rows:
        rel = f"{r['growth_gb'] / base[seq]:.2f}" if base.get(seq) else "-"
        print(f"{seq:>6} {cp:>3} {algo:>8} {r['step_s']:8.2f} {r['peak_rss_gb']:17.2f} "
              f"{r['growth_gb']:15.2f} {rel:>15}")


if __name__ == "__main__":
    main()
