"""Worker for tests/training/test_observability.py: several short trainings in one msrun job; rank 0
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
from ms_llm.training.callbacks import TrainerCallback  # noqa: E402
from ms_llm.training.trainer import Trainer  # noqa: E402

sys.path.insert(0, __file__.rsplit("/", 2)[0])
from helpers.parallel_common import BASE, CONFIG  # noqa: E402

info = init_distributed()


def rank_order_check() -> dict:
    """The deterministic all-reduce (sum, async avg) and reduce-scatter-by-all-reduce against
    a NumPy float32 sum in rank order of every rank's (seeded) tensor."""
    import numpy as np
    from mindspore import Tensor
    from ms_llm.parallel import comm
    from ms_llm.parallel.comm import cpu_compose
    w, r = info.world_size, info.rank
    xs = [np.random.default_rng(100 + k).standard_normal((4 * w, 5)).astype(np.float32)
          for k in range(w)]
    ref = xs[0].copy()
    for x in xs[1:]:
        ref = ref + x
    comm.set_deterministic(True)
    total = Tensor(xs[r])
    comm.all_reduce(total)
    avg = Tensor(xs[r])
    comm.all_reduce(avg, op="avg", async_op=True).wait()
    piece = Tensor(np.zeros((4, 5), np.float32))
    cpu_compose.reduce_scatter_by_all_reduce(piece, Tensor(xs[r]), "sum", comm.world_group(),
                                             False)
    comm.set_deterministic(False)
    return {"sum": bool((total.asnumpy() == ref).all()),
            "avg": bool((avg.asnumpy() == ref / np.float32(w)).all()),
            "reduce_scatter": bool((piece.asnumpy() == ref[4 * r:4 * r + 4]).all())}


results = {"rank_order": rank_order_check()}
for spec in sys.argv[2:]:
    name, _, extra = spec.partition(":")
    args = [a.replace("|", ",") for a in extra.split(",") if a]
    local = []     # this rank's own timers and step time per logged step

    class LocalTimers(TrainerCallback):
        def on_train_begin(self, trainer):
            self.trainer = trainer

        def on_log(self, step, record):
            local.append({"step_time_s": record["step_time_s"],
                          "timers_ms": dict(self.trainer.observe.local_ms)})
    records = [r for r in Trainer(load_config(CONFIG, BASE + args), info,
                                  callbacks=[LocalTimers()]).fit() if "loss" in r]
    results[name] = {k: [r.get(k) for r in records]
                     for k in ("loss", "grad_norm", "step_time_s", "timers_ms")}
    results[name]["local"] = local
    print(f"RUN {name} DONE", flush=True)
if info.rank == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(results, f)
