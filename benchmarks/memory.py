"""Qwen3-0.6B at seq 512, micro-batch 1, fp32, one process: peak RSS and tokens/s of ``ms-llm
train`` (PyNative) against transformers' Qwen3 with torch AdamW on the same shapes, with a
per-phase memory breakdown of each step and ``ms-llm plan``'s prediction beside the measurement.

Each side runs in a fresh process (peak RSS cannot be reset across frameworks inside one).
Inside a process the phases of a step are measured by resetting the kernel's RSS high-water mark
(``/proc/self/clear_refs``: VmHWM restarts from the current RSS) at each phase boundary:
forward+backward (the logits, the cross entropy, the gradients being formed), the gradient norm,
clipping + the optimizer update, and what remains of the step. "Peak" is VmHWM above the RSS just
before the model is built (ms-llm: ``rss_before_model_gb``; torch: after import, before the
model), the quantity ``ms-llm plan`` predicts; the absolute VmHWM is printed too. MindSpore's
own allocator statistics (``mindspore.runtime.memory_stats``) are all zero on CPU (PyNative
tensors are not pooled there), so RSS is the only measure on this backend.

The shared 2-core machine makes tokens/s noisy: the CPU model and load average are printed
with every figure; compare the two sides of one run only.

    python -m benchmarks.memory [--layers 28] [--seq 512] [--steps 4] [--sides ms_llm,torch]

``--layers 4`` is the proxy used while developing (the 151936 x 1024 embedding and output layer,
which dominate, at full size; ~4-8 GB per process instead of 13-17 GB).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from benchmarks.harness import ROOT, machine, run_module

GIB = 1024 ** 3
CONFIG = os.path.join(ROOT, "configs", "qwen3_0p6b.yaml")
PHASES = ("forward+backward", "grad norm", "clip+optimizer", "rest of step")


def _status(key: str) -> float:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024 / GIB
    return 0.0


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")


class Phases:
    """Per-phase VmHWM (GiB above ``base``) and the RSS at each phase's end, max over steps."""

    def __init__(self):
        self.base = 0.0
        self.peak = {p: 0.0 for p in PHASES}
        self.end = {p: 0.0 for p in PHASES}
        self.hwm = 0.0
        self.steps = []     # per step: {phase: peak GiB above base}

    def start(self) -> None:
        _reset_hwm()

    def close(self, phase: str) -> None:
        hwm = _status("VmHWM")
        self.hwm = max(self.hwm, hwm)
        if phase == PHASES[0]:
            self.steps.append({})
        self.steps[-1][phase] = round(hwm - self.base, 3)
        self.peak[phase] = max(self.peak[phase], hwm - self.base)
        self.end[phase] = max(self.end[phase], _status("VmRSS") - self.base)
        _reset_hwm()


def _ms_llm_overrides(args) -> list:
    return ["--model.num_layers", str(args.layers), "--data.seq_length", str(args.seq),
            "--training.micro_batch_size", "1", "--training.global_batch_size", "1",
            "--training.jit", "false", "--training.lr_warmup_steps", "0",
            *args.ms_llm_extra]


def worker_ms_llm(args) -> dict:
    import tempfile
    from ms_llm.compat import setup_device
    from ms_llm.compat.environment import configure
    from ms_llm.config import load_config
    from ms_llm.parallel.runtime import init_distributed
    from ms_llm.training.callbacks import TrainerCallback
    from ms_llm.planning.memory_plan import plan_memory
    from ms_llm.training.observability import apply_deterministic
    from ms_llm.training.trainer import Trainer

    phases = Phases()

    class PhaseMemory(TrainerCallback):
        def on_step_begin(self, step):
            phases.start()

        def on_grads(self, step, grads):
            phases.close("forward+backward")
            return grads

        def on_before_update(self, step):
            phases.close("grad norm")

        def on_update(self, step, skipped):
            phases.close("clip+optimizer")

        def on_step_end(self, step, out):
            phases.close("rest of step")

    out_dir = tempfile.mkdtemp(prefix="memory_bench_")
    cfg = load_config(CONFIG, _ms_llm_overrides(args) + [
        "--training.max_steps", str(args.steps), "--training.log_interval", "1",
        "--training.progress_bar", "false", "--training.output_dir", out_dir])
    configure(cfg.explicit_settings())
    setup_device("CPU")
    apply_deterministic(cfg.training.deterministic)
    trainer = Trainer(cfg, init_distributed(), callbacks=[PhaseMemory()])
    phases.base = trainer.rss_before_model_gb
    n = trainer.model.num_parameters()
    records = trainer.fit()
    times = [r["step_time_s"] for r in records[1:]] or [records[-1]["step_time_s"]]
    plan = plan_memory(cfg, 1)
    st = plan.worst
    return {"side": "ms_llm", "params": n, "base_gb": phases.base, "hwm_gb": phases.hwm,
            "peak": phases.peak, "end": phases.end, "steps": phases.steps,
            "tok_s": args.seq / statistics.median(times), "loss": records[-1]["loss"],
            "plan_gb": plan.peak_gb,
            "plan_terms": {k: getattr(st, k) / GIB for k in
                           ("params", "grads", "optimizer", "activations", "comm", "fixed")}}


