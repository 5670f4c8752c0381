"""Tiny trainings run on every rank of the fake HCCL world (``fake_hccl_world.run_world``) and,
as their single-process reference, in the test process: the layouts of the fake-world test."""
from .cli import last_wins
from .parallel_common import BASE, CONFIG

STEPS = ["--training.max_steps", "1", "--training.jit", "false", "--training.log_interval", "1"]
LAYOUTS = {
    # data parallel: one micro-batch of 4 per rank, gradients all-reduced
    "dp2": [],
    # tensor parallel with sequence parallel: the all-gathers / reduce-scatters of activations
    "tp2_sp": ["--parallel.tensor_model_parallel_size", "2",
               "--parallel.sequence_parallel", "true"],
    # two pipeline stages, 1F1B over 4 micro-batches of 2
    "pp2": ["--parallel.pipeline_model_parallel_size", "2", "--model.num_layers", "4",
            "--training.micro_batch_size", "2"],
}


def layout_args(name: str, output_dir: str, parallel: bool = True) -> list:
    """The run's overrides; ``parallel=False``: the same run on one process (its reference)."""
    extra = LAYOUTS[name] if parallel else _serial(LAYOUTS[name])
    return last_wins(BASE + STEPS + extra + ["--training.output_dir", output_dir])


def _serial(args):
    """The layout's model and batch settings without its parallel sizes."""
    pairs = list(zip(args[::2], args[1::2]))
    return [x for k, v in pairs if not k.startswith("--parallel.") for x in (k, v)]


def record(cfg_args) -> dict:
    from ms_llm.config import load_config
    from ms_llm.training.trainer import Trainer
    recs = Trainer(load_config(CONFIG, cfg_args)).fit()
    return {"loss": [r["loss"] for r in recs], "grad_norm": [r["grad_norm"] for r in recs]}


def train_layouts(rank: int, output_root: str, names) -> dict:
    """On a rank of the fake world: each layout in ``names`` trained for one step; the
    records by layout."""
    import os
    from ms_llm.config import load_config
    from ms_llm.parallel.runtime import DistInfo
    from ms_llm.training.trainer import Trainer
    out = {}
    for name in names:
        args = layout_args(name, os.path.join(output_root, name))
        trainer = Trainer(load_config(CONFIG, args), DistInfo(rank, 2, True))
        recs = trainer.fit()
        out[name] = {"loss": [r["loss"] for r in recs],
                     "grad_norm": [r["grad_norm"] for r in recs]}
    return out
