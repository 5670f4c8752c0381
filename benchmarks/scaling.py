"""Two workers against one process, layout by layout, through ``scripts/pretrain.sh``.

    python -m benchmarks.scaling                      # every row (long: ~40 min on 2 cores)
    python -m benchmarks.scaling --rows pp,pp_gpipe,pp_zbh1 --steps 6
    python -m benchmarks.scaling --rows dp --small    # the tests' tiny model, a quick check
    python -m benchmarks.scaling --rows fsdp,fsdp_mccl  # shared memory against mccl

Every row trains the ~55M Llama-style model (hidden 512, 8 layers, GQA 8/2, FFN 1408, vocab
32000, untied), fp32, PyNative (pipeline, FSDP and context parallel run PyNative; the baselines
too), once with ``NPROC=2`` and the row's layout, and once as one process at the same sequence
length, micro-batch and global batch (one baseline per shape, shared by the rows that use it).
The figure is the ratio of tokens/s (median of the logged steps after ``--skip``; rank 0's
``metrics.jsonl``). Data-parallel rows run at seq 128 (micro-batch 4, global batch 8), the
model-parallel rows at seq 1024 (micro-batch 1, global batch 4: four pipeline micro-batches).

Pipeline rows print the analytic bubble next to the ratio: (p-1)/(m+p-1) for 1F1B and GPipe,
(p-1)/(3m+p-1) for ZB-H1 at equal F, B and W times. With two workers on two cores a pipeline
rank's idle time lets the other rank's kernels use both cores, so the measured loss is smaller.

Torch peers (``--torch``): DDP and FSDP2 (``fully_shard``) over gloo on transformers'
``LlamaForCausalLM`` of the same shapes, 2 torchrun workers against one torch process (2
threads; a worker gets 1), next to the dp and FSDP rows. Figures on this shared machine are
noisy (other sessions load the cores): the CPU and load average are printed with each table.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from ms_llm.config import merge_overrides

from benchmarks.harness import ROOT, TINY_MODEL, free_port, machine, model_55m, module_env

MODEL = model_55m()
COMMON = ["--training.jit", "false", "--training.progress_bar", "false",
          "--training.log_interval", "1", "--training.lr_warmup_steps", "1"]
SHORT = {"seq": 128, "micro": 4, "global": 8}
LONG = {"seq": 1024, "micro": 1, "global": 4}
# The 55M model with every MLP a MoE layer (8 experts of FFN 704, top-2, grouped GEMM): the
# expert-parallel row and its own one-process baseline.
MOE = dict(SHORT, model=["--model.mlp_type", "moe", "--model.num_moe_experts", "8",
                         "--model.moe_router_topk", "2", "--model.moe_ffn_hidden_size", "704",
                         "--model.moe_grouped_gemm", "true"])
PP2 = ["--parallel.pipeline_model_parallel_size", "2"]
# name -> (label, overrides for 2 workers, shape, torch peer,
#          (pp, m, schedules_method, virtual pipeline size) or None)
ROWS = {
    "dp": ("data parallel", [], SHORT, "ddp", None),
    "distopt": ("distributed optimizer", ["--parallel.use_distributed_optimizer", "true"],
                SHORT, None, None),
    "fsdp": ("FSDP", ["--parallel.fsdp_size", "2"], SHORT, "fsdp2", None),
    "tp_sp": ("tensor + sequence parallel", ["--parallel.tensor_model_parallel_size", "2",
                                             "--parallel.sequence_parallel", "true"],
              LONG, None, None),
    "tp_sp_overlap": ("tensor + sequence parallel, comm overlap",
                      ["--parallel.tensor_model_parallel_size", "2",
                       "--parallel.sequence_parallel", "true", "--parallel.tp_comm_overlap", "true"],
                      LONG, None, None),
    "pp": ("pipeline, 1F1B", PP2, LONG, None, (2, 4, None, 1)),
    "pp_gpipe": ("pipeline, GPipe (no forward re-run)",
                 PP2 + ["--parallel.schedules_method", "gpipe"], LONG, None, (2, 4, "gpipe", 1)),
    "pp_zbh1": ("pipeline, zero bubble (ZB-H1)", PP2 + ["--parallel.schedules_method", "zbh1"],
                LONG, None, (2, 4, "zbh1", 1)),
    # Stages balanced by layer count (MindSpeed's --num-layer-list): the last stage also runs
    # the 32000-wide output layer and the loss (~1.3 layers' time at seq 1024), and the first
    # stage re-runs the forward of every other micro-batch (MindSpore's last-in first-out
    # pending backward), at 1F1B's and ZB-H1's own best split on Zen 4.
    "pp_balanced": ("pipeline, 1F1B, 5/8 of the layers first",
                    PP2 + ["--parallel.num_layer_list", 5 / 8], LONG, None, (2, 4, None, 1)),
    "pp_zbh1_balanced": ("pipeline, ZB-H1, 6/8 of the layers first",
                         PP2 + ["--parallel.schedules_method", "zbh1",
                                "--parallel.num_layer_list", 6 / 8], LONG, None, (2, 4, "zbh1", 1)),
    "pp_dualpipev": ("pipeline, DualPipe-V (4 stages in a V)",
                     PP2 + ["--parallel.virtual_pipeline_model_parallel_size", "2",
                            "--parallel.schedules_method", "dualpipev"], LONG, None,
                     (2, 4, "dualpipev", 2)),
    "cp_ring": ("context parallel, ring", ["--parallel.context_parallel_size", "2",
                                           "--parallel.context_parallel_algo", "megatron_cp_algo"],
                LONG, None, None),
    "ep": ("expert parallel (MoE 8 experts top-2, ep 2 x dp 2)",
           ["--parallel.expert_model_parallel_size", "2"], MOE, None, None),
}
# The same layouts over MindSpore's own CPU collectives (mccl) instead of the shared-memory
# channel: what the channel is worth, side by side ("<row>_mccl").
MCCL = ["--runtime.shm_collectives", "false"]
ROWS.update({f"{name}_mccl": (f"{label}, mccl collectives", extra + MCCL, shape, None, pipe)
             for name, (label, extra, shape, _, pipe) in list(ROWS.items())})


def analytic_bubble(pp: int, m: int, method, vpp: int) -> float:
    """Idle share of a balanced pipeline, from the schedule simulator at unit cost per action
    (per chunk): exactly the analytic (p-1)/(m+p-1) of 1F1B and GPipe and (p-1)/(3m+p-1) of
    ZB-H1 at F = B = W (``tests/parallel/test_pipeline_schedules.py``)."""
    from ms_llm.parallel.pipeline.schedules import bubble_fraction, get_schedule, plan_rounds
    spec = get_schedule(method, vpp)
    return bubble_fraction(plan_rounds(spec.build(pp, m, vpp), pp, vpp,
                                       placement=spec.placement))


def base_key(shape: dict) -> tuple:
    """Rows of one shape (sequence and model) share their one-process baseline run."""
    return shape["seq"], tuple(shape.get("model", ()))


def shape_args(shape: dict, a) -> list:
    """The model and batch of a row's shape (``--layers`` and ``--seq-long`` scale it down)."""
    model = TINY_MODEL if a.small else MODEL + ["--model.num_layers", str(a.layers)]
    seq = 32 if a.small else (a.seq_long if shape is LONG else shape["seq"])
    return model + shape.get("model", []) + COMMON + ["--data.seq_length", str(seq),
                             "--training.micro_batch_size", str(shape["micro"]),
                             "--training.global_batch_size", str(shape["global"])]


