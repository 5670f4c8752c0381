"""Worker for tests/planning/test_memory_plan.py: measures the peak memory of several single-process
trainings with one interpreter start, and writes what ``ms-llm plan`` predicts beside each.

argv: OUT_JSON SPEC_JSON, where SPEC_JSON maps a name to ``[config, [--section.key, VALUE,
...]]``. OUT_JSON gets ``{name: {"measured_gb", "planned_gb", ...}}``.

Why a fork server: MindSpore's CPU memory pool never returns memory, so each measured training
needs a process of its own; importing MindSpore and ms-llm costs most of a short run, so this
process imports once and forks one child per training (two at a time: the machine's two cores;
``MS_LLM_MEASURE_CONCURRENT`` changes it).

Honest measurement in a forked child: ``fork`` copies the page tables of anonymous memory, but
not those of file-backed pages (shared libraries, the Python code): the child would fault those
in again during training and count them in its peak, pages that a freshly started process has
resident before training. So every child first re-maps (``MADV_POPULATE_READ``) exactly the
file-backed pages this process has resident at fork time (read from ``/proc/self/pagemap``),
which gives it the page state of a fresh process at the same point. The trainer then resets the
RSS high-water mark just before building the model (``metrics.reset_peak_rss``) and records the
RSS there (``rss_before_model_gb``): the measured peak is the high-water mark minus that, as for
``ms-llm train`` in a fresh process.
"""
import ctypes
import json
import os
import sys
import traceback

import numpy as np

from ms_llm.compat import setup_device

setup_device("CPU")
from ms_llm.config import load_config  # noqa: E402
from ms_llm.planning.memory_plan import plan_memory  # noqa: E402
from ms_llm.training.trainer import Trainer  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")
MADV_POPULATE_READ = 22        # Linux >= 5.14
CONCURRENT = int(os.environ.get("MS_LLM_MEASURE_CONCURRENT", "2"))


def resident_file_runs():
    """(address, length) runs of file-backed pages resident in this process now."""
    runs = []
    with open("/proc/self/maps") as maps, open("/proc/self/pagemap", "rb") as pagemap:
        for line in maps:
            parts = line.split()
            if len(parts) < 6 or not parts[5].startswith("/") or "r" not in parts[1]:
                continue
            start, end = (int(x, 16) for x in parts[0].split("-"))
            pagemap.seek(start // PAGE * 8)
            present = (np.frombuffer(pagemap.read((end - start) // PAGE * 8), np.uint64)
                       >> np.uint64(63)).astype(bool)
            # runs of consecutive present pages
            edges = np.flatnonzero(np.diff(np.concatenate([[0], present.astype(np.int8), [0]])))
            for a, b in zip(edges[::2], edges[1::2]):
                runs.append((start + int(a) * PAGE, int(b - a) * PAGE))
    return runs


def populate(runs) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for addr, length in runs:
        libc.madvise(addr, length, MADV_POPULATE_READ)   # a failed run only under-populates


def measure(name: str, config: str, extra, out_dir: str) -> dict:
    cfg = load_config(config, list(extra) + ["--training.output_dir", out_dir])
    trainer = Trainer(cfg)
    records = trainer.fit()
    # the high-water mark as each step logged it: training's, not the loss plot's drawn after
    measured = max(r["peak_rss_gb"] for r in records) - trainer.rss_before_model_gb
    # planned after training, so the planner's own allocations cannot add to the peak
    plan = plan_memory(load_config(config, list(extra)), 1, model_config=trainer.cfg.model)
    return {"measured_gb": measured, "planned_gb": plan.peak_gb,
            "rss_before_model_gb": trainer.rss_before_model_gb}


def main() -> None:
    out_path, specs = sys.argv[1], json.loads(open(sys.argv[2]).read())
    runs = resident_file_runs()
    results, running = {}, {}
    todo = list(specs.items())
    while todo or running:
        while todo and len(running) < CONCURRENT:
            name, (config, extra) = todo.pop(0)
            part = f"{out_path}.{len(results) + len(running)}"
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    populate(runs)
                    rec = measure(name, config, extra, part + ".run")
                    with open(part + ".tmp", "w") as f:
                        json.dump(rec, f)
                    os.replace(part + ".tmp", part)
                    code = 0
                except BaseException:     # os._exit below would swallow the traceback
                    traceback.print_exc()
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)
            running[pid] = (name, part)
        pid, status = os.wait()
        name, part = running.pop(pid)
        if status != 0:
            raise SystemExit(f"{name}: the measuring child failed (wait status {status})")
        results[name] = json.loads(open(part).read())
    with open(out_path + ".tmp", "w") as f:
        json.dump(results, f)
    os.replace(out_path + ".tmp", out_path)


if __name__ == "__main__":
    main()
