"""Muon vs AdamW: optimizer-step time on the ~55M Llama-style model (8 layers, hidden 512,
untied 32000-token vocabulary), one process, CPU.

Both optimizers step the same model's parameters with the same random gradients; steps are
interleaved (AdamW, Muon, AdamW, ...) so load from other processes hits both, and the median of
``--reps`` steps after one warm-up is reported with the ratio. Muon orthogonalises every hidden
matrix (5 quintic Newton-Schulz steps in fp32: ~3 GEMMs of the matrix's smaller side per step)
and runs AdamW on the embedding, output layer and norms. Muon runs three ways: its default (fp32
Newton-Schulz as one CPU op over OpenBLAS, ``ms_llm.ops.cpu_kernels.optimizer.muon_ns``), with
``muon_fp32_matmul_prec: medium`` (bf16 GEMM operands through oneDNN) and with the composed
``mint`` Newton-Schulz the kernel replaced.

The FSDP comparison against torch FSDP2 + ``torch.optim.Muon`` is ``benchmarks/muon_fsdp.py``.

``python -m benchmarks.muon [--reps 5]``
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

from benchmarks.harness import ROOT, machine, model_55m

MODEL = model_55m("qwen3")


def step_times(reps: int) -> None:
    import numpy as np
    from mindspore import Tensor
    from ms_llm.compat import setup_device
    setup_device("CPU")
    from ms_llm.config import load_config
    from ms_llm.models import GPTModel
    from ms_llm.optim import AdamW, Muon, param_groups
    from ms_llm.optim.kinds import get_optimizer

    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), MODEL)
    model = GPTModel(cfg.model)
    named = [(n, p) for n, p in model.parameters_and_names() if p.requires_grad]
    total = sum(int(p.size) for _, p in named)
    rng = np.random.default_rng(0)
    grads = [Tensor(rng.normal(scale=1e-3, size=p.shape).astype(np.float32)) for _, p in named]
    adam = functools.partial(AdamW, betas=(0.9, 0.95), weight_decay=0.1)
    muon = functools.partial(Muon, named, lr=1e-4, weight_decay=0.1, model_config=cfg.model,
                             adam=adam)
    opts = {"AdamW": adam(named, lr=1e-4), "Muon (fp32 kernel, default)": muon(),
            "Muon medium (bf16 GEMM operands)": muon(fp32_matmul_prec="medium"),
            "Muon, composed Newton-Schulz (before)": muon()}
    opts["Muon, composed Newton-Schulz (before)"].kernel = False
    groups = param_groups.build_groups(named, get_optimizer("muon").rule)
    runs = {k: functools.partial(opt.step, grads, 1e-4) for k, opt in opts.items()}
    times = {k: [] for k in runs}
    for i in range(reps + 1):
        for name, run in runs.items():
            t0 = time.perf_counter()
            out = run()
            for t in (out or {}).values():
                t.asnumpy()                  # wait for the result
            if i:
                times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"# optimizer step, {total / 1e6:.1f}M parameters "
          f"({', '.join(f'{g.label} {g.numel / 1e6:.1f}M' for g in groups)}); {machine()}")
    print("| optimizer | step (ms, median) | vs AdamW |")
    print("|---|---|---|")
    for k in opts:
        print(f"| {k} | {med[k] * 1e3:.0f} | {med[k] / med['AdamW']:.2f}x |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args(argv)
    step_times(a.reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
