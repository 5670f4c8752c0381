"""Pipeline parallel through the real Trainer: pp=1 against pp=2 1F1B and pp=2 x vpp=2 interleaved.

    python -m benchmarks.pipeline                 # default model and sizes, ~6 min on 2 cores
    python -m benchmarks.pipeline --steps 8 --hidden 384 --layers 8 --micro-batch 2

Every variant is ``Trainer(cfg, dist).train_step()`` on ``configs/tiny.yaml`` with the same model,
sequence length, micro-batch size and global batch (``m`` micro-batches per step), PyNative
(``--training.jit false``: pipeline parallel runs in PyNative anyway, so the baseline does too).

* Baselines: pp=1 in one plain process (this script again, without msrun), m micro-batches of
  gradient accumulation; once as ``ms-llm train`` would run (MindSpore's matmuls free to use
  both cores) and once pinned to core 0, the share of the machine one pipeline worker gets.
* pp=2 on two msrun workers, worker r pinned to core r (``--no-pin``: unpinned), one kernel
  thread each: 1F1B for each ``--m``, interleaved (vpp=2) for each ``--m-interleaved``.

Inside one process the variants take turns step by step, so load from other processes hits all
of them alike. The executor runs with ``timed = True`` (each action's outputs are synchronised
before its span closes), so its ``F``/``B`` spans are compute and ``comm`` spans the exchange
(including the wait for the partner to reach it). Per rank, a second table gives the mean F and
B span, compute and comm time, and process CPU time over wall time (how much of a core it got).

Reported per variant (median over steps 3..N, each step taking the slowest rank): step time,
tokens/s, speed-up over both pp=1 baselines at the same m, the measured bubble per rank =
1 - (F + B compute) / step wall time (max over ranks; the step includes the gradient norm and
AdamW, which no schedule removes) and the same over the pipeline's own window (first action to
last exchange), next to the analytic bubble, (p-1)/(m+p-1) for 1F1B and (p-1)/(m*vpp+p-1)
interleaved, and the schedule simulator's ``bubble_fraction`` with B costing 3 F (a backward that
re-runs its stage's forward; the executor keeps the closure where the schedule lets it,
``schedules.kept_backwards``).

Finally one step of pp=2 m=4 (1F1B) and of pp=2 x vpp=2 m=4 is drawn from both ranks' event
timestamps (perf_counter is the system-wide monotonic clock, so two processes share the axis).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from benchmarks.harness import ROOT

CONFIG = os.path.join(ROOT, "configs", "tiny.yaml")
PP = 2
# pp=1 as one process would run it (MindSpore's matmuls may use both cores), and pinned to one
# core: the share of the machine each pipeline worker gets.
BASELINES = ("pp=1", "pp=1, 1 core")


# ----------------------------------------------------------------------------- run specs

def run_spec(pp: int, vpp: int, m: int) -> str:
    """A variant as one argv word, ``pp:vpp:m`` (the worker parses it back)."""
    return f"{pp}:{vpp}:{m}"


def parse_spec(spec: str) -> tuple[int, int, int]:
    pp, vpp, m = (int(x) for x in spec.split(":"))
    return pp, vpp, m


def layout_name(pp: int, vpp: int) -> str:
    return f"pp={pp} 1F1B" if vpp == 1 else f"pp={pp} x vpp={vpp}"


def overrides(args, pp: int, vpp: int, m: int, out_dir: str) -> list[str]:
    """Command-line overrides on ``configs/tiny.yaml``: one model, only the layout and m vary.
    Heads of 32 channels and 4 query heads per KV group, as tiny.yaml has at hidden 256."""
    heads = max(1, args.hidden // 32)
    return ["--model.num_layers", str(args.layers), "--model.hidden_size", str(args.hidden),
            "--model.ffn_hidden_size", str(args.ffn or args.hidden * 11 // 4),
            "--model.num_attention_heads", str(heads),
            "--model.num_query_groups", str(max(1, heads // 4)),
            "--model.kv_channels", str(args.hidden // heads),
            "--data.seq_length", str(args.seq),
            "--training.micro_batch_size", str(args.micro_batch),
            "--training.global_batch_size", str(args.micro_batch * m),
            "--training.jit", "false",
            "--training.progress_bar", "false", "--training.output_dir", out_dir,
            "--parallel.pipeline_model_parallel_size", str(pp),
            "--parallel.virtual_pipeline_model_parallel_size", str(vpp)]


# ----------------------------------------------------------------------------- worker

def step_record(trainer, barrier) -> dict:
    """One timed ``train_step`` with this rank's spans and bubbles.

    The barrier first makes every rank start the step together, so the wall time measures the
    schedule and not the previous step's skew."""
    barrier()
    c0, t0 = time.process_time(), time.perf_counter()
    out = trainer.train_step()
    t1, c1 = time.perf_counter(), time.process_time()
    rec = {"t0": t0, "t1": t1, "step_s": t1 - t0, "cpu_s": c1 - c0, "tokens": out["tokens"],
           "loss": out["loss"]}
    ex = trainer.pipeline
    if ex is None:
        return rec
    events = [list(e) for e in ex.events]
    compute = sum(e[4] - e[3] for e in events if e[0] in ("F", "B", "W", "R"))
    window = max(e[4] for e in events) - min(e[3] for e in events)
    f_s = [e[4] - e[3] for e in events if e[0] == "F"]
    b_s = [e[4] - e[3] for e in events if e[0] == "B"]
    rec.update(events=events, compute_s=compute, window_s=window, f_s=sum(f_s) / len(f_s),
               b_s=sum(b_s) / len(b_s), action_s=action_means(events),
               comm_s=sum(e[4] - e[3] for e in events if e[0] in ("comm", "wait")),
               bubble_step=1 - compute / rec["step_s"], bubble_pipe=1 - compute / window)
    return rec


