"""Training-step throughput of a ~50M-parameter Llama-style model: ms_llm vs plain MindSpore.

Model: hidden 512, 8 layers, 8 heads / 2 KV heads, FFN 1408, vocab 32000, seq 512,
batch 4, fp32, AdamW. Each variant runs in a fresh subprocess (MindSpore's CPU memory pool never
shrinks, so peak RSS is only meaningful per process) and reports the median step time after
warm-up. Variants:

* ``ms_llm``        the real ``Trainer.train_step`` (PyNative) with the active op paths
* ``ms_llm_jit``    the same with ``training.jit=true`` (forward+backward compiled)
* ``ms_plain``      the same architecture written directly in MindSpore PyNative (mint ops,
                    ``ops.cross_entropy``, ``experimental.optim.AdamW``): the floor
* ``torch``         PyTorch eager fp32, if torch is installed (``pip install -e .[bench]``)
* ``torch_compile`` the same model through ``torch.compile`` (inductor, C++ on CPU; the
                    warm-up steps compile)
* ``torch_bf16``    the same under ``torch.autocast("cpu", torch.bfloat16)`` (fp32 weights and
                    optimizer, bf16 matmuls): PyTorch's mixed-precision recipe
* ``cli``           ``ms-llm train`` itself (subprocess through the console script, PyNative),
                    tokens/s read from its ``metrics.jsonl``: the end-to-end figure, with data
                    loading, logging and the loop's host work; ``cli_jit`` with ``training.jit``
* ``cli_bf16``      ``ms-llm train --training.bf16 true``, only when the config schema has that
                    key (mixed precision is another branch's work; "n/a" otherwise)
* ``*_fused``       ``ms_llm``, ``ms_llm_jit`` and ``cli`` with
                    ``--model.cross_entropy_loss_fusion true`` (output layer + cross entropy in
                    chunks of tokens, ``ms_llm.ops.fused_cross_entropy``); their peak RSS shows
                    the memory the whole logits took

Every row of one run is measured back to back on the same machine; on a shared machine compare
the ratios, not the absolute figures. MFU is against the peak fp32 GEMM rate of the kernel
ms-llm's linears use (``ms_llm.planning.peak``'s probe, measured in this run), model FLOPs per token from
``ms_llm.planning.flops`` (the same for every row: same model).

``ms_llm_bf16`` is the bf16 inner loop (``Trainer.train_step`` with ``--training.bf16 true``).
``--clock cpu``: process CPU time per step on one thread (see ``_now``), for a loaded machine.

Usage: ``python -m benchmarks.train_step [--steps 6] [--warmup 2] [--variants a,b] [--clock cpu]``
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

import numpy as np

H, LAYERS, HEADS, KV, FFN, VOCAB, SEQ, BATCH = 512, 8, 8, 2, 1408, 32000, 512, 4
from benchmarks.harness import ROOT, run_module  # noqa: E402

MODEL_OVERRIDES = [
    "--model.num_layers", str(LAYERS), "--model.hidden_size", str(H),
    "--model.ffn_hidden_size", str(FFN), "--model.num_attention_heads", str(HEADS),
    "--model.num_query_groups", str(KV), "--model.kv_channels", str(H // HEADS),
    "--model.padded_vocab_size", str(VOCAB), "--model.family", "llama",
    "--model.qk_layernorm", "false", "--model.untie_embeddings_and_output_weights", "true",
    "--data.seq_length", str(SEQ), "--training.micro_batch_size", str(BATCH),
    "--training.global_batch_size", str(BATCH), "--training.progress_bar", "false"]


def _now() -> float:
    """Wall clock, or with ``--clock cpu`` this process' CPU time (children run on one thread
    then: ``MS_LLM_BLAS_THREADS=1``, ``torch.set_num_threads(1)``), which the other processes of a
    loaded machine barely change; ``cli*`` variants always report the loop's wall clock."""
    return time.process_time() if os.environ.get("MS_LLM_BENCH_CLOCK") == "cpu" else time.perf_counter()


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 ** 2


