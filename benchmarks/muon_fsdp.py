"""ms-llm FSDP + Muon against torch FSDP2 (``fully_shard``, gloo) + ``torch.optim.Muon``, 2
workers on this CPU, same model shapes (the ~55M Llama-style model of ``benchmarks/muon.py``),
tokens/s side by side in one run (the issue's goal: >= 1.0x; HyperParallel claims 3x on Ascend).

Both sides: 8 layers, hidden 512, fused QKV (8 heads, 2 query groups, d 64), SwiGLU FFN 1408,
untied 32000 vocabulary, micro-batch ``--mbs`` of ``--seq`` tokens per worker, Muon (lr 0.02,
momentum 0.95, 5 Newton-Schulz steps) on the hidden matrices and AdamW on the rest, every layer
and the root sharded. Differences, stated: torch's model has no RoPE and runs its Newton-Schulz
in bf16 (``torch.optim.Muon``'s choice), ms-llm's in fp32; ms-llm splits QKV into Q/K/V
matrices. The median step time after one warm-up step is reported per side; the jobs alternate
(``--repeat``) so load from other sessions hits both.

``python -m benchmarks.muon_fsdp [--steps 4] [--seq 256] [--mbs 1] [--repeat 1] [--small]``
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from benchmarks.harness import ROOT, free_port, launch, machine

SHAPE = dict(layers=8, hidden=512, ffn=1408, heads=8, groups=2, d=64, vocab=32000)
LABEL = {"highest": "fp32 (default)", "medium": "bf16 operands (muon_fp32_matmul_prec medium)"}
SMALL = dict(layers=2, hidden=64, ffn=128, heads=4, groups=2, d=16, vocab=4096)


def ms_args(shape: dict, seq: int, mbs: int) -> list:
    return ["--model.num_layers", str(shape["layers"]), "--model.hidden_size",
            str(shape["hidden"]), "--model.ffn_hidden_size", str(shape["ffn"]),
            "--model.num_attention_heads", str(shape["heads"]), "--model.num_query_groups",
            str(shape["groups"]), "--model.kv_channels", str(shape["d"]),
            "--model.padded_vocab_size", str(shape["vocab"]),
            "--model.untie_embeddings_and_output_weights", "true", "--model.qk_layernorm",
            "false", "--data.seq_length", str(seq), "--training.micro_batch_size", str(mbs),
            "--training.global_batch_size", str(2 * mbs), "--training.jit", "false",
            "--training.progress_bar", "false", "--training.optimizer", "muon",
            "--training.lr", "0.02", "--parallel.fsdp_size", "2",
            "--training.output_dir", "/tmp/ms_llm_bench_muon_fsdp"]


def ms_worker(out: str, steps: int, args: list) -> None:
    from ms_llm.compat import setup_device
    setup_device("CPU")
    from ms_llm.config import load_config
    from ms_llm.parallel.runtime import init_distributed
    from ms_llm.training.trainer import Trainer
    info = init_distributed()
    tr = Trainer(load_config(os.path.join(ROOT, "configs", "tiny.yaml"),
                             args + ["--training.timing_log_level", "2"]), info)
    muon = getattr(tr.optimizer, "inner", tr.optimizer)
    muon.timings = {}
    tr.callbacks.on_train_begin(tr)        # level 2: the forward hooks of forward-compute
    times, phases = [], []
    for _ in range(steps):
        muon.timings.clear()
        t0 = time.perf_counter()
        tr.train_step()
        times.append(time.perf_counter() - t0)
        ms = dict(zip(tr.timers.names(), tr.timers.read_ms() / 1e3))
        phases.append({"forward": ms["forward-compute"], "backward": ms["backward-compute"],
                       "grad reduce-scatter": ms["grads-reduce-scatter"]
                       + ms["grads-all-reduce"],
                       "norm + clip": ms["optimizer"] - sum(muon.timings.values()),
                       **{f"muon {k}": v for k, v in muon.timings.items()}})
    tr.callbacks.on_train_end()
    if info.rank == 0:
        with open(out, "w") as f:
            json.dump({"step_s": statistics.median(times[1:] or times),
                       "phases": median_phases(phases)}, f)


def median_phases(phases: list) -> dict:
    """Each phase's median over the steps after the first (warm-up)."""
    timed = phases[1:] or phases
    return {k: statistics.median(p.get(k, 0.0) for p in timed) for k in timed[0]}