def action_means(events: list) -> dict:
    """Mean span per action kind and chunk ("F0", "B1", ...): the costs ``replay_bubble`` needs,
    per chunk because the last virtual stage also runs the output layer and the loss."""
    spans: dict = {}
    for kind, _, chunk, t0, t1 in events:
        if kind in ("F", "B"):
            spans.setdefault(f"{kind}{chunk}", []).append(t1 - t0)
    return {k: sum(v) / len(v) for k, v in spans.items()}


def pin_cpu(args) -> None:
    """``--cpu N``: this process on core N; ``--cpu rank``: an msrun worker on core RANK_ID (msrun
    exports it). Done before MindSpore starts its kernel threads, so they inherit the mask."""
    if args.cpu is None or os.environ.get("MS_ROLE") == "MS_SCHED":
        return
    n = int(os.environ.get("RANK_ID", "0")) if args.cpu == "rank" else int(args.cpu)
    os.sched_setaffinity(0, {n % os.cpu_count()})


def worker(args) -> None:
    """Runs every ``--runs`` variant in this process (under msrun: one pp rank), steps taking
    turns, and writes this rank's records to ``<out>.<rank>.json``."""
    pin_cpu(args)
    from ms_llm.compat import setup_device
    setup_device("CPU")
    from ms_llm.config import load_config
    from ms_llm.parallel import comm
    from ms_llm.parallel.runtime import init_distributed
    from ms_llm.training.trainer import Trainer

    info = init_distributed()
    barrier = comm.barrier if info.world_size > 1 else (lambda: None)
    trainers = []
    for spec in args.runs:
        pp, vpp, m = parse_spec(spec)
        cfg = load_config(CONFIG, overrides(args, pp, vpp, m, os.path.dirname(args.out)))
        trainer = Trainer(cfg, info)
        if trainer.pipeline is not None:
            trainer.pipeline.timed = True
        trainers.append((spec, trainer))
    records: dict = {spec: [] for spec in args.runs}
    for _ in range(args.steps):
        for spec, trainer in trainers:
            records[spec].append(step_record(trainer, barrier))
    for spec in records:   # keep events of the last step only: the timeline needs one step
        for r in records[spec][:-1]:
            r.pop("events", None)
    with open(f"{args.out}.{info.rank}.json", "w") as f:
        json.dump({"rank": info.rank, "world": info.world_size, "runs": records,
                   "cpus": sorted(os.sched_getaffinity(0)), "load": os.getloadavg()}, f)