def batch(step: int):
    rng = np.random.default_rng(step)
    ids = rng.integers(0, VOCAB, size=(BATCH, SEQ + 1)).astype(np.int32)
    return ids[:, :-1], ids[:, 1:]


# ----------------------------------------------------------------------------- ms_llm
FUSED = ["--model.cross_entropy_loss_fusion", "true"]


def run_ms_llm(steps: int, warmup: int, jit: bool, fused: bool = False, bf16: bool = False) -> list:
    from ms_llm.compat import setup_device
    from ms_llm.config import load_config
    from ms_llm.training.trainer import Trainer

    setup_device("CPU")
    overrides = MODEL_OVERRIDES + ["--training.jit", str(jit).lower(),
                                   "--training.output_dir", "/tmp/ms_llm_bench"] + \
        (FUSED if fused else []) + (["--training.bf16", "true"] if bf16 else [])
    trainer = Trainer(load_config(os.path.join(ROOT, "configs", "tiny.yaml"), overrides))
    times = []
    for _ in range(warmup + steps):
        t0 = _now()
        trainer.train_step()
        times.append(_now() - t0)
    return times


# ----------------------------------------------------------------------------- plain MindSpore
def run_ms_plain(steps: int, warmup: int) -> list:
    import mindspore as ms
    from mindspore import Parameter, Tensor, mint, nn, ops

    ms.set_device("CPU")
    ms.device_context.cpu.op_tuning.threads_num(1)
    rng = np.random.default_rng(0)
    d = H // HEADS

    def param(*shape, std=0.02, one=False):
        data = np.ones(shape, np.float32) if one else rng.normal(0, std, shape).astype(np.float32)
        return Parameter(Tensor(data))

    class Block(nn.Cell):
        def __init__(self):
            super().__init__()
            self.n1, self.n2 = param(H, one=True), param(H, one=True)
            self.wq, self.wk, self.wv = param(H, H), param(KV * d, H), param(KV * d, H)
            self.wo, self.wg, self.wu, self.wd = param(H, H), param(FFN, H), param(FFN, H), param(H, FFN)

        def construct(self, x, cos, sin, mask):
            b, s, _ = x.shape
            h = x * mint.rsqrt(mint.mean(x * x, -1, keepdim=True) + 1e-5) * self.n1
            q = mint.nn.functional.linear(h, self.wq).reshape(b, s, HEADS, d).swapaxes(1, 2)
            k = mint.nn.functional.linear(h, self.wk).reshape(b, s, KV, d).swapaxes(1, 2)
            v = mint.nn.functional.linear(h, self.wv).reshape(b, s, KV, d).swapaxes(1, 2)

            def rope(t):
                t1, t2 = mint.chunk(t, 2, -1)
                return t * cos + mint.cat([-t2, t1], -1) * sin
            q, k = rope(q), rope(k)
            k = ops.repeat_interleave(k, HEADS // KV, 1)
            v = ops.repeat_interleave(v, HEADS // KV, 1)
            a = mint.softmax(mint.matmul(q, k.swapaxes(-1, -2)) * (d ** -0.5) + mask, -1)
            x = x + mint.nn.functional.linear(mint.matmul(a, v).swapaxes(1, 2).reshape(b, s, H), self.wo)
            h = x * mint.rsqrt(mint.mean(x * x, -1, keepdim=True) + 1e-5) * self.n2
            g = mint.nn.functional.silu(mint.nn.functional.linear(h, self.wg))
            return x + mint.nn.functional.linear(g * mint.nn.functional.linear(h, self.wu), self.wd)

    class Model(nn.Cell):
        def __init__(self):
            super().__init__()
            self.emb = param(VOCAB, H)
            self.blocks = nn.CellList([Block() for _ in range(LAYERS)])
            self.norm, self.head = param(H, one=True), param(VOCAB, H)

        def construct(self, ids, labels, cos, sin, mask):
            x = ops.gather(self.emb, ids, 0)
            for blk in self.blocks:
                x = blk(x, cos, sin, mask)
            x = x * mint.rsqrt(mint.mean(x * x, -1, keepdim=True) + 1e-5) * self.norm
            logits = mint.nn.functional.linear(x, self.head)
            return ops.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))

    inv = 1.0 / (10000 ** (np.arange(0, d, 2) / d))
    ang = np.outer(np.arange(SEQ), inv)
    ang = np.concatenate([ang, ang], -1)
    cos, sin = Tensor(np.cos(ang).astype(np.float32)), Tensor(np.sin(ang).astype(np.float32))
    mask = Tensor(np.triu(np.full((SEQ, SEQ), -1e9, np.float32), 1))
    model = Model()
    params = model.trainable_params()
    opt = ms.experimental.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    grad_fn = ms.value_and_grad(model, None, params)
    times = []
    for step in range(warmup + steps):
        ids, labels = batch(step)
        t0 = _now()
        loss, grads = grad_fn(Tensor(ids), Tensor(labels), cos, sin, mask)
        grads = ops.clip_by_global_norm(grads, 1.0)
        opt(grads)
        loss.asnumpy()
        times.append(_now() - t0)
    return times


