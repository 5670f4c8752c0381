"""Mixture-of-experts training step, one process, fp32: ``ms-llm train`` vs transformers'
Qwen3-MoE with torch eager AdamW, same shapes, in one run (``python -m benchmarks.moe``).

Model (issue #31's MoE goal): 6 layers, hidden 512, 8 heads / 2 KV heads (head dim 64), every
layer a MoE MLP with 64 experts of FFN 256, top-8 (softmax, ``norm_topk_prob``), aux loss 0.001,
vocab 32000, seq 512, batch 2 (1024 tokens per step). Random token ids; AdamW lr 1e-3, clip 1.0.

Rows, each in a fresh subprocess, one after the other (never two at once):

* ``ms-llm train`` (``cli``): the console script end to end (PyNative; MoE runs there), step
  times from its ``metrics.jsonl``; the fused MoE kernels where they apply (CPU, fp32).
* ``ms-llm composed`` (``composed``): ``Trainer.train_step`` in process with the MoE layers on
  the composed ops (``ms_llm.ops.moe.composed_only`` and the per-expert ``loop`` matmuls): the
  path before the fused kernels, for the size of the change.
* ``transformers`` (``torch``): ``Qwen3MoeForCausalLM`` (the experts implementation
  transformers picks by default, printed) with ``output_router_logits`` (its aux loss),
  ``torch.optim.AdamW`` and ``clip_grad_norm_``; ``torch_eager`` (only with ``--variants``):
  the same with ``experts_implementation="eager"`` (transformers' per-expert loop).

Median step time after ``--warmup`` steps; tokens/s = 1024 / median; ratio = tokens/s over the
transformers default row's. Peak RSS per process. Figures on a shared machine are noisy: the CPU
and the load average are printed with them; compare ratios within one run.
"""
from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time

import numpy as np

from benchmarks.harness import ROOT, run_module

LAYERS, H, HEADS, KV, D, EXPERTS, TOPK, MOE_FFN = 6, 512, 8, 2, 64, 64, 8, 256
VOCAB, SEQ, BATCH = 32000, 512, 2
MODEL_OVERRIDES = [
    "--model.num_layers", str(LAYERS), "--model.hidden_size", str(H),
    "--model.num_attention_heads", str(HEADS), "--model.num_query_groups", str(KV),
    "--model.kv_channels", str(D), "--model.ffn_hidden_size", "1024",
    "--model.num_moe_experts", str(EXPERTS), "--model.moe_router_topk", str(TOPK),
    "--model.moe_ffn_hidden_size", str(MOE_FFN), "--model.moe_aux_loss_coeff", "0.001",
    "--model.padded_vocab_size", str(VOCAB),
    "--model.untie_embeddings_and_output_weights", "true",
    "--data.seq_length", str(SEQ), "--training.micro_batch_size", str(BATCH),
    "--training.global_batch_size", str(BATCH), "--training.progress_bar", "false",
    "--training.lr", "1e-3", "--training.lr_warmup_steps", "0", "--training.jit", "false"]
LABELS = {"cli": "ms-llm train (fused MoE kernels)",
          "composed": "ms-llm Trainer.train_step, composed MoE ops (before)",
          "torch": "transformers Qwen3-MoE, torch eager AdamW",
          "torch_eager": "transformers Qwen3-MoE, experts_implementation=eager"}


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 ** 2


def run_cli(steps: int, warmup: int) -> dict:
    out = f"/tmp/ms_llm_bench_moe_{os.getpid()}"
    cmd = [os.path.join(os.path.dirname(sys.executable), "ms-llm"), "train",
           os.path.join(ROOT, "configs", "tiny_moe.yaml"), *MODEL_OVERRIDES,
           "--training.max_steps", str(warmup + steps), "--training.log_interval", "1",
           "--training.output_dir", out]
    from benchmarks.harness import train_metrics
    rows = train_metrics(cmd, out)
    times = [row["step_time_s"] for row in rows]
    return {"times": times, "peak_rss_gb": rows[-1]["peak_rss_gb"]}


