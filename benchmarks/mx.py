"""MXFP8 emulation: quantization throughput, mx_linear cost, and the training acceptance run.

    python -m benchmarks.mx                      # quantization + linear tables
    python -m benchmarks.mx --train              # also: tiny default model, unquantized vs mxfp8
    python -m benchmarks.mx --train --steps 50   # shorter acceptance run

Tables:
1. Quantization of a 4096x4096 fp32 tensor along the last axis, GB/s of fp32 input read:
   ``fake_quantize`` (the training path, one pass to dequantized values) and ``to_mx`` (uint8 codes
   + E8M0 scales) against a plain vectorized NumPy implementation of the same spec (baseline,
   measured here; frexp + ml_dtypes cast).
2. ``mx_linear`` forward+backward against the unquantized linear (``mint.nn.functional.linear``)
   at the tiny model's fc1 shape and a larger one, PyNative; ratio = mx / plain.
3. ``--train``: the default config (``configs/tiny.yaml``: jit, 200 steps) trained twice in
   subprocesses, with and without ``quant.recipe: mxfp8``; final loss and relative difference
   (acceptance: within 3%). Quantization is applied exactly where the trainer will call
   ``apply_quantization`` (right after ``build_model``).

Timing: median wall time over --repeat calls after one warm-up; each call ends with ``.asnumpy()``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

from benchmarks.harness import ROOT


def _median_time(fn, repeat: int) -> float:
    fn()
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def numpy_to_mx(x: np.ndarray):
    """Baseline: vectorized NumPy OCP-MX E4M3 quantization (floor scale) along the last axis."""
    import ml_dtypes
    b = x.reshape(x.shape[0], -1, 32)
    amax = np.abs(b).max(-1, keepdims=True)
    _, k = np.frexp(amax)
    e = np.clip(np.where(amax == 0, -127, k - 1 - 8), -127, 127).astype(np.float32)
    q = np.clip(b * np.exp2(-e), -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return q.view(np.uint8).reshape(x.shape), (e + 127).astype(np.uint8)[..., 0]


def bench_quant(repeat: int) -> None:
    from mindspore import Tensor
    from ms_llm.quant import fake_quantize, to_mx
    x = np.random.default_rng(0).standard_normal((4096, 4096)).astype(np.float32)
    t = Tensor(x)
    gb = x.nbytes / 1e9
    rows = [("numpy baseline (codes + scales)", _median_time(lambda: numpy_to_mx(x), repeat)),
            ("ms_llm to_mx (codes + scales)",
             _median_time(lambda: to_mx(t).qdata.asnumpy(), repeat)),
            ("ms_llm fake_quantize (training path)",
             _median_time(lambda: fake_quantize(t).asnumpy(), repeat))]
    base = rows[0][1]
    print("\nMX E4M3 quantization, 4096x4096 fp32, axis -1, floor")
    print(f"{'implementation':40s} {'time (ms)':>10s} {'GB/s':>8s} {'vs numpy':>9s}")
    for name, t_s in rows:
        print(f"{name:40s} {t_s * 1e3:10.1f} {gb / t_s:8.3f} {base / t_s:8.2f}x")


def bench_linear(repeat: int) -> None:
    import mindspore as ms
    from mindspore import Parameter, Tensor, mint
    from ms_llm.quant import mx_linear
    rng = np.random.default_rng(0)
    print("\nmx_linear forward+backward vs unquantized linear (PyNative, fp32)")
    print(f"{'M x K -> N':24s} {'plain (ms)':>11s} {'mx (ms)':>9s} {'ratio':>7s}")
    for m, k, n in ((1024, 256, 1408), (2048, 1024, 4096)):
        x = Tensor(rng.standard_normal((m, k)).astype(np.float32))
        w = Parameter(Tensor((rng.standard_normal((n, k)) * 0.02).astype(np.float32)), name="w")
        g = Tensor(rng.standard_normal((m, n)).astype(np.float32))

        def plain(x):
            return (mint.nn.functional.linear(x, w) * g).sum()

        def mx(x):
            return (mx_linear(x, w) * g).sum()
        fp = ms.value_and_grad(plain, grad_position=0, weights=[w])
        fm = ms.value_and_grad(mx, grad_position=0, weights=[w])
        tp = _median_time(lambda: fp(x)[1][0].asnumpy(), repeat)
        tm = _median_time(lambda: fm(x)[1][0].asnumpy(), repeat)
        print(f"{f'{m} x {k} -> {n}':24s} {tp * 1e3:11.1f} {tm * 1e3:9.1f} {tm / tp:7.2f}")


_TRAIN_CHILD = r"""
import json, sys
import ms_llm.training.trainer as T
from ms_llm.config import load_config
from ms_llm.quant import apply_quantization
recipe, steps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
over = ["--training.output_dir", out, "--training.progress_bar", "false"]
if steps > 0:
    over += ["--training.max_steps", str(steps)]