# ----------------------------------------------------------------------------- torch
def run_torch(steps: int, warmup: int, bf16: bool = False, compiled: bool = False) -> list:
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    if os.environ.get("MS_LLM_BENCH_CLOCK") == "cpu":
        torch.set_num_threads(1)
    d = H // HEADS

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.n1, self.n2 = torch.nn.RMSNorm(H, eps=1e-5), torch.nn.RMSNorm(H, eps=1e-5)
            self.qkv = torch.nn.Linear(H, H + 2 * KV * d, bias=False)
            self.o = torch.nn.Linear(H, H, bias=False)
            self.gu = torch.nn.Linear(H, 2 * FFN, bias=False)
            self.down = torch.nn.Linear(FFN, H, bias=False)

        def forward(self, x, cos, sin):
            b, s, _ = x.shape
            q, k, v = self.qkv(self.n1(x)).split([H, KV * d, KV * d], -1)
            q = q.view(b, s, HEADS, d).transpose(1, 2)
            k = k.view(b, s, KV, d).transpose(1, 2)
            v = v.view(b, s, KV, d).transpose(1, 2)

            def rope(t):
                t1, t2 = t.chunk(2, -1)
                return t * cos + torch.cat([-t2, t1], -1) * sin
            q, k = rope(q), rope(k)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + self.o(a.transpose(1, 2).reshape(b, s, H))
            g, u = self.gu(self.n2(x)).chunk(2, -1)
            return x + self.down(F.silu(g) * u)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(VOCAB, H)
            self.blocks = torch.nn.ModuleList([Block() for _ in range(LAYERS)])
            self.norm = torch.nn.RMSNorm(H, eps=1e-5)
            self.head = torch.nn.Linear(H, VOCAB, bias=False)

        def forward(self, ids, labels, cos, sin):
            x = self.emb(ids)
            for blk in self.blocks:
                x = blk(x, cos, sin)
            return F.cross_entropy(self.head(self.norm(x)).view(-1, VOCAB), labels.view(-1))

    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = torch.outer(torch.arange(SEQ, dtype=torch.float64), inv)
    ang = torch.cat([ang, ang], -1)
    cos, sin = ang.cos().float(), ang.sin().float()
    model = Model()
    fwd = torch.compile(model) if compiled else model   # inductor's C++ CPU backend; warm-up compiles
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    times = []
    for step in range(warmup + steps):
        ids, labels = batch(step)
        t0 = _now()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = fwd(torch.from_numpy(ids).long(), torch.from_numpy(labels).long(), cos, sin)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        times.append(_now() - t0)
    return times


