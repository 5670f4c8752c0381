"""Worker for tests/test_fsdp.py: a GPT with awkward sizes (vocab 257, hidden 96, ffn 200,
3 layers) on synthetic tokens, trained with the given overrides; rank 0 writes losses and grad
norms as JSON. argv: OUT_JSON RUN_SPEC [RUN_SPEC ...] (see train_parallel.py)."""
import json
import sys

from ms_llm.compat import setup_device

setup_device("CPU")
from ms_llm.config import load_config  # noqa: E402
from ms_llm.parallel.runtime import init_distributed  # noqa: E402
from ms_llm.training.trainer import Trainer  # noqa: E402

sys.path.insert(0, __file__.rsplit("/", 2)[0])
from parallel_common import AWKWARD, CONFIG, SyntheticLoader, small_data_overrides  # noqa: E402

info = init_distributed()
results = {}
for spec in sys.argv[2:]:
    name, _, extra = spec.partition(":")
    cfg = load_config(CONFIG, AWKWARD + small_data_overrides() +
                      [a for a in extra.split(",") if a])
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