def torch_worker(rank: int, port: int, out: str, steps: int, shape: dict, seq: int,
                 mbs: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.fsdp import fully_shard
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    h, d, nh, ng = shape["hidden"], shape["d"], shape["heads"], shape["groups"]

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.n1, self.n2 = nn.RMSNorm(h), nn.RMSNorm(h)
            self.qkv = nn.Linear(h, (nh + 2 * ng) * d, bias=False)
            self.proj = nn.Linear(nh * d, h, bias=False)
            self.fc1 = nn.Linear(h, 2 * shape["ffn"], bias=False)
            self.fc2 = nn.Linear(shape["ffn"], h, bias=False)

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = self.qkv(self.n1(x)).split([nh * d, ng * d, ng * d], -1)
            q = q.view(b, s, nh, d).transpose(1, 2)
            k = k.view(b, s, ng, d).transpose(1, 2).repeat_interleave(nh // ng, 1)
            v = v.view(b, s, ng, d).transpose(1, 2).repeat_interleave(nh // ng, 1)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, s, nh * d))
            g, u = self.fc1(self.n2(x)).chunk(2, -1)
            return x + self.fc2(F.silu(g) * u)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(shape["vocab"], h)
            self.layers = nn.ModuleList(Layer() for _ in range(shape["layers"]))
            self.norm, self.out = nn.RMSNorm(h), nn.Linear(h, shape["vocab"], bias=False)

        def forward(self, t):
            x = self.emb(t)
            for layer in self.layers:
                x = layer(x)
            return self.out(self.norm(x))

    model = Model()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    hidden = [p for n, p in model.named_parameters() if p.ndim == 2 and "layers." in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim == 2 and "layers." in n)]
    opts = [torch.optim.Muon(hidden, lr=0.02, momentum=0.95, weight_decay=0.1),
            torch.optim.AdamW(rest, lr=0.02, betas=(0.9, 0.95), weight_decay=0.1)]
    gen = torch.Generator().manual_seed(rank)
    times, phases = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        tokens = torch.randint(0, shape["vocab"], (mbs, seq + 1), generator=gen)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, shape["vocab"]), tokens[:, 1:].reshape(-1))
        t1 = time.perf_counter()
        loss.backward()     # FSDP2's reduce-scatter runs inside
        t2 = time.perf_counter()
        opts[0].step()
        t3 = time.perf_counter()
        opts[1].step()
        for o in opts:
            o.zero_grad()
        times.append(time.perf_counter() - t0)
        phases.append({"forward": t1 - t0, "backward": t2 - t1, "muon step": t3 - t2,
                       "adamw": time.perf_counter() - t3})
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"step_s": statistics.median(times[1:] or times),
                       "phases": median_phases(phases)}, f)
    dist.destroy_process_group()


def run_ms(steps: int, args: list) -> float:
    out = "/tmp/ms_llm_bench_muon_fsdp_ms.json"
    r = launch(os.path.abspath(__file__), 2, "/tmp/ms_llm_bench_muon_logs",
               ["--as-worker", out, "--steps", str(steps), "--", *args], cluster_time_out=600)
    if not r.ok or not os.path.isfile(out):
        raise SystemExit(f"ms-llm job failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    with open(out) as f:
        return json.load(f)


def run_torch(steps: int, shape: dict, seq: int, mbs: int) -> float:
    import torch.multiprocessing as mp
    out = "/tmp/ms_llm_bench_muon_fsdp_torch.json"
    mp.spawn(torch_worker, args=(free_port(), out, steps, shape, seq, mbs), nprocs=2)
    with open(out) as f:
        return json.load(f)


def median_run(runs: list) -> dict:
    """The run whose step time is the median (the lower middle one of an even count)."""
    return sorted(runs, key=lambda r: r["step_s"])[(len(runs) - 1) // 2]


def print_phases(side: str, phases: dict) -> None:
    print(f"{side}: " + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--mbs", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--small", action="store_true", help="a 2-layer model: checks the script")
    ap.add_argument("--precisions", default="highest,medium",
                    help="ms-llm runs: training.muon_fp32_matmul_prec values, comma-separated")
    ap.add_argument("--as-worker", nargs=1)
    a, rest = ap.parse_known_args(argv)
    if a.as_worker:
        ms_worker(a.as_worker[0], a.steps, [x for x in rest if x != "--"])
        return 0
    shape = SMALL if a.small else SHAPE
    tokens = 2 * a.mbs * a.seq
    precs = a.precisions.split(",")
    # peer, ours (each precision), peer, ...: load from other processes hits both sides alike
    th, ms = [run_torch(a.steps, shape, a.seq, a.mbs)], {p: [] for p in precs}
    for _ in range(a.repeat):
        for p in precs:
            ms[p].append(run_ms(a.steps, ms_args(shape, a.seq, a.mbs)
                                + ["--training.muon_fp32_matmul_prec", p]))
        th.append(run_torch(a.steps, shape, a.seq, a.mbs))
    t = statistics.median(r["step_s"] for r in th)
    print(f"# FSDP (2 workers) + Muon, {shape}, seq {a.seq} x mbs {a.mbs} per worker; {machine()}")
    print("| | step (s, median) | tokens/s | vs torch |")
    print("|---|---|---|---|")
    for p in precs:
        m = statistics.median(r["step_s"] for r in ms[p])
        print(f"| ms-llm FSDP + Muon, Newton-Schulz {LABEL[p]} | {m:.2f} | {tokens / m:.0f} | "
              f"{t / m:.2f}x |")
    print(f"| torch FSDP2 + torch.optim.Muon (bf16 Newton-Schulz) | {t:.2f} | {tokens / t:.0f} "
          f"| 1.00x |")
    print("runs in order: torch " + ", ".join(f"{r['step_s']:.2f}" for r in th) + "; "
          + "; ".join(f"ms-llm {p} " + ", ".join(f"{r['step_s']:.2f}" for r in ms[p])
                      for p in precs) + " s")
    print("\nWhere rank 0's step goes (s, median over the timed steps of the median run):")
    for p in precs:
        print_phases(f"ms-llm {p}", median_run(ms[p])["phases"])
    print_phases("torch", median_run(th)["phases"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