# ----------------------------------------------------------------------------- launcher

def launch(args, specs: list[str], nproc: int, tmp: str, tag: str,
           extra: tuple = ()) -> list[dict]:
    """This script as worker: a plain process for nproc=1, ``msrun`` otherwise. Returns every
    rank's JSON."""
    out = os.path.join(tmp, tag)
    from benchmarks.harness import check, launch as launch_worker
    worker_argv = [*forwarded(args), *extra, "--as-worker", "--out", out, "--runs", *specs]
    r = launch_worker(os.path.abspath(__file__), nproc, os.path.join(tmp, f"logs_{tag}"),
                      worker_argv, cluster_time_out=300)
    check(r, tag)
    paths = [f"{out}.{rank}.json" for rank in range(nproc)]
    if not all(os.path.isfile(p) for p in paths):
        sys.exit(f"{tag}: a rank wrote no results:\n{r.failure_report(3000)}")
    return [json.load(open(p)) for p in paths]


def forwarded(args) -> list[str]:
    """The model/size options, passed on to the workers unchanged."""
    out = []
    for key in ("layers", "hidden", "ffn", "seq", "micro_batch", "steps"):
        value = getattr(args, key)
        if value is not None:
            out += [f"--{key.replace('_', '-')}", str(value)]
    return out


# ----------------------------------------------------------------------------- analysis

def analytic_bubble(pp: int, vpp: int, m: int) -> float:
    """Megatron's bubble for balanced, free-running stages: (p-1)/(m+p-1), interleaved
    (p-1)/(m*vpp+p-1)."""
    return (pp - 1) / (m * vpp + pp - 1)


def simulated_bubble(pp: int, vpp: int, m: int) -> float:
    """The repo's own schedule simulator on the rounds the executor runs, B = 3 F."""
    from ms_llm.parallel.pipeline.schedules import bubble_fraction, get_schedule, plan_rounds
    cost = {"F": 1.0, "B": 3.0}
    schedule = get_schedule(vpp=vpp).build(pp, m, vpp)
    return bubble_fraction(plan_rounds(schedule, pp, vpp, cost), cost)


def replay_bubble(pp: int, vpp: int, m: int, costs: list[dict]) -> float:
    """The executor's rounds replayed with this run's measured action times (``costs[rank]``,
    keyed like ``action_means``): every rank advances its own clock by its action, then each of
    the round's transfers, walked in the executor's order, holds its two ranks until both reach
    it (blocking point-to-point). Exchanges take no time here, so the gap to the measured window
    bubble is the transfers themselves plus jitter; the gap to the uniform simulator is stage
    imbalance and the real B/F ratio."""
    from ms_llm.parallel.pipeline.schedules import get_schedule, plan_rounds, transfers_after
    clock, busy = [0.0] * pp, 0.0
    for row in plan_rounds(get_schedule(vpp=vpp).build(pp, m, vpp), pp, vpp):
        for rank, a in enumerate(row):
            if a is not None:
                clock[rank] += costs[rank][f"{a.kind}{a.chunk}"]
                busy += costs[rank][f"{a.kind}{a.chunk}"]
        for src, dst, *_ in transfers_after(row, pp, vpp, pp * vpp):
            clock[src] = clock[dst] = max(clock[src], clock[dst])
    return 1.0 - busy / (pp * max(clock))


