"""Worker for tests/parallel/test_fsdp.py: a GPT with awkward sizes (vocab 257, hidden 96, ffn 200,
3 layers) on synthetic tokens, trained with the given overrides; rank 0 writes losses and grad
norms as JSON. argv: OUT_JSON RUN_SPEC [RUN_SPEC ...] (see train_parallel.py).

The spec ``unit_reduce`` runs no training: it shards one Linear(6 -> 5 rows, uneven)
with reduce_dtype bf16 and fp32, back-propagates a rank-specific loss, and every rank writes its
reduced shard gradients to OUT_JSON.rank<R> for the test's NumPy reference."""
import json
import sys

import numpy as np

from ms_llm.compat import setup_device

setup_device("CPU")
import mindspore as ms  # noqa: E402
from mindspore import Tensor  # noqa: E402

from ms_llm.compat import nn  # noqa: E402
from ms_llm.config import load_config  # noqa: E402
from ms_llm.parallel import comm  # noqa: E402
from ms_llm.parallel.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402
from ms_llm.parallel.runtime import init_distributed  # noqa: E402
from ms_llm.training.trainer import Trainer  # noqa: E402

sys.path.insert(0, __file__.rsplit("/", 2)[0])
from helpers.msrun import parse_run_spec  # noqa: E402
from helpers.parallel_common import (AWKWARD, CONFIG, SyntheticLoader,  # noqa: E402
                                     small_data_overrides)


def unit_inputs(rank: int):
    """Integer-valued inputs, so every fp32 gradient is exact (|g| <= 4 x 50 x 50 < 2^24) while
    bf16 (8 significant bits) must round them."""
    rng = np.random.default_rng(100 + rank)
    return (rng.integers(-50, 51, (4, 6)).astype(np.float32),
            rng.integers(-50, 51, (4, 5)).astype(np.float32))


def unit_reduce(out_path: str, rank: int) -> None:
    res = {}
    for rd in ("bf16", None):
        lin = nn.Linear(6, 5, bias=False)
        fully_shard(lin, comm.world_group(), mp_policy=MixedPrecisionPolicy(reduce_dtype=rd))
        x, c = unit_inputs(rank)
        fn = ms.value_and_grad(lambda: (lin(Tensor(x)) * Tensor(c)).sum(), None, [lin.weight])
        _, (g,) = fn()
        res[str(rd)] = g.asnumpy().tolist()
    with open(f"{out_path}.rank{rank}", "w") as f:
        json.dump(res, f)


info = init_distributed()
results = {}
for spec in sys.argv[2:]:
    name, args, _ = parse_run_spec(spec)
    if name == "unit_reduce":
        unit_reduce(sys.argv[1], info.rank)
        continue
    cfg = load_config(CONFIG, AWKWARD + small_data_overrides() +
                      args)
    trainer = Trainer(cfg, info)
    loader = SyntheticLoader(cfg, trainer.pstate.dp_rank, trainer.dp_group.size)
    loader.load_state_dict(trainer.data.loader.state_dict())   # keep a resumed position
    trainer.data.loader = loader
    records = trainer.fit()
    results[name] = {"loss": [r["loss"] for r in records],
                     "grad_norm": [r["grad_norm"] for r in records]}
    print(f"RUN {name} DONE", flush=True)
if info.rank == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(results, f)