def run_composed(steps: int, warmup: int) -> dict:
    from ms_llm.compat import setup_device
    from ms_llm.config import load_config
    from ms_llm.models.moe import moe_layers
    from ms_llm.ops import moe as moe_ops
    from ms_llm.training.trainer import Trainer

    setup_device("CPU")
    cfg = load_config(os.path.join(ROOT, "configs", "tiny_moe.yaml"),
                      MODEL_OVERRIDES + ["--training.output_dir", "/tmp/ms_llm_bench_moe_c"])
    trainer = Trainer(cfg)
    for layer in moe_layers(trainer.model):
        layer.experts.gmm_impl = "loop"
    times = []
    with moe_ops.composed_only():
        for _ in range(warmup + steps):
            t0 = time.perf_counter()
            trainer.train_step()
            times.append(time.perf_counter() - t0)
    return {"times": times, "peak_rss_gb": peak_rss_gb()}


def run_torch(steps: int, warmup: int, experts_impl=None) -> dict:
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    kw = {} if experts_impl is None else {"experts_implementation": experts_impl}
    cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=H, intermediate_size=1024,
                         moe_intermediate_size=MOE_FFN, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=D,
                         num_experts=EXPERTS, num_experts_per_tok=TOPK, norm_topk_prob=True,
                         decoder_sparse_step=1, max_position_embeddings=SEQ,
                         tie_word_embeddings=False, output_router_logits=True,
                         router_aux_loss_coef=0.001)
    model = Qwen3MoeForCausalLM._from_config(cfg, torch_dtype=torch.float32, **kw)
    model.train()
    impl = getattr(model.config, "_experts_implementation", None) or "eager"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    times = []
    for step in range(warmup + steps):
        ids = torch.from_numpy(np.random.default_rng(step).integers(
            0, VOCAB, size=(BATCH, SEQ + 1)).astype(np.int64))
        t0 = time.perf_counter()
        loss = model(input_ids=ids[:, :-1], labels=ids[:, 1:]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    return {"times": times, "peak_rss_gb": peak_rss_gb(), "impl": impl,
            "threads": torch.get_num_threads()}


RUNNERS = {"cli": run_cli, "composed": run_composed, "torch": run_torch,
           "torch_eager": lambda s, w: run_torch(s, w, "eager")}


def child(variant: str, steps: int, warmup: int) -> None:
    print("RESULT " + json.dumps({"variant": variant, **RUNNERS[variant](steps, warmup)}),
          flush=True)


def main(argv=None) -> None:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--variants", default="cli,composed,torch",
                    help="also: torch_eager (transformers' per-expert loop)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args.child, args.steps, args.warmup)
    from benchmarks.harness import machine
    results = {}
    for v in args.variants.split(","):
        if v not in RUNNERS:
            raise SystemExit(f"benchmarks/moe.py: --variants: unknown {v!r} (one of "
                             f"{', '.join(RUNNERS)})")
        t0 = time.time()
        r = run_module("benchmarks.moe_train", "--child", v, "--steps", args.steps, "--warmup",
                       args.warmup, env=dict(os.environ, GLOG_v="3"))
        line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
        if r.returncode != 0 or not line:
            print(f"# {v} failed:\n{r.stdout[-1500:]}\n{r.stderr[-2500:]}", flush=True)
            continue
        results[v] = json.loads(line[-1][len("RESULT "):])
        results[v]["wall_s"] = time.time() - t0
        print(f"# {v} done in {results[v]['wall_s']:.0f} s; {machine()}", flush=True)
    print(f"\n# {machine()} (figures are noisy on a shared machine)")
    print(f"# MoE training step, one process, fp32: {LAYERS} layers, hidden {H}, {EXPERTS} "
          f"experts x FFN {MOE_FFN}, top-{TOPK}, vocab {VOCAB}, seq {SEQ}, batch {BATCH}; median "
          f"of {args.steps} steps after {args.warmup} warm-up")
    print("| variant | step s (median) | tokens/s | vs transformers | peak RSS GB |")
    print("|---|---|---|---|---|")
    tok = BATCH * SEQ
    base = results.get("torch")
    base_tps = tok / statistics.median(base["times"][args.warmup:]) if base else None
    for v, r in results.items():
        med = statistics.median(r["times"][args.warmup:])
        label = LABELS[v] + (f" ({r['impl']}, {r['threads']} threads)" if "impl" in r else "")
        ratio = f"{tok / med / base_tps:.2f}x" if base_tps else "-"
        print(f"| {label} | {med:.2f} | {tok / med:.0f} | {ratio} | {r['peak_rss_gb']:.1f} |")


if __name__ == "__main__":
    main()