def dataflow_bubble(pp: int, vpp: int, m: int, costs: list[dict]) -> float:
    """The same per-rank action lists and measured times run free, as Megatron's ranks do: an
    action starts when its rank is free and its input exists; sends never block. The gap to
    ``replay_bubble`` is what the lockstep rounds cost."""
    from ms_llm.parallel.pipeline.schedules import get_schedule
    spec = get_schedule(vpp=vpp)
    schedule, last = spec.build(pp, m, vpp), pp * vpp - 1
    finished: dict = {}
    clock, pos, busy = [0.0] * pp, [0] * pp, 0.0
    while any(pos[r] < len(schedule[r]) for r in range(pp)):
        for rank in range(pp):
            if pos[rank] == len(schedule[rank]):
                continue
            a = schedule[rank][pos[rank]]
            vs = spec.placement.virtual_stage(rank, a.chunk, pp)
            needs = [("F", a.microbatch, vs - 1)] if a.kind == "F" and vs > 0 else []
            if a.kind == "B":
                needs = [("F", a.microbatch, vs)] + ([("B", a.microbatch, vs + 1)]
                                                      if vs < last else [])
            if any(n not in finished for n in needs):
                continue    # a valid schedule always lets some rank move
            cost = costs[rank][f"{a.kind}{a.chunk}"]
            clock[rank] = max([clock[rank]] + [finished[n] for n in needs]) + cost
            finished[(a.kind, a.microbatch, vs)] = clock[rank]
            busy += cost
            pos[rank] += 1
    return 1.0 - busy / (pp * max(clock))


def uniform_costs(costs: list[dict], vpp: int) -> list[dict]:
    """Every rank and chunk at the run's mean F and mean B: the measured B/F ratio without the
    stage imbalance."""
    mean = {k: statistics.mean(c[f"{k}{chunk}"] for c in costs for chunk in range(vpp))
            for k in "FB"}
    return [{f"{k}{chunk}": mean[k] for k in "FB" for chunk in range(vpp)} for _ in costs]


def median_costs(steps: list[dict]) -> dict:
    return {k: statistics.median(s["action_s"][k] for s in steps) for k in steps[0]["action_s"]}


def summarise(spec: str, ranks: list[dict], skip: int, layout: str) -> dict:
    """Median over the kept steps of the slowest rank's step time; bubbles per rank, max."""
    pp, vpp, m = parse_spec(spec)
    per_rank = [r["runs"][spec][skip:] for r in ranks]
    steps = [max(rank[i]["step_s"] for rank in per_rank) for i in range(len(per_rank[0]))]
    row = {"layout": layout, "spec": spec, "pp": pp, "vpp": vpp, "m": m,
           "step_s": statistics.median(steps), "tokens": per_rank[0][0]["tokens"],
           "load": max(r["load"][0] for r in ranks), "cpus": [r["cpus"] for r in ranks],
           "cpu_share": max(statistics.median(s["cpu_s"] / s["step_s"] for s in rank)
                            for rank in per_rank)}
    if pp > 1:
        for key in ("bubble_step", "bubble_pipe", "comm_s", "compute_s"):
            row[key] = max(statistics.median(s[key] for s in rank) for rank in per_rank)
        row["analytic"] = analytic_bubble(pp, vpp, m)
        row["simulated"] = simulated_bubble(pp, vpp, m)
        costs = [median_costs(rank) for rank in per_rank]
        row["replayed"] = replay_bubble(pp, vpp, m, costs)
        row["dataflow"] = dataflow_bubble(pp, vpp, m, costs)
        row["uniform_replay"] = replay_bubble(pp, vpp, m, uniform_costs(costs, vpp))
    return row


def rank_details(spec: str, ranks: list[dict], skip: int) -> list[dict]:
    """Per rank, medians over the kept steps: mean F and B span, compute, comm (the round's
    exchange, including waiting for the partner to reach it) and process CPU time over wall."""
    out = []
    for r in ranks:
        steps = r["runs"][spec][skip:]
        med = {k: statistics.median(s[k] for s in steps)
               for k in ("f_s", "b_s", "compute_s", "comm_s", "cpu_s", "step_s")}
        out.append({"rank": r["rank"], **med})
    return out


