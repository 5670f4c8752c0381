"""The lr schedule against megatron-core's own ``OptimizerParamScheduler``.

The reference side is built the way Megatron's ``training.get_optimizer_param_scheduler`` builds
it from the command line (written out here from its documented rules, not imported from ms-llm):
steps in samples, ``step(0)`` at start, ``step(global_batch_size)`` after each update. For every
iteration the lr ms-llm applies must equal the reference's lr before the step, and the lr ms-llm
logs the reference's lr after it (Megatron's printed value). Exact equality: both evaluate the
same float formula in the same order.
"""
import json

import pytest

from ms_llm.config import load_config
from ms_llm.training.lr_schedule import scheduler_from_config, train_iters

opsched = pytest.importorskip("megatron.core.optimizer_param_scheduler")


class _Groups:
    """The one thing the scheduler touches on an optimizer: its param groups."""
    def __init__(self):
        self.param_groups = [{"params": [], "default_config": True}]


def megatron_reference(a: dict):
    """Megatron's argument-to-scheduler rules, from ``a`` (Megatron argument names)."""
    gbs = a["global_batch_size"]
    if a.get("train_iters"):
        decay = (a.get("lr_decay_iters") or a["train_iters"]) * gbs
        warmup = a.get("lr_warmup_iters", 0) * gbs
        wsd = a["lr_wsd_decay_iters"] * gbs if a.get("lr_wsd_decay_iters") else None
        wd_steps = a["train_iters"] * gbs
    else:
        decay = a.get("lr_decay_samples") or a["train_samples"]
        warmup = a.get("lr_warmup_samples", 0)
        wsd = a.get("lr_wsd_decay_samples")
        wd_steps = a["train_samples"]
    if a.get("lr_warmup_fraction") is not None:
        warmup = a["lr_warmup_fraction"] * decay
    return opsched.OptimizerParamScheduler(
        _Groups(), init_lr=a.get("lr_warmup_init", 0.0), max_lr=a["lr"], min_lr=a["min_lr"],
        lr_warmup_steps=warmup, lr_decay_steps=decay, lr_decay_style=a["lr_decay_style"],
        start_wd=0.1, end_wd=0.1, wd_incr_steps=wd_steps, wd_incr_style="constant",
        wsd_decay_steps=wsd, lr_wsd_decay_style=a.get("lr_wsd_decay_style"))


CASES = {
    "warmup_cosine": dict(train_iters=30, lr_warmup_iters=5),
    "warmup_init_linear": dict(train_iters=30, lr_warmup_iters=4, lr_warmup_init=1e-4,
                               lr_decay_style="linear", lr_decay_iters=20),
    "fraction": dict(train_iters=25, lr_warmup_fraction=0.13),
    "constant": dict(train_iters=12, lr_warmup_iters=3, lr_decay_style="constant"),
    "inverse_sqrt": dict(train_iters=20, lr_warmup_iters=3, lr_decay_style="inverse-square-root"),
    **{f"wsd_{s}": dict(train_iters=24, lr_warmup_iters=2, lr_decay_style="WSD",
                        lr_wsd_decay_iters=8, lr_wsd_decay_style=s)
       for s in ("linear", "cosine", "exponential", "minus_sqrt")},
    "samples": dict(train_samples=100, lr_warmup_samples=18, lr_decay_samples=70),
    "samples_fraction": dict(train_samples=96, lr_warmup_fraction=0.2),
}
# Megatron argument -> ms-llm training key (iterations map to the *_steps keys)
KEYS = {"train_iters": "max_steps", "lr_warmup_iters": "lr_warmup_steps",
        "lr_decay_iters": "lr_decay_steps", "lr_wsd_decay_iters": "lr_wsd_decay_steps"}


@pytest.mark.parametrize("name", sorted(CASES))
def test_applied_and_logged_lr_equal_megatron(name):
    a = {"global_batch_size": 4, "lr": 3e-3, "min_lr": 3e-4, "lr_decay_style": "cosine",
         **CASES[name]}
    overrides = [x for k, v in a.items() for x in (f"--training.{KEYS.get(k, k)}", str(v))]
    cfg = load_config(None, overrides)
    ours, ref = scheduler_from_config(cfg.training), megatron_reference(a)
    iters = train_iters(cfg.training)
    assert iters == (a.get("train_iters") or a["train_samples"] // 4)
    group = ref.optimizer.param_groups[0]
    for _ in range(iters):
        applied = group["lr"]                 # what Megatron's optimizer step uses
        assert ours.get_lr() == applied
        ours.step(4)
        ref.step(increment=4)
        assert ours.get_lr() == group["lr"]   # what Megatron prints for this iteration
    assert ours.state_dict()["num_steps"] == ref.state_dict()["num_steps"]


def test_first_iteration_applies_warmup_init_and_resume_keeps_the_count():
    cfg = load_config(None, ["--training.max_steps", "10", "--training.lr_warmup_steps", "3",
                             "--training.lr_warmup_init", "1e-5"])
    s = scheduler_from_config(cfg.training)
    assert s.get_lr() == 1e-5
    for _ in range(4):
        s.step(cfg.training.global_batch_size)
    again = scheduler_from_config(cfg.training)
    again.load_state_dict(json.loads(json.dumps(s.state_dict())))
    assert again.get_lr() == s.get_lr() and again.num_steps == 4 * 8


def test_sample_based_run_derives_its_iterations_and_refuses_a_disagreeing_max_steps():
    cfg = load_config(None, ["--training.train_samples", "40", "--training.global_batch_size", "8"])
    assert cfg.training.max_steps == 5
    with pytest.raises(ValueError, match=r"command line --training\.max_steps.*disagrees"):
        load_config(None, ["--training.train_samples", "40", "--training.max_steps", "3"])
    with pytest.raises(ValueError, match="lr_warmup_init .* must be <= training.lr"):
        load_config(None, ["--training.lr_warmup_init", "1", "--training.lr", "0.1",
                           "--training.min_lr", "0"])


def test_training_logs_megatrons_printed_lr(tmp_path):
    """``ms-llm train``'s logged lr per step is Megatron's log line for that iteration."""
    from ms_llm.training.trainer import Trainer
    tiny = ["--model.num_layers", "1", "--model.hidden_size", "32", "--model.ffn_hidden_size", "64",
            "--model.num_attention_heads", "2", "--data.seq_length", "16",
            "--training.micro_batch_size", "2", "--training.global_batch_size", "2",
            "--training.progress_bar", "false", "--training.max_steps", "5",
            "--training.lr_warmup_steps", "2", "--training.lr_warmup_init", "1e-4",
            "--training.lr", "3e-3", "--training.min_lr", "3e-4",
            "--training.output_dir", str(tmp_path / "out")]
    records = Trainer(load_config(None, tiny)).fit()
    ref = megatron_reference(dict(global_batch_size=2, train_iters=5, lr_warmup_iters=2,
                                  lr_warmup_init=1e-4, lr=3e-3, min_lr=3e-4,
                                  lr_decay_style="cosine"))
    printed = []
    for _ in range(5):
        ref.step(increment=2)
        printed.append(ref.optimizer.param_groups[0]["lr"])
    assert [r["lr"] for r in records] == printed
