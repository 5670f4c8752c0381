"""Worker for tests/test_deepseek_parallel.py: several short DeepSeek-proxy trainings in one
msrun job; rank 0 writes each run's losses and grad norms as JSON.

argv: OUT_JSON RUN_SPEC [RUN_SPEC ...], RUN_SPEC = "name:--key=value,--key=value" ("|" inside a
value stands for a list's comma, e.g. ``--parallel.num_layer_list=1|2``)."""
import json
import sys

from ms_llm.compat import setup_device

setup_device("CPU")
from ms_llm.config import load_config  # noqa: E402
from ms_llm.parallel.runtime import init_distributed  # noqa: E402
from ms_llm.training.trainer import Trainer  # noqa: E402

sys.path.insert(0, __file__.rsplit("/", 2)[0])
from deepseek_parallel_common import DS_BASE, DS_CONFIG  # noqa: E402
from parallel_common import run_record  # noqa: E402

info = init_distributed()
results = {}
for spec in sys.argv[2:]:
    name, _, extra = spec.partition(":")
    args = [a.replace("|", ",") for a in extra.split(",") if a]
    results[name] = run_record(Trainer(load_config(DS_CONFIG, DS_BASE + args), info))
    print(f"RUN {name} DONE", flush=True)
if info.rank == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(results, f)
