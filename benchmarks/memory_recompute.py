"""Peak memory and step time of activation recompute (and the distributed optimizer) on the
~55M model at seq 2048, measured through ``ms-llm train``, with ``ms-llm plan``'s prediction
beside each measurement.

Model: 8 layers, hidden 512, 8 heads / 2 query groups (head dim 64), SwiGLU FFN 1408, vocab
32000 (``model.padded_vocab_size``; the embedded tokenizer's ids use the first rows), untied
head, fp32, PyNative. Micro-batch 1 x seq 2048 (2048 tokens/step; batch reduced from 4 so four
[8, 2048, 2048] fp32 score tensors per layer fit a shared 24 GB machine).

Each variant is a fresh process (peak RSS cannot be reset inside one). "Peak" is the process's
RSS high-water mark minus its RSS just before the model is built (``rss_before_model_gb``);
"activations" is that peak minus the peak of the same model at seq 16 (parameters, gradients,
AdamW state and fixed overheads, with negligible activations). Step time: median of steps
2..N (step 1 includes kernel set-up). The machine is shared: step times are noisy.

    python -m benchmarks.memory_recompute [--steps 4] [--seq 2048] [--micro 1]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from ms_llm.config import merge_overrides

from benchmarks.harness import ROOT, model_55m
from ms_llm.launch.msrun import free_port, launch_env, msrun_command

MODEL = model_55m("qwen3")
VARIANTS = {
    "none": [],
    "selective": ["--training.recompute_granularity", "selective"],
    "full": ["--training.recompute_granularity", "full"],
}


def _overrides(args, extra, seq=None, micro=None):
    seq = seq or args.seq
    micro = micro or args.micro
    return MODEL + ["--data.seq_length", str(seq), "--training.micro_batch_size", str(micro),
                    "--training.global_batch_size", str(micro), "--training.jit", "false",
                    *extra]


def measure(name: str, overrides, steps: int, out_root: str, nproc: int = 1) -> dict:
    out = os.path.join(out_root, name.replace(" ", "_"))
    train = [os.path.join(ROOT, "configs", "tiny.yaml"),
             *merge_overrides(overrides, ["--training.max_steps", str(steps),
                                          "--training.log_interval", "1",
                                          "--training.progress_bar", "false",
                                          "--training.output_dir", out])]
    cmd = [sys.executable, "-m", "ms_llm.cli", "train", *train]
    if nproc > 1:   # msrun runs a script: ms_llm/cli/train.py, as scripts/pretrain.sh does
        cmd = msrun_command(os.path.join(ROOT, "ms_llm", "cli", "train.py"), train, worker_num=nproc,
                            master_port=free_port(), log_dir=f"{out}_logs")
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=launch_env())
    if r.returncode:
        raise SystemExit(f"{name}: ms-llm train failed:\n{r.stderr[-2000:]}")
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    times = [row["step_time_s"] for row in rows[1:]] or [rows[-1]["step_time_s"]]
    return {"name": name, "step_s": statistics.median(times),
            "step_range": (min(times), max(times)),
            "peak_gb": max(row["peak_rss_gb"] for row in rows) - rows[0]["rss_before_model_gb"],
            "loss": rows[-1]["loss"]}


def predict(overrides, nproc: int = 1, distopt=None) -> float:
    from ms_llm.config import load_config
    from ms_llm.planning.memory_plan import plan_memory
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), overrides)
    return plan_memory(cfg, nproc, distributed_optimizer=distopt).peak_gb


def has_distributed_optimizer() -> bool:
    from ms_llm.config import ParallelConfig
    return "use_distributed_optimizer" in ParallelConfig.__dataclass_fields__


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro", type=int, default=1)
    args = ap.parse_args()
    res = []
    with tempfile.TemporaryDirectory() as tmp:
        state_ov = _overrides(args, [], seq=16)
        state = measure("state only (seq 16)", state_ov, 2, tmp)
        state["pred"] = predict(state_ov)
        for name, extra in VARIANTS.items():
            ov = _overrides(args, extra)
            r = measure(f"recompute {name}", ov, args.steps, tmp)
            r["pred"] = predict(ov)
            res.append(r)
            print(f"{r['name']}: peak {r['peak_gb']:.2f} GB (plan {r['pred']:.2f}), "
                  f"step {r['step_s']:.2f} s", flush=True)
        distopt_rows = []
        if has_distributed_optimizer():
            for on in (False, True):
                ov = _overrides(args, ["--parallel.use_distributed_optimizer", str(on).lower()],
                                micro=args.micro) + ["--training.global_batch_size",
                                                     str(2 * args.micro)]
                r = measure(f"dp=2, distributed optimizer {'on' if on else 'off'}", ov,
                            args.steps, tmp, nproc=2)
                r["pred"] = predict(ov, nproc=2)
                distopt_rows.append(r)
    print(f"\n55M model (8 x 512, FFN 1408, vocab 32000), micro-batch {args.micro} x seq "
          f"{args.seq}, PyNative fp32, median of steps 2..{args.steps}; "
          f"peak = RSS high-water mark - RSS before model build\n")
    print(f"state only (seq 16): peak {state['peak_gb']:.2f} GB, plan {state['pred']:.2f} GB\n")
    base = res[0]
    base_act = base["peak_gb"] - state["peak_gb"]
    print("| recompute | peak GB | plan GB | plan/measured | activations GB | activations vs "
          "none | step s [min-max] | step vs none | final loss |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in res:
        act = r["peak_gb"] - state["peak_gb"]
        print(f"| {r['name']} | {r['peak_gb']:.2f} | {r['pred']:.2f} | "
              f"{r['pred'] / r['peak_gb']:.2f} | {act:.2f} | {act / base_act:.2f} | "
              f"{r['step_s']:.2f} [{r['step_range'][0]:.2f}-{r['step_range'][1]:.2f}] | "
              f"{r['step_s'] / base['step_s']:.2f} | {r['loss']:.6f} |")
    full = res[-1]
    cut = 1 - (full["peak_gb"] - state["peak_gb"]) / base_act
    print(f"\nfull recompute: activation memory -{100 * cut:.0f}% for "
          f"{100 * (full['step_s'] / base['step_s'] - 1):+.0f}% step time "
          f"(criterion: >= 60% less for <= 40% more)")
    if not distopt_rows:
        print("distributed optimizer rows skipped: parallel.use_distributed_optimizer is not in "
              "this tree's config schema (built on another branch); re-run after the merge")
    for r in distopt_rows:
        print(f"| {r['name']} | {r['peak_gb']:.2f} | {r['pred']:.2f} | "
              f"{r['pred'] / r['peak_gb']:.2f} | | | {r['step_s']:.2f} | | {r['loss']:.6f} |")


if __name__ == "__main__":
    main()
