"""FSDP memory and speed on the foundation issue's ~50M Llama-style model (msrun, CPU).

For fsdp = 1 (one process), 2, 3, 4 and plain dp = 2 it reports, from rank 0 of each job:
per-rank bytes of parameters + gradients + AdamW moments (the sharded state each rank keeps;
target: within 5% of total / N plus one gathered unit), peak RSS of the process, and the median
step time; the last column is fsdp=2's step time over dp=2's (target <= 1.15).

``python benchmarks/fsdp_memory.py [--steps 3] [--seq 256] [--mbs 1]``. Each job trains the model
for a few steps on the embedded corpus (PyNative; FSDP needs it).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ["--model.family", "llama", "--model.num_layers", "8", "--model.hidden_size", "512",
         "--model.ffn_hidden_size", "1408", "--model.num_attention_heads", "8",
         "--model.num_query_groups", "2", "--model.kv_channels", "64",
         "--model.padded_vocab_size", "32000", "--model.qk_layernorm", "false",
         "--model.untie_embeddings_and_output_weights", "true", "--training.jit", "false",
         "--training.progress_bar", "false", "--training.output_dir", "/tmp/ms_llm_bench_fsdp"]


def worker(out: str, steps: int, overrides) -> None:
    sys.path.insert(0, ROOT)
    from ms_llm.compat import setup_device
    setup_device("CPU")
    import numpy as np
    from ms_llm.config import load_config
    from ms_llm.parallel.runtime import init_distributed
    from ms_llm.training.metrics import peak_rss_gb
    from ms_llm.training.trainer import Trainer

    info = init_distributed()
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), MODEL + list(overrides))
    tr = Trainer(cfg, info)
    state_bytes = sum(int(np.prod(p.shape)) * 4 * 4 for p in tr.params)  # param, grad, m, v
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        tr.train_step()
        times.append(time.perf_counter() - t0)
    # The largest gathered weight (the embedding / output layer unit), fp32.
    unit = max(getattr(p, "fsdp_rows", (0, 0, p.shape[0]))[2] * int(np.prod(p.shape[1:]))
               for p in tr.params) * 4
    if info.rank == 0:
        with open(out, "w") as f:
            json.dump({"state_bytes": state_bytes, "largest_param_bytes": unit, "peak_rss_gb": peak_rss_gb(),
                       "step_s": statistics.median(times[1:] or times)}, f)


def launch(nproc: int, overrides, steps: int) -> dict:
    out = f"/tmp/ms_llm_bench_fsdp_{nproc}_{abs(hash(tuple(overrides)))}.json"
    if nproc == 1:
        cmd = [sys.executable, __file__, "--as-worker", out, "--steps", str(steps), "--",
               *overrides]
        env = dict(os.environ, GLOG_v="3")
    else:
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from msrun_util import msrun_command
        cmd, env = msrun_command("../../benchmarks/fsdp_memory.py", nproc,
                                 f"/tmp/ms_llm_bench_fsdp_logs_{nproc}",
                                 ["--as-worker", out, "--steps", str(steps), "--", *overrides])
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0 or not os.path.isfile(out):
        raise SystemExit(f"job nproc={nproc} {overrides} failed:\n{r.stdout[-2000:]}"
                         f"{r.stderr[-2000:]}")
    with open(out) as f:
        return json.load(f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--mbs", type=int, default=1)
    ap.add_argument("--as-worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("rest", nargs="*")
    args = ap.parse_args()
    if args.as_worker:
        worker(args.as_worker, args.steps, args.rest)
        return
    base = ["--data.seq_length", str(args.seq), "--training.micro_batch_size", str(args.mbs)]
    rows = []
    for label, n, extra in (("fsdp=1", 1, []), ("fsdp=2", 2, ["--parallel.fsdp_size", "2"]),
                            ("fsdp=3", 3, ["--parallel.fsdp_size", "3"]),
                            ("fsdp=4", 4, ["--parallel.fsdp_size", "4"]), ("dp=2", 2, [])):
        gbs = ["--training.global_batch_size", str(args.mbs * n)]
        rows.append((label, n, launch(n, base + gbs + extra, args.steps)))
    total = rows[0][2]["state_bytes"]
    print(f"\n~50M Llama, fp32 AdamW, seq {args.seq}, micro-batch {args.mbs} per rank, "
          f"{args.steps} steps")
    print(f"{'layout':<8} {'state MB/rank':>14} {'total/N MB':>11} {'+1 unit MB':>11} "
          f"{'ratio':>6} {'peak RSS GB':>12} {'step s':>7}")
    for label, n, r in rows:
        ideal = total / n if label.startswith("fsdp") else total
        bound = ideal + r["largest_param_bytes"]
        print(f"{label:<8} {r['state_bytes'] / 2**20:14.1f} {ideal / 2**20:11.1f} "
              f"{bound / 2**20:11.1f} {r['state_bytes'] / ideal:6.3f} {r['peak_rss_gb']:12.2f} "
              f"{r['step_s']:7.2f}")
    f2 = next(r for lbl, _, r in rows if lbl == "fsdp=2")
    d2 = next(r for lbl, _, r in rows if lbl == "dp=2")
    print(f"step time fsdp=2 / dp=2: {f2['step_s'] / d2['step_s']:.2f} (target <= 1.15)")


if __name__ == "__main__":
    main()
