"""Running a published MindSpeed-LLM script under msrun as its users would: its argument list
(``tests/fixtures/mindspeed_examples.json``) with only the sizes shrunk and the placeholders
(``@LOAD@``, ``@TOKENIZER@``, ``@DATA@``, ``@SAVE@``) pointed at test folders, launched as
``msrun ... pretrain_gpt.py`` / ``posttrain_gpt.py`` from a working folder of its own; and the
one-process ``ms-llm`` run of the same flags it is compared with."""
import json
import os
from typing import Dict, List, Mapping

from .mindspeed_examples import load
from .msrun import ROOT, run_msrun, worker_logs


def shrunk(argv: List[str], paths: Mapping[str, str], sizes: Mapping[str, str]) -> List[str]:
    """The script's arguments with each flag of ``sizes`` given its value there and the
    placeholders filled from ``paths``."""
    out = [paths.get(a, a) for a in argv]
    for i, a in enumerate(out[:-1]):
        if a in sizes:
            out[i + 1] = sizes[a]
    return out


def run_script(work, name: str, nproc: int, paths: Mapping[str, str],
               sizes: Mapping[str, str], timeout: int = 600):
    """Run script ``name`` shrunk under msrun in folder ``work`` (created); a failed job fails
    with the workers' logs. Returns (argv, metric rows with a loss, rank 0's log)."""
    entry = load()[name]
    argv = shrunk(entry["argv"], paths, sizes)
    os.makedirs(work)
    cwd = os.getcwd()
    os.chdir(work)      # MindSpeed scripts log relative to the working folder, as here
    try:
        r = run_msrun(os.path.join(ROOT, entry["entry"]), nproc, os.path.join(work, "logs"),
                      argv, timeout=timeout)
    finally:
        os.chdir(cwd)
    logs = worker_logs(os.path.join(work, "logs"), nproc)
    assert r.returncode == 0, "\n".join([log[-3000:] for log in logs] + [r.stderr[-2000:]])
    rows = [json.loads(x) for x in open(os.path.join(work, "outputs", "default", "metrics.jsonl"))
            if '"loss"' in x]
    return argv, rows, logs[0]


def one_process_run(argv: List[str], out: str) -> List[Dict]:
    """``ms-llm``'s one-process run of a script's flags, every parallel size 1 (its own output
    and save folders: a save folder belongs to one run); the metric rows with a loss (training steps)."""
    from ms_llm.config import load_config
    from ms_llm.mindspeed.flags import to_overrides, translate
    from ms_llm.training.trainer import Trainer
    keys = translate(argv, world_size=1).keys
    for key in ("parallel.pipeline_model_parallel_size", "parallel.expert_model_parallel_size",
                "parallel.tensor_model_parallel_size", "parallel.context_parallel_size"):
        keys[key] = 1                                    # every layer and expert here
    keys.pop("parallel.virtual_pipeline_model_parallel_size", None)
    keys.pop("parallel.sequence_parallel", None)
    keys["training.output_dir"] = out
    keys["checkpoint.save_dir"] = os.path.join(out, "save")
    return [r for r in Trainer(load_config(None, to_overrides(keys))).fit() if "loss" in r]


def save_tiny_hf(folder, family: str, seed: int = 0, **overrides) -> str:
    """``helpers.tiny_hf.build_tiny_hf`` of the family (``overrides`` on its ``tiny_hf``),
    saved to ``folder``."""
    from .tiny_hf import build_tiny_hf
    build_tiny_hf(family, seed, **overrides).save_pretrained(str(folder))
    return str(folder)
