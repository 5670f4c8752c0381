"""One qualification job: several short trainings in one process (alone, or one msrun launch:
a launch costs ~15-20 s here), each framed by ``=== qualify run NAME begin/end ===`` so the driver
can cut the log into per-cell files. Rank 0 writes every run's record as JSON.

argv: JOB.json, holding ``{"results": PATH, "runs": [RUN, ...]}`` with RUN =
``{"name", "config", "args": [...], "probe": NPY or null, "export_hf": DIR or null,
"copy_ckpt": [SRC, DST] or null, "no_fit": bool}``: ``probe`` saves the trained model's logits on a fixed batch
(one process only), ``export_hf`` exports the run's newest checkpoint as a Hugging Face folder,
``copy_ckpt`` copies a checkpoint folder after the run (to resume it later at another layout), ``no_fit``
only builds the trainer (a reloaded model's logits), ``fault: [STEP, RANK]`` with ``out`` (its
output folder) kills RANK in step STEP on the run's first attempt (``arm_fault``). A job with
``"resumable": true`` records each run as it ends and, relaunched, skips the recorded ones.
A run that fails records its error and the job goes on with the next run.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
import traceback

import numpy as np

PROBE_SHAPE = (2, 16)


def probe_tokens(vocab: int) -> np.ndarray:
    """The fixed batch criterion (b) compares logits on (ids < the 35-word vocabulary)."""
    return np.random.default_rng(20260).integers(0, min(vocab, 35), PROBE_SHAPE).astype(np.int32)


def probe_logits(model, vocab: int) -> np.ndarray:
    from mindspore import Tensor
    out = model(Tensor(probe_tokens(vocab)))
    return np.asarray(out.asnumpy(), np.float32)


def export_hf(save_dir: str, out_dir: str, cfg=None) -> str:
    """The newest complete checkpoint of ``save_dir`` as an HF folder (LoRA: merged). A
    ``checkpoint.format torch_dist`` run's save is Megatron-Core's ``iter_*`` folder: it is read
    back through the importer a resume uses (``checkpoint.torch_dist.train.import_torch_dist``),
    so (b) checks that format's round trip too."""
    from ms_llm.checkpoint.native import dcp, export as dcp_export
    from ms_llm.checkpoint.adapters import export as lora_export
    if cfg is not None and cfg.checkpoint.format == "torch_dist":
        return _export_torch_dist(save_dir, out_dir, cfg)
    path = dcp.find_latest_complete(save_dir)
    if path is None:
        raise FileNotFoundError(f"{save_dir}: no complete checkpoint")
    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    if lora_export.is_lora_checkpoint(path):
        return lora_export.export_merged(path, out_dir, fmt="hf")
    return dcp_export.export_hf(path, out_dir)


def _export_torch_dist(save_dir: str, out_dir: str, cfg) -> str:
    import dataclasses
    import tempfile
    from ms_llm.checkpoint.native import export as dcp_export
    from ms_llm.checkpoint.torch_dist.train import import_torch_dist, latest_torch_dist
    found = latest_torch_dist(save_dir)
    if found is None:
        raise FileNotFoundError(f"{save_dir}: no torch_dist checkpoint (no tracker)")
    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)      # the first export of the job: hf/ is not there yet
    with tempfile.TemporaryDirectory(dir=parent) as tmp:
        path, _ = import_torch_dist(found[0], tmp, {"model_config": dataclasses.asdict(cfg.model)},
                                    gated=bool(cfg.model.gated_linear_unit),
                                    global_batch_size=cfg.training.global_batch_size)
        return dcp_export.export_hf(path, out_dir)


def run_one(run: dict, info) -> dict:
    from ms_llm.config import ConfigError, load_config
    from ms_llm.training.trainer import Trainer
    rec = {"name": run["name"], "loss": [], "grad_norm": [], "error": None, "refused": False}
    t0 = time.time()
    try:
        cfg = load_config(run["config"], run["args"])
        trainer = Trainer(cfg, info)
        steps = [] if run.get("no_fit") else [r for r in trainer.fit() if "loss" in r]
        rec["loss"] = [float(r["loss"]) for r in steps]
        rec["grad_norm"] = [float(r["grad_norm"]) for r in steps]
        rec["steps"] = [int(r["step"]) for r in steps]
        if run.get("probe") and info.world_size == 1:
            np.save(run["probe"], probe_logits(trainer.model, cfg.model.padded_vocab_size))
        if info.rank == 0 and run.get("export_hf"):
            # the trainer's config: the vocabulary is sized by the tokenizer at data setup
            hf = export_hf(cfg.checkpoint.save_dir, run["export_hf"], trainer.cfg)
            print(f"ms-llm qualify: exported {hf}", flush=True)
        if info.rank == 0 and run.get("copy_ckpt"):
            src, dst = run["copy_ckpt"]
            if os.path.isdir(dst):
                shutil.rmtree(dst)
            shutil.copytree(src, dst)
    except ConfigError as e:          # the configuration is refused: the feature is not built
        rec.update(error=f"config error: {e}", refused=True)
        print(f"ms-llm qualify: {rec['error']}", flush=True)
    except Exception as e:  # noqa: BLE001 - one failed run must not hide the others' results
        traceback.print_exc()
        rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:400]
    rec["seconds"] = round(time.time() - t0, 1)
    return rec


def arm_fault(run: dict, rank: int) -> None:
    """A run with ``fault: [STEP, RANK]`` (criterion (d), ``qualify.fault``) sets
    ``MS_LLM_FAULT_INJECT`` armed on the run's first attempt only: each rank leaves a marker in
    the run's output folder, so the relaunch after the kill resumes the run instead of dying
    again, while the next run of the job is killed once in its turn."""
    from ms_llm.training.faults import ATTEMPT_ENV, FAULT_ENV
    os.environ.pop(FAULT_ENV, None)
    if not run.get("fault"):
        return
    marker = os.path.join(run["out"], f".fault_armed_rank{rank}")
    first = not os.path.exists(marker)
    if first:
        os.makedirs(run["out"], exist_ok=True)
        open(marker, "w").close()
    os.environ[FAULT_ENV] = f"{run['fault'][0]}:{run['fault'][1]}"
    os.environ[ATTEMPT_ENV] = "0" if first else "1"


def _write(results: dict, path: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(results, f)
    os.replace(tmp, path)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0], encoding="utf-8") as f:
        job = json.load(f)
    from ms_llm.compat import setup_device
    device = setup_device(None)
    from ms_llm.parallel.runtime import init_distributed
    info = init_distributed()
    results = {"device": device, "world_size": info.world_size, "runs": {}}
    # a relaunched job (``resumable``: under the restart supervisor) skips the runs it recorded
    resumable = bool(job.get("resumable"))
    if resumable and os.path.exists(job["results"]):
        with open(job["results"], encoding="utf-8") as f:
            results["runs"] = json.load(f)["runs"]
    for run in job["runs"]:
        if run["name"] in results["runs"]:
            continue
        arm_fault(run, info.rank)
        print(f"=== qualify run {run['name']} begin ===", flush=True)
        rec = run_one(run, info)
        results["runs"][run["name"]] = rec
        status = "ok" if rec["error"] is None else f"error: {rec['error']}"
        print(f"=== qualify run {run['name']} end ({status}, {rec['seconds']} s) ===", flush=True)
        if resumable and info.rank == 0:
            _write(results, job["results"])
    if info.rank == 0:
        _write(results, job["results"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