def worker_torch(args) -> dict:
    import numpy as np
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    torch.manual_seed(0)
    phases = Phases()
    phases.base = _status("VmRSS")
    _reset_hwm()
    cfg = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                      num_hidden_layers=args.layers, num_attention_heads=16,
                      num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                      rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True)
    model = Qwen3ForCausalLM(cfg).float().train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)
    rng = np.random.default_rng(0)
    times, loss = [], None
    for _ in range(args.steps):
        ids = torch.from_numpy(rng.integers(0, 151936, (1, args.seq + 1)))
        t0 = time.perf_counter()
        phases.start()
        loss = _torch_loss(model, ids)
        loss.backward()
        phases.close("forward+backward")
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        phases.close("grad norm")
        opt.step()
        phases.close("clip+optimizer")
        opt.zero_grad(set_to_none=True)
        loss = float(loss)
        phases.close("rest of step")
        times.append(time.perf_counter() - t0)
    n = sum(p.numel() for p in model.parameters())
    return {"side": "torch", "params": n, "base_gb": phases.base, "hwm_gb": phases.hwm,
            "peak": phases.peak, "end": phases.end, "steps": phases.steps,
            "tok_s": args.seq / statistics.median(times[1:] or times), "loss": loss}


def _torch_loss(model, ids):
    import torch.nn.functional as F
    logits = model(input_ids=ids[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def run_side(side: str, args) -> dict:
    worker = ["--worker", side, "--layers", args.layers, "--seq", args.seq, "--steps", args.steps]
    if args.ms_llm_extra:
        worker += ["--ms-llm-extra", " ".join(args.ms_llm_extra)]
    t0 = time.time()
    r = run_module("benchmarks.memory", *worker, cwd=ROOT)
    if r.returncode:
        raise SystemExit(f"{side} worker failed:\n{r.stderr[-3000:]}")
    res = json.loads([line for line in r.stdout.splitlines() if line.startswith("{")][-1])
    res["wall_s"] = time.time() - t0
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--sides", default="ms_llm,torch")
    ap.add_argument("--ms-llm-extra", default="", help="extra ms-llm overrides, one string")
    ap.add_argument("--worker", choices=("ms_llm", "torch"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.ms_llm_extra = args.ms_llm_extra.split()
    if args.worker:
        fn = worker_ms_llm if args.worker == "ms_llm" else worker_torch
        print(json.dumps(fn(args)), flush=True)
        return
    print(f"machine: {machine()}", flush=True)
    res = {}
    for side in args.sides.split(","):
        res[side] = run_side(side, args)
        r = res[side]
        print(f"{side}: peak {max(r['peak'].values()):.2f} GiB above base "
              f"(VmHWM {r['hwm_gb']:.2f}), {r['tok_s']:.1f} tok/s, {r['wall_s']:.0f} s; "
              f"machine: {machine()}", flush=True)
    sides = list(res)
    n = res[sides[0]]["params"]
    for s in sides:
        print(f"{s} per step: {res[s]['steps']}")
    print(f"\nQwen3 shape, {args.layers} layers ({n / 1e6:.1f} M parameters, "
          f"{n * 4 / GIB:.2f} GiB fp32 each copy), seq {args.seq}, micro-batch 1, fp32, "
          f"median of steps 2..{args.steps}\n")
    print("| phase (peak GiB above base / RSS at its end) | " +
          " | ".join(sides) + " |")
    print("|---|" + "---|" * len(sides))
    for p in PHASES:
        print(f"| {p} | " + " | ".join(f"{res[s]['peak'][p]:.2f} / {res[s]['end'][p]:.2f}"
                                       for s in sides) + " |")
    print("| **peak** | " + " | ".join(f"**{max(res[s]['peak'].values()):.2f}**"
                                       for s in sides) + " |")
    print("| VmHWM (absolute) | " + " | ".join(f"{res[s]['hwm_gb']:.2f}" for s in sides) + " |")
    print("| tokens/s | " + " | ".join(f"{res[s]['tok_s']:.1f}" for s in sides) + " |")
    if "ms_llm" in res:
        r = res["ms_llm"]
        terms = ", ".join(f"{k} {v:.2f}" for k, v in r["plan_terms"].items())
        peak = max(r["peak"].values())
        print(f"\nms-llm plan: {r['plan_gb']:.2f} GiB ({terms}); plan/measured "
              f"{r['plan_gb'] / peak:.2f}")
    if len(sides) == 2:
        a, b = (res[s] for s in sides)
        print(f"{sides[0]}/{sides[1]}: peak {max(a['peak'].values()) / max(b['peak'].values()):.2f}x"
              f", VmHWM {a['hwm_gb'] / b['hwm_gb']:.2f}x, tokens/s {a['tok_s'] / b['tok_s']:.2f}x")
    print(f"machine: {machine()}")


if __name__ == "__main__":
    main()
