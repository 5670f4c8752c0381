"""Worker for tests/planning/test_memory_plan.py: trains one layout for a few steps, then every rank
writes ``OUT_PREFIX.<rank>.json`` with its measured peak (RSS high-water mark minus the RSS
before the model was built), its real per-rank parameter count, and what ``ms-llm plan``
predicts for it (the plan is computed after training, so it cannot add to the peak).

argv: OUT_PREFIX CONFIG [--section.key VALUE ...]
"""
import json
import sys

from ms_llm.compat import setup_device

setup_device("CPU")
from ms_llm.config import load_config  # noqa: E402
from ms_llm.parallel.plan_shapes import full_shapes, rank_params  # noqa: E402
from ms_llm.parallel.runtime import init_distributed  # noqa: E402
from ms_llm.planning.memory_plan import plan_memory  # noqa: E402
from ms_llm.training.trainer import Trainer  # noqa: E402

info = init_distributed()
cfg = load_config(sys.argv[2], sys.argv[3:])
trainer = Trainer(cfg, info)
records = trainer.fit()
# the high-water mark as each step logged it: training's, not rank 0's loss plot drawn after
peak = max(r["peak_rss_gb"] for r in records) - trainer.rss_before_model_gb
real = {n: int(q.size) for n, q in trainer.named_params}
model_cfg = trainer.cfg.model
plan = plan_memory(cfg, info.world_size, model_config=model_cfg)
sizes = trainer.pstate.sizes
planned = rank_params(cfg, model_cfg, sizes, info.rank, full_shapes(model_cfg))
stage = trainer.pstate.pp_rank
with open(f"{sys.argv[1]}.{info.rank}.json", "w") as f:
    json.dump({"rank": info.rank, "stage": stage, "measured_gb": peak,
               "planned_gb": plan.stages[stage].peak / 2 ** 30,
               "real_numel": sum(real.values()), "planned_numel": sum(p.numel for p in planned),
               "real_count": len(real), "planned_count": len(planned)}, f)
