"""MindSpeed-LLM's O2 against fp32 Adam moments on the same model in the same run (CPU, one
process per layout): optimizer-state bytes per parameter and peak memory.

Layouts, each a bf16 run (``training.bf16``: bf16 weights, fp32 main parameters) of the ~55M
Llama-style model of ``harness.model_55m``:

* ``fp32``: fp32 moments, gradients summed in fp32 (Megatron's ``--bf16`` default);
* ``o2-optimizer``: bf16 moments (``training.adam_moments_dtype: bfloat16``, ``--o2-optimizer``);
* ``o2``: bf16 moments and bf16 gradient accumulation (``+ parallel.grad_reduce_in_fp32:
  false``, ``--o2-gradient``).

Each layout trains ``--steps`` steps in a fresh child process and reports the optimizer's state
bytes (``optimizer.state_bytes()``: moments + fp32 main parameters), those per parameter, the
bytes per parameter of the micro-batch gradient sums (fp32 or bf16), the
peak RSS of training (the trainer resets the high-water mark before building the model) and
the median step time (first step dropped), and the resident memory after set-up (model, main
parameters, optimizer state) and after the last step. MindSpeed-LLM's O2 page states the saving as 4N
bytes (bf16 moments) and 2N (bf16 gradients); the table shows what this CPU run measures.

``python -m benchmarks.o2_memory [--steps 3] [--small]``
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.harness import ROOT, TINY_MODEL, model_55m, run_module

COMMON = ["--training.bf16", "true", "--training.jit", "false", "--training.progress_bar",
          "false", "--training.micro_batch_size", "1", "--training.global_batch_size", "2",
          "--data.seq_length", "256"]
LAYOUTS = {
    "fp32": [],
    "o2-optimizer": ["--training.adam_moments_dtype", "bfloat16"],
    "o2": ["--training.adam_moments_dtype", "bfloat16", "--parallel.grad_reduce_in_fp32",
           "false"],
}


def worker(out: str, layout: str, steps: int, small: bool) -> None:
    from ms_llm.compat import setup_device
    setup_device("CPU")
    from ms_llm.config import load_config
    from ms_llm.training.metrics import current_rss_gb, peak_rss_gb
    from ms_llm.training.trainer import Trainer

    model = TINY_MODEL if small else model_55m()
    overrides = model + COMMON + LAYOUTS[layout] + [
        "--training.output_dir", os.path.join(tempfile.gettempdir(), f"ms_llm_bench_o2_{layout}")]
    if small:
        overrides += ["--data.seq_length", "32"]
    tr = Trainer(load_config(os.path.join(ROOT, "configs", "tiny.yaml"), overrides))
    setup_gb = current_rss_gb()     # model, main parameters and optimizer state built
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        tr.train_step()
        times.append(time.perf_counter() - t0)
    from ms_llm.training.mixed_precision import grad_dtype
    n = sum(int(p.size) for p in tr.params)
    state = tr.optimizer.state_bytes()
    grad_bytes = 2 if str(grad_dtype(tr.cfg)).lower().startswith("bfloat16") else 4
    with open(out, "w") as f:
        json.dump({"params": n, "state": state, "peak_rss_gb": peak_rss_gb(),
                   "setup_rss_gb": setup_gb, "end_rss_gb": current_rss_gb(),
                   "grad_bytes": grad_bytes,
                   "step_s": statistics.median(times[1:] or times)}, f)


def cpu_model() -> str:
    """``lscpu``'s model name (the CPU every figure here belongs to)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines()
                    if line.startswith("Model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


def commit() -> str:
    r = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                       text=True)
    return r.stdout.strip() or "unknown"


def versions() -> str:
    import mindspore
    import numpy
    return (f"Python {platform.python_version()}, MindSpore {mindspore.__version__}, "
            f"NumPy {numpy.__version__}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--small", action="store_true", help="the 2-layer test model (quick check)")
    ap.add_argument("--worker", nargs=2, metavar=("OUT", "LAYOUT"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker(a.worker[0], a.worker[1], a.steps, a.small)
        return 0
    print(f"# O2 memory: {cpu_model()}, {os.cpu_count()} cores; commit {commit()}; {versions()}")
    print(f"# model: {'tiny (--small)' if a.small else '~55M Llama-style'}, bf16, "
          f"{a.steps} steps, micro-batch 1 x seq {32 if a.small else 256}")
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for layout in LAYOUTS:
            out = os.path.join(tmp, f"{layout}.json")
            extra = ["--small"] if a.small else []
            r = run_module("benchmarks.o2_memory", "--worker", out, layout, "--steps",
                           str(a.steps), *extra)
            if r.returncode != 0 or not os.path.isfile(out):
                print(r.stdout[-2000:], r.stderr[-2000:], file=sys.stderr)
                return 1
            with open(out) as f:
                rows[layout] = json.load(f)
    print(f"{'layout':<14} {'params':>11} {'moments B/param':>16} {'state B/param':>14} "
          f"{'grad sum B/param':>17} {'state MiB':>10} {'RSS setup/end GiB':>18} "
          f"{'peak RSS GiB':>13} {'step s':>7}")
    for layout, r in rows.items():
        n, st = r["params"], r["state"]
        moments = st["exp_avg+exp_avg_sq"]
        total = sum(st.values())
        print(f"{layout:<14} {n:>11,} {moments / n:>16.2f} {total / n:>14.2f} "
              f"{r['grad_bytes']:>17} {total / 2 ** 20:>10.1f} "
              f"{r['setup_rss_gb']:>8.3f} / {r['end_rss_gb']:>6.3f} {r['peak_rss_gb']:>13.3f} "
              f"{r['step_s']:>7.2f}")
    base = rows["fp32"]
    for layout in ("o2-optimizer", "o2"):
        saved = sum(base["state"].values()) - sum(rows[layout]["state"].values())
        print(f"# {layout}: optimizer state {saved / base['params']:.2f} B/param smaller; "
              f"peak RSS {base['peak_rss_gb'] - rows[layout]['peak_rss_gb']:.3f} GiB lower")
    return 0


if __name__ == "__main__":
    sys.exit(main())
