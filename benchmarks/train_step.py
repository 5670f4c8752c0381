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

Usage: ``python benchmarks/train_step.py [--steps 6] [--warmup 2] [--variants a,b]``
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import numpy as np

H, LAYERS, HEADS, KV, FFN, VOCAB, SEQ, BATCH = 512, 8, 8, 2, 1408, 32000, 512, 4
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 ** 2


def batch(step: int):
    rng = np.random.default_rng(step)
    ids = rng.integers(0, VOCAB, size=(BATCH, SEQ + 1)).astype(np.int32)
    return ids[:, :-1], ids[:, 1:]


# ----------------------------------------------------------------------------- ms_llm
def run_ms_llm(steps: int, warmup: int, jit: bool) -> list:
    from ms_llm.compat import setup_device
    from ms_llm.config import load_config
    from ms_llm.training.trainer import Trainer

    setup_device("CPU")
    overrides = ["--model.num_layers", str(LAYERS), "--model.hidden_size", str(H),
                 "--model.ffn_hidden_size", str(FFN), "--model.num_attention_heads", str(HEADS),
                 "--model.num_query_groups", str(KV), "--model.kv_channels", str(H // HEADS),
                 "--model.padded_vocab_size", str(VOCAB), "--model.family", "llama",
                 "--model.qk_layernorm", "false", "--model.untie_embeddings_and_output_weights",
                 "true", "--data.seq_length", str(SEQ), "--training.micro_batch_size", str(BATCH),
                 "--training.global_batch_size", str(BATCH), "--training.progress_bar", "false",
                 "--training.jit", str(jit).lower(), "--training.output_dir", "/tmp/ms_llm_bench"]
    trainer = Trainer(load_config(os.path.join(ROOT, "configs", "tiny.yaml"), overrides))
    times = []
    for _ in range(warmup + steps):
        t0 = time.perf_counter()
        trainer.train_step()
        times.append(time.perf_counter() - t0)
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
        t0 = time.perf_counter()
        loss, grads = grad_fn(Tensor(ids), Tensor(labels), cos, sin, mask)
        grads = ops.clip_by_global_norm(grads, 1.0)
        opt(grads)
        loss.asnumpy()
        times.append(time.perf_counter() - t0)
    return times


# ----------------------------------------------------------------------------- torch
def run_torch(steps: int, warmup: int) -> list:
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
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
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    times = []
    for step in range(warmup + steps):
        ids, labels = batch(step)
        t0 = time.perf_counter()
        loss = model(torch.from_numpy(ids).long(), torch.from_numpy(labels).long(), cos, sin)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    return times


RUNNERS = {
    "ms_llm": lambda s, w: run_ms_llm(s, w, jit=False),
    "ms_llm_jit": lambda s, w: run_ms_llm(s, w, jit=True),
    "ms_plain": run_ms_plain,
    "torch": run_torch,
}


def child(variant: str, steps: int, warmup: int) -> None:
    base = peak_rss_gb()
    times = RUNNERS[variant](steps, warmup)
    timed = times[warmup:]
    med = statistics.median(timed)
    print(json.dumps({"variant": variant, "median_s": med, "first_s": times[0],
                      "tokens_per_s": BATCH * SEQ / med, "peak_rss_gb": peak_rss_gb(),
                      "import_rss_gb": base, "steps": len(timed)}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--variants", default="ms_llm,ms_llm_jit,ms_plain,torch")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.steps, args.warmup)
        return
    results = []
    for v in args.variants.split(","):
        if v == "torch":
            try:
                import torch  # noqa: F401
            except ImportError:
                print("torch not installed: skipping the torch row (pip install -e .[bench])")
                continue
        r = subprocess.run([sys.executable, __file__, "--child", v, "--steps", str(args.steps),
                            "--warmup", str(args.warmup)], capture_output=True, text=True,
                           env=dict(os.environ, GLOG_v="3"))
        lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
        if r.returncode != 0 or not lines:
            print(f"{v}: failed\n{r.stderr[-2000:]}")
            continue
        results.append(json.loads(lines[-1]))
    floor = next((r for r in results if r["variant"] == "ms_plain"), None)
    torch_row = next((r for r in results if r["variant"] == "torch"), None)
    print(f"\nmodel: hidden {H}, {LAYERS} layers, {HEADS} heads / {KV} KV, FFN {FFN}, vocab {VOCAB},"
          f" seq {SEQ}, batch {BATCH}, fp32; median of {args.steps} steps after {args.warmup} warm-up")
    print(f"{'variant':<12} {'step (s)':>9} {'first (s)':>9} {'tokens/s':>9} {'peak RSS GB':>12}"
          f" {'vs plain MS':>12} {'vs torch':>9}")
    for r in results:
        vs_floor = r["tokens_per_s"] / floor["tokens_per_s"] if floor else float("nan")
        vs_torch = r["tokens_per_s"] / torch_row["tokens_per_s"] if torch_row else float("nan")
        print(f"{r['variant']:<12} {r['median_s']:9.2f} {r['first_s']:9.2f} {r['tokens_per_s']:9.1f}"
              f" {r['peak_rss_gb']:12.2f} {vs_floor:12.2f} {vs_torch:9.2f}")


if __name__ == "__main__":
    main()
