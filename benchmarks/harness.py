"""Shared by the benchmark modules (run from the checkout as ``python -m benchmarks.<name>``):
launching a worker (one plain process, msrun through ``ms_llm.launch.msrun``, or this package's own
module in a child interpreter), the tiny model of a quick ``--small`` check and the 55M model of
the tables, and the machine line every figure is printed with (figures on a shared machine are
only comparable within one run)."""
from __future__ import annotations

import os
import sys
from typing import Mapping, Optional, Sequence

from ms_llm.launch.msrun import (LaunchResult, MsrunJob, free_port, launch_env,  # noqa: F401
                                 run_msrun)             # (free_port: re-exported)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the checkout

# The tiny model (and sequence) of the tests (tests/helpers/parallel_common.py TINY_MODEL).
TINY_MODEL = ["--model.num_layers", "2", "--model.hidden_size", "64", "--model.ffn_hidden_size",
              "128", "--model.num_attention_heads", "4", "--model.num_query_groups", "2",
              "--model.kv_channels", "16", "--data.seq_length", "32"]

def model_55m(family: str = "llama") -> list:
    """The ~55M model of issue #31's tables (hidden 512, 8 layers, GQA 8/2, FFN 1408, vocab 32000,
    untied) as overrides onto configs/tiny.yaml: Llama-style, or ``qwen3`` (tiny.yaml's own
    family, QK-norm on)."""
    return (["--model.family", family, "--model.num_layers", "8", "--model.hidden_size", "512",
             "--model.ffn_hidden_size", "1408", "--model.num_attention_heads", "8",
             "--model.num_query_groups", "2", "--model.kv_channels", "64",
             "--model.padded_vocab_size", "32000", "--model.untie_embeddings_and_output_weights",
             "true"] + (["--model.qk_layernorm", "false"] if family == "llama" else []))


def module_env(base: Optional[Mapping[str, str]] = None) -> dict:
    """``base`` (default this environment) with the checkout first on ``PYTHONPATH``: a child
    started by :func:`run_module`, or a worker script msrun runs, then imports ``benchmarks``
    and ``ms_llm`` from this checkout whatever its working folder."""
    env = dict(os.environ if base is None else base)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != ROOT]
    env["PYTHONPATH"] = os.pathsep.join([ROOT, *paths])
    return env


def run_module(module: str, *args, env: Optional[Mapping[str, str]] = None,
               cwd: Optional[str] = None):
    """Run ``python -m module args`` with this interpreter in ``env`` (default this environment)
    plus the checkout on ``PYTHONPATH`` (:func:`module_env`), output captured: how a benchmark
    runs itself, or another benchmark, in a fresh process. Returns the CompletedProcess."""
    import subprocess
    return subprocess.run([sys.executable, "-m", module, *[str(a) for a in args]],
                          capture_output=True, text=True, cwd=cwd, env=module_env(env))


def train_metrics(cmd: Sequence[str], out: str, env: Optional[dict] = None) -> list:
    """Run one training command (``ms-llm train`` / ``scripts/pretrain.sh`` writing to ``out``)
    and return the rows of its ``metrics.jsonl`` that carry a step time; stop with the command's
    output tails when it fails or logged nothing."""
    import json
    import subprocess
    r = subprocess.run(list(cmd), capture_output=True, text=True,
                       env=env if env is not None else dict(os.environ, GLOG_v="3"))
    path = os.path.join(out, "metrics.jsonl")
    if r.returncode != 0 or not os.path.isfile(path):
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stdout[-1500:]}\n{r.stderr[-1500:]}")
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    return [row for row in rows if "step_time_s" in row]


def machine() -> str:
    """CPU model, usable cores and load average: printed next to every figure."""
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f
                         if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"{model}, {len(os.sched_getaffinity(0))} cores, load average {load}"


def launch(script: str, nproc: int, log_dir: str, args: Sequence[str] = (), *,
           cluster_time_out: int = 120, timeout: Optional[float] = None) -> LaunchResult:
    """Run ``script args``: a plain process for ``nproc == 1`` (its output is ``worker_0.log``
    in ``log_dir``), msrun on ``nproc`` local workers otherwise."""
    os.makedirs(log_dir, exist_ok=True)
    if nproc == 1:
        return MsrunJob([sys.executable, script, *args], log_dir, 1, env=launch_env(module_env()),
                        output=os.path.join(log_dir, "worker_0.log")).wait(timeout)
    return run_msrun(script, nproc, log_dir, args, timeout=timeout, env=launch_env(module_env()),
                     cluster_time_out=cluster_time_out)


def check(res: LaunchResult, what: str) -> LaunchResult:
    """Stop the benchmark with the workers' logs when a launch failed."""
    if not res.ok:
        raise SystemExit(f"{what} failed:\n{res.failure_report(3000)}")
    return res


def llama_model(layers: int, hidden: int = 512, heads: int = 8, kv_heads: int = 2,
                ffn: int = 1408, vocab: int = 32000, max_positions: int = 4096):
    """A random-weight Llama-style ``GPTModel`` on CPU (seed 0): the 55M model's widths at
    ``layers`` layers, fp32 (the inference benchmarks' model)."""
    from ms_llm.compat import manual_seed, setup_device
    from ms_llm.models import GPTModel, TransformerConfig, family_defaults
    setup_device("CPU")
    manual_seed(0)
    cfg = TransformerConfig(**dict(family_defaults("llama"), num_layers=layers, hidden_size=hidden,
                                   ffn_hidden_size=ffn, num_attention_heads=heads,
                                   num_query_groups=kv_heads, padded_vocab_size=vocab,
                                   max_position_embeddings=max_positions))
    return GPTModel(cfg)
