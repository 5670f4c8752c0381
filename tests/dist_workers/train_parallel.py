"""Worker for tests/parallel/test_parallel_training.py: runs several short trainings in one msrun
job
(one job start costs ~15 s here) and has rank 0 write each run's losses and grad norms as JSON.

argv: OUT_JSON RUN_SPEC [RUN_SPEC ...], where RUN_SPEC is "name:--key=value,--key=value"
(``msrun_util.run_spec`` writes it, ``parse_run_spec`` reads it)
(``@dead`` among them: kill parallel_common.DEAD_EXPERTS before training; ``@packed``: wrap the
loader in parallel_common.PackedLoader; ``@deepseek``: the DeepSeek-V3 proxy of
deepseek_parallel_common instead of the tiny config; ``@qwen3next``: the tiny Qwen3-Next of
qwen3_next_parallel_common; ``@count_attention``: record in the
run's ``attention_forwards`` how often this rank ran the context-parallel attention forward,
to show activation recompute re-runs it; ``|`` inside a value
stands for a list's comma, e.g. ``--parallel.num_layer_list=1|3``).
"""
import json
import sys

from ms_llm.compat import setup_device

setup_device("CPU")
from ms_llm.config import load_config  # noqa: E402
from ms_llm.parallel.runtime import init_distributed  # noqa: E402
from ms_llm.training.trainer import Trainer  # noqa: E402

sys.path.insert(0, __file__.rsplit("/", 2)[0])
from helpers.deepseek_parallel_common import DS_BASE, DS_CONFIG  # noqa: E402
from helpers.msrun import parse_run_spec  # noqa: E402
from helpers.parallel_common import (BASE, CONFIG, PackedLoader, kill_experts,  # noqa: E402
                                     run_record)
from helpers.qwen3_next_parallel_common import Q3N_BASE, Q3N_CONFIG  # noqa: E402

info = init_distributed()
ATTENTION_FORWARDS = [0]
if any("@count_attention" in spec for spec in sys.argv[2:]):
    # test-only counter around the ring attention forward (every cp algorithm runs it)
    from ms_llm.parallel.context_parallel import ring
    _ring_forward = ring._RingAttention.forward

    def _counted(ctx, *a):
        ATTENTION_FORWARDS[0] += 1
        return _ring_forward(ctx, *a)
    ring._RingAttention.forward = staticmethod(_counted)
results = {}
for spec in sys.argv[2:]:
    name, overrides, args = parse_run_spec(spec)   # args: the @flags
    config, base = (DS_CONFIG, DS_BASE) if "@deepseek" in args else \
        (Q3N_CONFIG, Q3N_BASE) if "@qwen3next" in args else (CONFIG, BASE)
    cfg = load_config(config, base + overrides)
    trainer = Trainer(cfg, info)
    if "@dead" in args:
        kill_experts(trainer)
    if "@packed" in args:
        trainer.data.loader = PackedLoader(trainer.data.loader)
    ATTENTION_FORWARDS[0] = 0
    results[name] = run_record(trainer)
    if "@count_attention" in args:
        results[name]["attention_forwards"] = ATTENTION_FORWARDS[0]
    print(f"RUN {name} DONE", flush=True)
if info.rank == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(results, f)
