"""The trainer's composed parts and the config's one rule set: callbacks around the step (order,
gradients handed through), the objectives' interface, the frozen config and its derived copies,
the launch rules checked before any process starts, and the run settings that replaced the
``MS_LLM_*`` variables (config key > deprecated variable > default)."""
import os

import numpy as np
import pytest

from ms_llm.compat import environment
from ms_llm.config import ConfigError, FrozenConfigError, check_launch, load_config
from ms_llm.training.callbacks import TrainerCallback
from ms_llm.training.dpo import DPOObjective
from ms_llm.training.objectives import LMObjective, check_objective
from ms_llm.training.trainer import Trainer
from helpers.paths import ROOT

CONFIG = os.path.join(ROOT, "configs", "tiny.yaml")
TINY = ["--model.num_layers", "1", "--model.hidden_size", "32", "--model.ffn_hidden_size", "64",
        "--model.num_attention_heads", "2", "--model.num_query_groups", "1",
        "--model.kv_channels", "16", "--data.seq_length", "16", "--training.micro_batch_size", "2",
        "--training.global_batch_size", "4", "--training.progress_bar", "false",
        "--training.lr_warmup_steps", "1", "--training.max_steps", "2",
        "--training.log_interval", "1"]


class Recorder(TrainerCallback):
    def __init__(self):
        self.calls = []

    def on_train_begin(self, trainer):
        self.calls.append("train_begin")

    def on_step_begin(self, step):
        self.calls.append(f"step_begin {step}")

    def on_micro_batch_end(self, step, index):
        self.calls.append(f"micro_batch {step}.{index}")

    def on_grads(self, step, grads):
        self.calls.append(f"grads {step}")
        self.grads = grads
        return grads

    def on_before_update(self, step):
        self.calls.append(f"before_update {step}")

    def on_update(self, step, skipped):
        self.calls.append(f"update {step} {skipped}")

    def on_step_end(self, step, out):
        self.calls.append(f"step_end {step}")
        self.last = out

    def on_log(self, step, record):
        self.calls.append(f"log {step}")

    def on_train_end(self):
        self.calls.append("train_end")


class NaNGrads(TrainerCallback):
    """Hands a NaN gradient on at step 2 (what MS_LLM_NAN_INJECT does, as a callback)."""

    def on_grads(self, step, grads):
        return [g * float("nan") for g in grads] if step == 2 else grads


def test_callbacks_run_in_order_and_hand_gradients_on(tmp_path):
    rec = Recorder()
    trainer = Trainer(load_config(CONFIG, TINY + ["--training.output_dir", str(tmp_path / "a"),
                                                  "--training.nan_policy", "skip"]),
                      callbacks=[rec, NaNGrads()])
    records = trainer.fit()
    step1 = ["step_begin 1", "micro_batch 1.0", "micro_batch 1.1", "grads 1",
             "before_update 1", "update 1 False", "step_end 1", "log 1"]
    assert rec.calls[:1 + len(step1)] == ["train_begin"] + step1
    # the second callback's NaN reaches the guard: nan_policy skip drops that update
    assert "update 2 True" in rec.calls and rec.calls[-1] == "train_end"
    assert records[-1]["skipped"] is True and rec.last["loss"] == pytest.approx(records[-1]["loss"])
    assert len(rec.grads) == len(trainer.optimizer.params)
    with pytest.raises(TypeError, match="TrainerCallback"):
        trainer.callbacks.append(object())


def test_objectives_share_one_interface():
    assert check_objective(LMObjective) == ()
    assert check_objective(DPOObjective) == ()
    assert LMObjective.has_aux is False and DPOObjective.has_aux is True
    assert LMObjective.units([{"loss_mask": np.ones((2, 3))}]) == 6


def test_loaded_config_is_frozen_and_derived_copies_are_new():
    cfg = load_config(CONFIG, ["--training.max_steps", "3"])
    with pytest.raises(FrozenConfigError, match=r"training.max_steps cannot be set"):
        cfg.training.max_steps = 4
    with pytest.raises(FrozenConfigError):
        cfg.model = cfg.model
    new = cfg.with_values({"training.max_steps": 5, "parallel.ddp_overlap": False})
    assert (new.training.max_steps, new.parallel.ddp_overlap) == (5, False)
    assert cfg.training.max_steps == 3 and cfg.parallel.ddp_overlap is True and new.frozen
    with pytest.raises(FrozenConfigError):
        new.training.lr = 1.0
    with pytest.raises(ConfigError, match="unknown key 'training.nope'"):
        cfg.with_values({"training.nope": 1})


