"""Activation recompute: peak memory and step time through ``ms-llm train`` itself.

Each variant is a fresh ``ms-llm train`` process (peak RSS cannot be reset inside one), on the
same model and batch; the table gives the median step time of steps 3..N, tokens/s and the peak
RSS the trainer logs (``metrics.jsonl``), against the run without recompute in the same script.

    python -m benchmarks.recompute [--steps 6] [--layers 8] [--seq 512] [--micro 4]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from benchmarks.harness import ROOT

VARIANTS = {
    "none": [],
    "norm": ["--training.recompute_norm", "true"],
    "full block 4": ["--training.recompute_granularity", "full", "--training.recompute_method",
                     "block", "--training.recompute_num_layers", "4"],
    "full uniform": ["--training.recompute_granularity", "full"],
}


def run(name: str, extra, args, out_root: str) -> dict:
    out = os.path.join(out_root, name.replace(" ", "_"))
    cmd = [sys.executable, "-m", "ms_llm.cli", "train", os.path.join(ROOT, "configs", "tiny.yaml"),
           "--model.num_layers", str(args.layers), "--model.hidden_size", "512",
           "--model.ffn_hidden_size", "1408", "--model.num_attention_heads", "8",
           "--model.num_query_groups", "2", "--model.kv_channels", "64",
           "--data.seq_length", str(args.seq), "--training.micro_batch_size", str(args.micro),
           "--training.global_batch_size", str(args.micro), "--training.max_steps",
           str(args.steps), "--training.log_interval", "1", "--training.jit", "false",
           "--training.progress_bar", "false", "--training.output_dir", out, *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if r.returncode:
        raise SystemExit(f"{name}: ms-llm train failed:\n{r.stderr[-2000:]}")
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    steps = [row["step_time_s"] for row in rows[2:]] or [rows[-1]["step_time_s"]]
    step = statistics.median(steps)
    return {"name": name, "step_s": step, "tokens_s": args.micro * args.seq / step,
            "peak_rss_gb": max(row["peak_rss_gb"] for row in rows),
            "loss": rows[-1]["loss"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--micro", type=int, default=4)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        res = [run(name, extra, args, tmp) for name, extra in VARIANTS.items()]
    base = res[0]
    print(f"\n{args.layers} layers, hidden 512, seq {args.seq}, micro-batch {args.micro}, "
          f"median of steps 3..{args.steps}\n")
    print(f"| variant | step s | tokens/s | peak RSS GB | RSS vs none | time vs none | "
          f"final loss |")
    print("|---|---|---|---|---|---|---|")
    for r in res:
        print(f"| {r['name']} | {r['step_s']:.2f} | {r['tokens_s']:.0f} | "
              f"{r['peak_rss_gb']:.2f} | {r['peak_rss_gb'] / base['peak_rss_gb']:.2f} | "
              f"{r['step_s'] / base['step_s']:.2f} | {r['loss']:.6f} |")


if __name__ == "__main__":
    main()