def print_details(specs: list[str], ranks: list[dict], skip: int) -> None:
    print("\n| layout | m | rank | F ms | B ms | B/F | compute s | comm s | step s | "
          "CPU s / step s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for spec in specs:
        pp, vpp, m = parse_spec(spec)
        for d in rank_details(spec, ranks, skip):
            print(f"| {layout_name(pp, vpp)} | {m} | {d['rank']} | {d['f_s'] * 1e3:.0f} | "
                  f"{d['b_s'] * 1e3:.0f} | {d['b_s'] / d['f_s']:.1f} | {d['compute_s']:.2f} | "
                  f"{d['comm_s']:.2f} | {d['step_s']:.2f} | {d['cpu_s'] / d['step_s']:.2f} |")


def print_bubbles(rows: list[dict]) -> None:
    """Where the measured bubble comes from, one model at a time: Megatron's formula; the
    executor's rounds at the measured mean F and B (B/F and lockstep); with each rank's and
    chunk's own times (plus stage imbalance) free-running and in rounds; measured over the
    pipeline window (plus the transfers and jitter) and over the whole step (plus norm, AdamW)."""
    print("\n| layout | m | analytic | rounds, mean F/B | free-running, measured F/B per "
          "stage | rounds, measured F/B per stage | measured, pipeline window | measured, "
          "whole step |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        if row["pp"] > 1:
            cells = [row[k] for k in ("analytic", "uniform_replay", "dataflow", "replayed",
                                      "bubble_pipe", "bubble_step")]
            print(f"| {row['layout']} | {row['m']} | " + " | ".join(f"{c:.0%}" for c in cells)
                  + " |")


def print_table(rows: list[dict], args) -> None:
    """Markdown table; speed-ups against both pp=1 baselines at the same m."""
    base = {(r["layout"], r["m"]): r["step_s"] for r in rows if r["pp"] == 1}
    print(f"# Trainer.train_step, PyNative, hidden={args.hidden} layers={args.layers} "
          f"seq={args.seq} micro-batch={args.micro_batch}; median of steps 3..{args.steps}, "
          f"slowest rank; pp=2 on 2 msrun workers"
          f"{'' if args.no_pin else ', worker r pinned to core r'}")
    print("| layout | m | step s | tokens/s | vs pp=1 | vs pp=1 on 1 core | measured bubble | "
          "analytic bubble | simulated bubble (B=3F) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        cells = [row["layout"], str(row["m"]), f"{row['step_s']:.2f}",
                 f"{row['tokens'] / row['step_s']:.0f}"]
        for ref in BASELINES:
            t1 = base.get((ref, row["m"]))
            cells.append(f"{t1 / row['step_s']:.2f}x" if t1 else "-")
        if row["pp"] > 1:
            cells += [f"{row[k]:.0%}" for k in ("bubble_step", "analytic", "simulated")]
        else:
            cells += ["-"] * 3
        print("| " + " | ".join(cells) + " |")
    cpu = ", ".join(f"{r['layout']} m={r['m']}: {r['cpu_share']:.2f}" for r in rows
                    if r["pp"] == 1)
    print(f"\npp=1 process CPU time / wall time (above 1: MindSpore used both cores): {cpu}")
    loads = ", ".join(sorted({f"{r['layout']}: {r['load']:.1f}" for r in rows}))
    print(f"1-minute load average when each job ended (2 cores): {loads}")


# ----------------------------------------------------------------------------- figure

def panel(ax, ranks: list[dict], spec: str, title: str) -> None:
    """Both ranks' last recorded step of ``spec`` on one time axis (ms from the step start)."""
    colors = {"F": "#4C72B0", "B": "#55A868", "W": "#8172B2", "R": "#64B5CD",
              "comm": "#DD8452", "wait": "#C44E52"}
    steps = [r["runs"][spec][-1] for r in ranks]
    origin = min(s["t0"] for s in steps)
    _, vpp, _ = parse_spec(spec)
    for rank, step in enumerate(steps):
        ax.barh(rank, (step["t1"] - step["t0"]) * 1e3, left=(step["t0"] - origin) * 1e3,
                height=0.8, color="#EEEEEE", edgecolor="#999999", linewidth=0.4)
        for kind, mb, chunk, t0, t1 in step["events"]:
            if t1 - t0 < 1e-4:       # an empty span (e.g. "R" of a kept backward)
                continue
            link = kind in ("comm", "wait")
            y = rank + (0.28 if link else -0.08)
            h = 0.18 if link else 0.5
            ax.barh(y, (t1 - t0) * 1e3, left=(t0 - origin) * 1e3, height=h, color=colors[kind],
                    edgecolor="black", linewidth=0.3)
            if not link:
                label = f"{kind}{mb}" + (f".{chunk}" if vpp > 1 else "")
                ax.text((t0 + t1) / 2 * 1e3 - origin * 1e3, y, label, ha="center",
                        va="center", fontsize=6, color="white")
    ax.set_yticks(range(len(steps)))
    ax.set_yticklabels([f"rank {r}" for r in range(len(steps))], fontsize=8)
    ax.invert_yaxis()
    ax.set_title(title, fontsize=9)


def draw_timeline(ranks: list[dict], specs: list[tuple[str, str]], out_png: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    fig, axes = plt.subplots(len(specs), 1, figsize=(12, 1.2 + 1.5 * len(specs)), dpi=110)
    for ax, (spec, title) in zip(axes, specs):
        panel(ax, ranks, spec, title)
    axes[-1].set_xlabel("ms since the step started (after a barrier); the grey bar ends "
                        "after gradient norm and AdamW")
    fig.legend(handles=[Patch(color="#4C72B0", label="F (forward)"),
                        Patch(color="#55A868", label="B (re-forward + backward)"),
                        Patch(color="#DD8452", label="comm (the round's batch_isend_irecv, "
                                                     "incl. waiting for the partner)"),
                        Patch(facecolor="#EEEEEE", edgecolor="#999999",
                              label="train_step (blank = idle or outside the pipeline)")],
               fontsize=7, loc="upper center", ncol=4, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    os.makedirs(os.path.dirname(os.path.abspath(out_png)), exist_ok=True)
    fig.savefig(out_png)
    return out_png


# ----------------------------------------------------------------------------- main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=None, help="default 11/4 x hidden")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6, help="steps per variant; 1-2 are warm-up")
    ap.add_argument("--m", type=int, nargs="+", default=[2, 4, 8], help="1F1B micro-batches")
    ap.add_argument("--m-interleaved", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--no-pin", action="store_true",
                    help="leave the pp=2 workers unpinned (default: worker r on core r)")
    ap.add_argument("--timeline", default=os.path.join(ROOT, "docs", "pipeline_timeline.png"))
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--runs", nargs="+", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--cpu", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--as-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.as_worker:
        return worker(args)
    from ms_llm.compat.environment import setting
    if not setting("runtime.sync_ops"):
        print("note: runtime.sync_ops false: the executor's timed mode synchronises only the tensors it "
              "sends, so p2p waits land in the next F/B span and the bubbles below read low")
    ms_all = sorted(set(args.m) | set(args.m_interleaved))
    base_specs = [run_spec(1, 1, m) for m in ms_all]
    pipe_specs = [run_spec(PP, 1, m) for m in args.m] + \
        [run_spec(PP, 2, m) for m in args.m_interleaved]
    tmp = tempfile.mkdtemp(prefix="ms_llm_pipeline_bench_")
    skip = 2
    rows = []
    for layout, extra in zip(BASELINES, ((), ("--cpu", "0"))):
        ranks = launch(args, base_specs, 1, tmp, "pp1" if not extra else "pp1_core", extra)
        rows += [summarise(s, ranks, skip, layout) for s in base_specs]
    pin = () if args.no_pin else ("--cpu", "rank")
    pipe_ranks = launch(args, pipe_specs, PP, tmp, "pp2", pin)
    rows += [summarise(s, pipe_ranks, skip, layout_name(*parse_spec(s)[:2])) for s in pipe_specs]
    print_table(rows, args)
    print_bubbles(rows)
    print_details(pipe_specs, pipe_ranks, skip)
    with open(os.path.join(tmp, "table.json"), "w") as f:
        json.dump(rows, f, indent=1)
    panels = [(s, t) for s, t in ((run_spec(PP, 1, 4), "pp=2, 1F1B, m=4 (measured, one step)"),
                                  (run_spec(PP, 2, 4), "pp=2 x vpp=2, interleaved 1F1B, m=4 "
                                                       "(measured, one step; label F<mb>.<chunk>)"))
              if s in pipe_specs]
    if panels:
        print(f"\ntimeline: {draw_timeline(pipe_ranks, panels, args.timeline)}")
    print(f"raw records: {tmp}")


if __name__ == "__main__":
    main()