cfg = load_config("configs/tiny.yaml", over)
# config.validate still rejects it: set on a derived copy of the (frozen) loaded config
cfg = cfg.with_values({"quant.recipe": None if recipe == "none" else recipe})
build = T.build_model
def build_model(c):
    model = build(c)
    names = apply_quantization(model, c.quant)   # the integration the trainer will do
    if names:
        print(f"ms-llm: quant {c.quant.recipe} replaced {len(names)} modules: {', '.join(names)}",
              flush=True)
    return model
T.build_model = build_model
recs = T.run(cfg)
print("RESULT " + json.dumps({"final_loss": recs[-1]["loss"], "step": recs[-1]["step"],
      "last5": [r["loss"] for r in recs[-5:]],
      "median_step_s": sorted(r["step_time_s"] for r in recs)[len(recs) // 2]}), flush=True)
"""


def bench_train(steps: int) -> None:
    res = {}
    for recipe in ("none", "mxfp8"):
        out = os.path.join(ROOT, "outputs", f"bench_mx_{recipe}")
        t0 = time.time()
        p = subprocess.run([sys.executable, "-c", _TRAIN_CHILD, recipe, str(steps), out],
                           cwd=ROOT, capture_output=True, text=True)
        if p.returncode:
            sys.exit(f"train run {recipe} failed:\n{p.stderr[-3000:]}")
        for line in p.stdout.splitlines():
            if line.startswith("ms-llm: quant"):
                print(line)
            if line.startswith("RESULT "):
                res[recipe] = json.loads(line[7:])
        res[recipe]["wall_s"] = time.time() - t0
    base, mx = res["none"], res["mxfp8"]
    rel = (mx["final_loss"] - base["final_loss"]) / base["final_loss"]
    print(f"\nTiny default model ({base['step']} steps), final loss")
    print(f"{'run':10s} {'final loss':>11s} {'last 5 logged':>40s} {'median step (s)':>16s} "
          f"{'wall (s)':>9s}")
    for name, r in (("fp32", base), ("mxfp8", mx)):
        print(f"{name:10s} {r['final_loss']:11.4f} {str([round(v, 3) for v in r['last5']]):>40s} "
              f"{r['median_step_s']:16.2f} {r['wall_s']:9.0f}")
    print(f"relative difference {rel * 100:+.2f}% (acceptance: within 3%) -> "
          f"{'PASS' if abs(rel) <= 0.03 else 'FAIL'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--train", action="store_true", help="run the training acceptance comparison")
    ap.add_argument("--train-only", action="store_true")
    ap.add_argument("--steps", type=int, default=0, help="training steps (0: the config's default)")
    args = ap.parse_args()
    if not args.train_only:
        from ms_llm.compat import setup_device
        setup_device("CPU")
        bench_quant(args.repeat)
        bench_linear(args.repeat)
    if args.train or args.train_only:
        bench_train(args.steps)


if __name__ == "__main__":
    main()