def layer_split(extra: list, layers: int) -> list:
    """A row's overrides with a float ``--parallel.num_layer_list`` (the first stage's share of
    the layers) turned into the two stages' layer counts for ``layers``."""
    out = []
    for word in extra:
        if isinstance(word, float):
            first = min(layers - 1, max(1, round(word * layers)))
            word = f"{first},{layers - first}"
        out.append(word)
    return out


def run_pretrain(tmp: str, tag: str, nproc: int, args: list, steps: int) -> list:
    """``scripts/pretrain.sh`` with ``nproc`` workers; returns rank 0's logged records."""
    out = os.path.join(tmp, tag)
    env = dict(os.environ, NPROC=str(nproc), MASTER_PORT=str(free_port()),
               LOG_DIR=os.path.join(out, "logs"), CLUSTER_TIME_OUT="300")
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    t0 = time.time()
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "pretrain.sh"),
                        os.path.join(ROOT, "configs", "tiny.yaml"),
                        *merge_overrides(args, ["--training.max_steps", str(steps),
                                                "--training.lr_decay_steps", str(steps),
                                                "--training.output_dir", out])],
                       capture_output=True, text=True, env=env, cwd=tmp)
    if r.returncode:
        sys.exit(f"{tag} failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
    path = os.path.join(out, "metrics.jsonl")
    recs = [json.loads(line) for line in open(path)]
    print(f"  {tag}: {nproc} worker(s), {time.time() - t0:.0f} s", file=sys.stderr)
    return recs


def tokens_per_s(recs: list, skip: int) -> float:
    kept = [r["tokens_per_s"] for r in recs if r["step"] > skip] or [recs[-1]["tokens_per_s"]]
    return statistics.median(kept)


# ----------------------------------------------------------------------------- torch peers

def torch_worker(a) -> None:
    """One torch process (``--layout single``) or a torchrun worker (ddp / fsdp2): the same
    model and batch shapes, AdamW, ``a.steps`` steps; rank 0 writes tokens/s per step."""
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, 2 // world))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    torch.manual_seed(0)
    small = a.small
    cfg = LlamaConfig(hidden_size=64 if small else 512, intermediate_size=128 if small else 1408,
                      num_hidden_layers=2 if small else 8, num_attention_heads=4 if small else 8,
                      num_key_value_heads=2, vocab_size=4096 if small else 32000,
                      tie_word_embeddings=False, max_position_embeddings=max(a.seq, 128))
    model = LlamaForCausalLM(cfg)
    if a.layout == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif a.layout == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    n_micro = a.global_batch // (a.micro * world)
    gen = torch.Generator().manual_seed(rank)
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        for i in range(n_micro):
            ids = torch.randint(0, cfg.vocab_size, (a.micro, a.seq), generator=gen)
            last = i == n_micro - 1
            if a.layout == "fsdp2":
                model.set_requires_gradient_sync(last)
            ctx = model.no_sync() if a.layout == "ddp" and not last else _null()
            with ctx:
                (model(input_ids=ids, labels=ids).loss / n_micro).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump([a.global_batch * a.seq / t for t in times], f)
    if world > 1:
        dist.destroy_process_group()


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def run_torch(tmp: str, layout: str, shape: dict, a) -> float:
    out = os.path.join(tmp, f"torch_{layout}_{shape['seq']}.json")
    seq = 32 if a.small else shape["seq"]     # (torch peers: the data-parallel rows only)
    args = [os.path.abspath(__file__), "--torch-worker", "--layout", layout, "--seq", str(seq),
            "--micro", str(shape["micro"]), "--global-batch", str(shape["global"]),
            "--steps", str(a.steps), "--out", out] + (["--small"] if a.small else [])
    if layout == "single":
        cmd = [sys.executable, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", "2", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp, env=module_env())
    if r.returncode:
        sys.exit(f"torch {layout} failed:\n{r.stderr[-3000:]}")
    rates = json.load(open(out))
    return statistics.median(rates[a.skip:] or rates[-1:])


# ----------------------------------------------------------------------------- main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma list of {', '.join(ROWS)}")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--skip", type=int, default=2, help="first steps left out of the median")
    ap.add_argument("--torch", action="store_true", help="torch DDP / FSDP2 peers (gloo)")
    ap.add_argument("--small", action="store_true", help="the tests' tiny model (a smoke run)")
    ap.add_argument("--layers", type=int, default=8, help="decoder layers of the 55M model")
    ap.add_argument("--seq-long", type=int, default=1024, help="seq of the model-parallel rows")
    ap.add_argument("--torch-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--layout", help=argparse.SUPPRESS)
    ap.add_argument("--seq", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--micro", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--global-batch", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.torch_worker:
        return torch_worker(a)
    rows = [r.strip() for r in a.rows.split(",") if r.strip()]
    bad = [r for r in rows if r not in ROWS]
    if bad:
        sys.exit(f"scaling.py: --rows {','.join(bad)} unknown; choose from {', '.join(ROWS)}")
    print(f"machine before: {machine()}")
    results, bases, peers = {}, {}, {}
    with tempfile.TemporaryDirectory(prefix="scaling_", dir=os.environ.get("TMPDIR")) as tmp:
        for name in rows:
            label, extra, shape, peer, pipe = ROWS[name]
            key = base_key(shape)
            if key not in bases:
                tag = f"one_{shape['seq']}" + ("_moe" if shape.get("model") else "")
                recs = run_pretrain(tmp, tag, 1, shape_args(shape, a), a.steps)
                bases[key] = tokens_per_s(recs, a.skip)
            layers = 2 if a.small else a.layers
            recs = run_pretrain(tmp, name, 2, shape_args(shape, a) + layer_split(extra, layers),
                                a.steps)
            results[name] = tokens_per_s(recs, a.skip)
            if a.torch and peer:
                if ("single", key) not in peers:
                    peers[("single", key)] = run_torch(tmp, "single", shape, a)
                peers[(peer, key)] = run_torch(tmp, peer, shape, a)
    what = " (tiny model)" if a.small else f", 55M Llama at {a.layers} layers"
    print(f"\nms-llm, 2 workers vs one process, {a.steps} steps (median of steps > {a.skip}), "
          f"fp32 PyNative{what}, model-parallel rows at seq {a.seq_long}; {machine()}")
    print("| layout | seq | 1 process tok/s | 2 workers tok/s | ratio | analytic bubble | "
          "torch peer ratio |")
    print("|---|---|---|---|---|---|---|")
    for name in rows:
        label, _, shape, peer, pipe = ROWS[name]
        key = base_key(shape)
        bubble = f"{analytic_bubble(*pipe):.3f}" if pipe else "-"
        tp = "-"
        if peer and (peer, key) in peers:
            tp = f"{peer}: {peers[(peer, key)] / peers[('single', key)]:.2f} " \
                 f"({peers[(peer, key)]:.0f} / {peers[('single', key)]:.0f} tok/s)"
        key_seq = a.seq_long if shape is LONG and not a.small else shape["seq"]
        print(f"| {label} | {key_seq} | {bases[key]:.0f} | {results[name]:.0f} | "
              f"{results[name] / bases[key]:.2f} | {bubble} | {tp} |")


if __name__ == "__main__":
    main()