@pytest.mark.parametrize("extra,world,needle", [
    (["--parallel.tensor_model_parallel_size", "2"], 3,
     "launch with 3 worker(s): parallel: world size 3 is not divisible"),
    (["--training.micro_batch_size", "2", "--training.global_batch_size", "6"], 2,
     "command line --training.global_batch_size: training.global_batch_size (6) must be a "
     "multiple of micro_batch_size x data-parallel size (4)"),
    (["--parallel.pipeline_model_parallel_size", "2", "--model.num_layers", "4",
      "--parallel.virtual_pipeline_model_parallel_size", "2", "--training.micro_batch_size", "1",
      "--training.global_batch_size", "1"], 2,
     "the interleaved 1F1B schedule needs at least parallel.pipeline_model_parallel_size (2) "
     "micro-batches, got 1"),
])
def test_launch_rules_run_before_any_worker(extra, world, needle):
    """The rules that need the worker count run in load_config (scripts/pretrain.sh passes it)
    and in every trainer, with one message."""
    with pytest.raises(ConfigError) as e:
        load_config(CONFIG, extra, world_size=world)
    assert needle in str(e.value) and "\n" not in str(e.value)
    cfg = load_config(CONFIG, extra)     # without the worker count: not checked yet
    with pytest.raises(ConfigError, match="pipeline schedule|world size|global_batch_size"):
        check_launch(cfg, world)


def test_rules_that_were_run_time_fail_at_load():
    with pytest.raises(ConfigError, match="training.stage dpo with model.mtp_num_layers"):
        load_config(CONFIG, ["--training.stage", "dpo", "--data.data_path", "x",
                             "--model.mtp_num_layers", "1"])
    with pytest.raises(ConfigError, match=r"--training.eval_interval: training.eval_interval "
                                          r"needs validation samples"):
        load_config(CONFIG, ["--training.eval_interval", "2", "--data.split", "100,0,0"])


def test_run_settings_key_beats_deprecated_variable(monkeypatch, caplog):
    monkeypatch.delenv("MS_LLM_COMM_THREAD", raising=False)
    environment.configure({})
    assert environment.setting("runtime.comm_thread") is True          # the default
    monkeypatch.setenv("MS_LLM_COMM_THREAD", "0")
    with caplog.at_level("WARNING", logger="ms_llm.environment"):
        assert environment.setting("runtime.comm_thread") is False     # the deprecated alias
    cfg = load_config(CONFIG, ["--runtime.comm_thread", "true", "--runtime.blas_threads", "1"])
    assert cfg.explicit_settings() == {"runtime.comm_thread": True, "runtime.blas_threads": 1}
    try:
        environment.configure(cfg.explicit_settings())
        assert environment.setting("runtime.comm_thread") is True      # the key wins
        assert environment.explicit("runtime.blas_threads")
    finally:
        environment.configure({})
    with pytest.raises(KeyError, match="not a run setting: runtime.nope"):
        environment.configure({"runtime.nope": 1})
    with pytest.raises(KeyError, match="MS_LLM_NOPE is not one of"):
        environment.variable("MS_LLM_NOPE")
    with pytest.raises(ConfigError, match="runtime.bf16_gemm must be one of auto, mkl"):
        load_config(CONFIG, ["--runtime.bf16_gemm", "fast"])


def test_every_ms_llm_variable_is_listed():
    """No module reads an MS_LLM_* variable that compat.environment does not list."""
    import re
    root = os.path.join(ROOT, "ms_llm")
    known = set(environment.VARIABLES) | {s.alias for s in environment.SETTINGS.values()}
    found = set()
    for folder, _, files in os.walk(root):
        for name in files:
            if name.endswith((".py", ".cpp", ".h")):
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    found |= set(re.findall(r"MS_LLM_[A-Z0-9_]*[A-Z0-9]", f.read()))
    assert found - known == set()