# ----------------------------------------------------------------------------- ms-llm train
def bf16_key_exists() -> bool:
    """True when the config schema has ``training.bf16`` (added by the mixed-precision work)."""
    import dataclasses
    from ms_llm.config import TrainingConfig
    return any(f.name == "bf16" for f in dataclasses.fields(TrainingConfig))


def run_cli(steps: int, warmup: int, jit: bool, bf16: bool = False, fused: bool = False) -> dict:
    """``ms-llm train`` end to end; the step times are the loop's own (metrics.jsonl)."""
    out = f"/tmp/ms_llm_bench_cli_{os.getpid()}_{int(jit)}{int(bf16)}{int(fused)}"
    cmd = [os.path.join(os.path.dirname(sys.executable), "ms-llm"), "train",
           os.path.join(ROOT, "configs", "tiny.yaml"), *MODEL_OVERRIDES,
           "--training.max_steps", str(warmup + steps), "--training.log_interval", "1",
           "--training.lr_warmup_steps", "2", "--training.jit", str(jit).lower(),
           "--training.output_dir", out] + (["--training.bf16", "true"] if bf16 else []) + \
        (FUSED if fused else [])
    from benchmarks.harness import train_metrics
    rows = train_metrics(cmd, out)
    times = [row["step_time_s"] for row in rows]
    med = statistics.median(times[warmup:])
    return {"median_s": med, "first_s": times[0], "tokens_per_s": BATCH * SEQ / med,
            "peak_rss_gb": rows[-1]["peak_rss_gb"], "steps": len(times) - warmup,
            "mfu_logged": statistics.median(row.get("mfu", 0.0) for row in rows[warmup:])}


RUNNERS = {
    "ms_llm": lambda s, w: run_ms_llm(s, w, jit=False),
    "ms_llm_jit": lambda s, w: run_ms_llm(s, w, jit=True),
    "ms_llm_fused": lambda s, w: run_ms_llm(s, w, jit=False, fused=True),
    "ms_llm_jit_fused": lambda s, w: run_ms_llm(s, w, jit=True, fused=True),
    "ms_llm_bf16": lambda s, w: run_ms_llm(s, w, jit=False, bf16=True),
    "ms_plain": run_ms_plain,
    "torch": run_torch,
    "torch_bf16": lambda s, w: run_torch(s, w, bf16=True),
    "torch_compile": lambda s, w: run_torch(s, w, compiled=True),
}
CLI = {"cli": dict(jit=False), "cli_jit": dict(jit=True), "cli_bf16": dict(jit=False, bf16=True),
       "cli_fused": dict(jit=False, fused=True)}
LABELS = {"ms_llm": "ms-llm fp32 inner loop (Trainer.train_step)",
          "ms_llm_jit": "ms-llm fp32 inner loop, training.jit",
          "ms_llm_fused": "ms-llm fp32 inner loop, fused output+CE",
          "ms_llm_jit_fused": "ms-llm fp32 inner loop, jit, fused output+CE",
          "cli_fused": "ms-llm train fp32, fused output+CE (end to end)",
          "cli": "ms-llm train fp32 (end to end)",
          "cli_jit": "ms-llm train fp32, training.jit (end to end)",
          "cli_bf16": "ms-llm train --training.bf16 true",
          "ms_llm_bf16": "ms-llm bf16 inner loop (Trainer.train_step)",
          "ms_plain": "plain MindSpore PyNative fp32",
          "torch": "PyTorch eager fp32",
          "torch_bf16": "PyTorch eager bf16 autocast",
          "torch_compile": "PyTorch torch.compile fp32 (inductor)"}


