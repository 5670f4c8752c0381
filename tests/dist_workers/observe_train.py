"""Worker for tests/test_observability.py: several short trainings in one msrun job; rank 0
writes each run's per-step loss, grad norm, step time and timers as JSON.

argv: OUT_JSON RUN_SPEC [RUN_SPEC ...], RUN_SPEC = "name:--key=value,--key=value" on top of
parallel_common.BASE (``|`` inside a value stands for a list's comma).
"""
import json
import sys

from ms_llm.compat import setup_device

setup_device("CPU")
from ms_llm.config import load_config  # noqa: E402
from ms_llm.parallel.runtime import init_distributed  # noqa: E402
from ms_llm.training.trainer import Trainer  # noqa: E402

sys.path.insert(0, __file__.rsplit("/", 2)[0])
from parallel_common import BASE, CONFIG  # noqa: E402

info = init_distributed()
results = {}
for spec in sys.argv[2:]:
    name, _, extra = spec.partition(":")
    args = [a.replace("|", ",") for a in extra.split(",") if a]
    records = [r for r in Trainer(load_config(CONFIG, BASE + args), info).fit() if "loss" in r]
    results[name] = {k: [r.get(k) for r in records]
                     for k in ("loss", "grad_norm", "step_time_s", "timers_ms")}
    print(f"RUN {name} DONE", flush=True)
if info.rank == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(results, f)