def child(variant: str, steps: int, warmup: int) -> None:
    base = peak_rss_gb()
    if variant in CLI:
        print(json.dumps({"variant": variant, **run_cli(steps, warmup, **CLI[variant])}),
              flush=True)
        return
    times = RUNNERS[variant](steps, warmup)
    timed = times[warmup:]
    med = statistics.median(timed)
    print(json.dumps({"variant": variant, "median_s": med, "first_s": times[0],
                      "tokens_per_s": BATCH * SEQ / med, "peak_rss_gb": peak_rss_gb(),
                      "import_rss_gb": base, "steps": len(timed)}), flush=True)


def model_flops_and_peak() -> tuple:
    """(model FLOPs per token, peak fp32 TFLOP/s) for the MFU column: the trainer's GEMM probe,
    measured afresh in this run (not the cached figure, which may come from a busier moment)."""
    from ms_llm.compat import setup_device
    from ms_llm.models.config import TransformerConfig
    from ms_llm.planning.flops import flops_per_token
    from ms_llm.planning.peak import measure_cpu_peak
    setup_device("CPU")
    c = TransformerConfig(num_layers=LAYERS, hidden_size=H, ffn_hidden_size=FFN,
                          num_attention_heads=HEADS, num_query_groups=KV, kv_channels=H // HEADS,
                          padded_vocab_size=VOCAB)
    return flops_per_token(c, SEQ), measure_cpu_peak()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--variants", default="cli,cli_jit,ms_llm,ms_llm_jit,torch,torch_bf16,"
                                          "cli_bf16")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.clock == "cpu" and not args.child:
        os.environ.update(MS_LLM_BENCH_CLOCK="cpu", MS_LLM_BLAS_THREADS="1")
    if args.child:
        child(args.child, args.steps, args.warmup)
        return
    results, missing = [], {}
    for v in args.variants.split(","):
        if v.startswith("torch"):
            try:
                import torch  # noqa: F401
            except ImportError:
                missing[v] = "torch not installed (pip install -e .[bench])"
                continue
        if v == "cli_bf16" and not bf16_key_exists():
            missing[v] = "n/a: this tree's config has no training.bf16"
            continue
        r = run_module("benchmarks.train_step", "--child", v, "--steps", args.steps, "--warmup",
                       args.warmup, env=dict(os.environ, GLOG_v="3"))
        lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
        if r.returncode != 0 or not lines:
            print(f"{v}: failed\n{r.stderr[-2000:]}")
            missing[v] = "failed"
            continue
        results.append(json.loads(lines[-1]))
    flops_tok, peak = model_flops_and_peak()
    torch_row = next((r for r in results if r["variant"] == "torch"), None)
    print(f"\nmodel: hidden {H}, {LAYERS} layers, {HEADS} heads / {KV} KV, FFN {FFN}, vocab {VOCAB},"
          f" seq {SEQ}, batch {BATCH}; median of {args.steps} steps after {args.warmup} warm-up;"
          f" {flops_tok / 1e6:.1f} MFLOP/token; MFU vs {peak:.3f} TFLOP/s (fp32 GEMM probe)")
    print(f"| {'variant':<46} | {'step (s)':>8} | {'tokens/s':>8} | {'TFLOP/s':>7} | {'MFU':>6}"
          f" | {'peak RSS GB':>11} | {'vs torch fp32':>13} |")
    print(f"|{'-' * 48}|{'-' * 10}|{'-' * 10}|{'-' * 9}|{'-' * 8}|{'-' * 13}|{'-' * 15}|")
    for r in results:
        tf = r["tokens_per_s"] * flops_tok / 1e12
        vs_torch = r["tokens_per_s"] / torch_row["tokens_per_s"] if torch_row else float("nan")
        print(f"| {LABELS[r['variant']]:<46} | {r['median_s']:8.2f} | {r['tokens_per_s']:8.1f} |"
              f" {tf:7.3f} | {100 * tf / peak:5.1f}% | {r['peak_rss_gb']:11.2f} |"
              f" {vs_torch:12.2f}x |")
    for v, why in missing.items():
        print(f"| {LABELS.get(v, v):<46} | {why} |")


if __name__ == "__main__":
    main()
