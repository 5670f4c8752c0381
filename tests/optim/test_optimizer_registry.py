"""The optimizer registry (ms_llm.optim.kinds): generic code never names an optimizer, and a new
one is one registration -- SGD with momentum, written here, trains a tiny model through the
normal config and ``build_optimizer`` path, is planned by ``ms-llm plan`` with its own state
count, validated with the config and selected by MindSpeed's ``--optimizer sgd``."""
from __future__ import annotations

import functools
import os
from typing import Dict, List, Optional

import numpy as np
import pytest
from helpers.name_scan import names_written
from helpers.paths import ROOT

from ms_llm.optim.kinds import (OptimizerKind, get_optimizer, optimizer_names,
                                register_optimizer, unregister_optimizer)

CONFIG = os.path.join(ROOT, "configs", "tiny.yaml")
# Where an optimizer's name may be written: its registration, its own update rule's modules,
# and the support matrix's Muon column (a row of what ``ms-llm qualify`` runs, like a test).
OWNERS = ("optim/kinds/", "optim/adamw.py", "optim/muon.py", "optim/muon_owners.py",
          "optim/muon_tp.py", "optim/newton_schulz.py", "qualify/matrix.py")
MOMENTUM = 0.9
# the architecture flags a Megatron line must give here (Megatron's defaults are not built)
MEGATRON = ["--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu"]


def test_generic_code_never_names_an_optimizer():
    assert {"adamw", "muon"} <= set(optimizer_names())
    found = names_written(optimizer_names(), OWNERS)
    assert not found, found


class SGD:
    """Heavy-ball SGD (torch.optim.SGD's rule, no dampening): ``buf = mu * buf + g``,
    ``p -= lr * lr_mult * buf``; written against the ``Optimizer`` protocol only. It records the
    gradients and learning rates it was given so the test can replay them in NumPy."""
    grad_sync = None

    def __init__(self, named_params, lr: float, groups):
        from mindspore import Parameter
        from ms_llm.compat import zeros
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.groups = list({id(g): g for g in (groups[n] for n in self.names)}.values())
        self.lr_mult = [groups[n].lr_mult for n in self.names]
        self.lr, self.step_count = lr, 0
        self.buf = [Parameter(zeros(p.shape), name=f"momentum.{n}", requires_grad=False)
                    for n, p in named_params]
        self._slot = {id(p): i for i, p in enumerate(self.params)}
        self.seen: List[tuple] = []     # (lr, [grad arrays]) per step

    def step(self, grads, lr: Optional[float] = None) -> None:
        from mindspore import Tensor
        lr = self.lr if lr is None else lr
        self.step_count += 1
        g_np = [g.asnumpy().astype(np.float32) for g in grads]
        self.seen.append((lr, g_np))
        for p, b, g, m in zip(self.params, self.buf, g_np, self.lr_mult):
            nb = MOMENTUM * b.asnumpy() + g
            b.set_data(Tensor(nb))
            p.set_data(Tensor((p.asnumpy() - np.float32(lr * m) * nb).astype(np.float32)))

    def state_tensors(self, param):
        from ms_llm.optim.base import StateTensor
        from ms_llm.parallel.placement import placement_of
        i = self._slot.get(id(param))
        return [] if i is None else [StateTensor("optimizer.momentum.", self.buf[i],
                                                 placement_of(param))]

    def checkpoint_tensor(self, param):
        return param

    def load_finished(self) -> None:
        pass

    def state_bytes(self) -> Dict[str, int]:
        return {"momentum": sum(int(b.size) * 4 for b in self.buf), "main_params": 0}

    def state_dict(self) -> Dict[str, np.ndarray]:
        return {f"momentum.{n}": b.asnumpy() for n, b in zip(self.names, self.buf)}

    def load_state_dict(self, state, source: str = "optimizer state") -> None:
        from mindspore import Tensor
        for n, b in zip(self.names, self.buf):
            if f"momentum.{n}" not in state:
                raise KeyError(f"{source}: missing 'momentum.{n}'")
            b.set_data(Tensor(state[f"momentum.{n}"]))


def _no_bf16(cfg):
    if cfg.training.bf16:
        return ("training.optimizer", "training.bf16"), \
            "training.optimizer sgd with training.bf16: not built (this test's optimizer)"
    return None


@pytest.fixture
def sgd():
    kind = register_optimizer(OptimizerKind(
        name="sgd", title="SGD with momentum",
        build=lambda cfg, groups, pstate, model_config: functools.partial(
            SGD, lr=cfg.training.lr, groups=groups),
        state_elements=lambda name, shape: 1, validate=_no_bf16,
        megatron_names={"sgd": {}}))
    yield kind
    unregister_optimizer("sgd")


@pytest.mark.slow      # one tiny trainer, 2 steps: 37-49 s measured at load 15-17 on 2 cores
def test_a_new_optimizer_is_one_registration(sgd, tmp_path):
    from helpers.parallel_common import TINY_MODEL
    from ms_llm.config import load_config
    from ms_llm.planning.memory_plan import plan_memory
    from ms_llm.training.trainer import Trainer
    args = TINY_MODEL + ["--training.micro_batch_size", "2", "--training.global_batch_size", "2",
                         "--training.progress_bar", "false", "--training.lr_warmup_steps", "0",
                         "--training.lr", "1e-2", "--training.optimizer", "sgd",
                         "--training.max_steps", "2", "--training.lr_decay_steps", "2",
                         "--training.log_interval", "1", "--training.peak_tflops", "1",
                         "--training.output_dir", str(tmp_path)]
    cfg = load_config(CONFIG, args)
    trainer = Trainer(cfg)
    before = {n: p.asnumpy().copy() for n, p in trainer.named_params}
    records = trainer.fit()
    opt = trainer.optimizer
    assert isinstance(opt, SGD) and opt.step_count == 2 and len(records) == 2
    assert all(np.isfinite(r["loss"]) for r in records)
    # The model moved by exactly this rule, from the gradients and learning rates it was given
    # (NumPy replay; fp32 both ways, same order of operations: 1e-7 relative).
    bufs = {n: np.zeros_like(v) for n, v in before.items()}
    want = dict(before)
    for lr, grads in opt.seen:
        for n, g, m in zip(opt.names, grads, opt.lr_mult):
            bufs[n] = MOMENTUM * bufs[n] + g
            want[n] = (want[n] - np.float32(lr * m) * bufs[n]).astype(np.float32)
    moved = 0
    for n, p in trainer.named_params:
        np.testing.assert_allclose(p.asnumpy(), want[n], rtol=1e-6, atol=1e-7, err_msg=n)
        moved += not np.array_equal(p.asnumpy(), before[n])
    assert moved == len(opt.names)
    # ms-llm plan counts the registration's one state value per element
    plan = plan_memory(cfg, 1, model_config=trainer.cfg.model).stages[0]
    assert plan.optimizer == sum(opt.state_bytes().values())


def test_a_registered_optimizer_is_validated_and_selected_by_megatron_flags(sgd):
    from ms_llm.config import ConfigError, load_config
    from ms_llm.config.help import schema_help
    from ms_llm.mindspeed.flags import translate
    with pytest.raises(ConfigError) as e:
        load_config(CONFIG, ["--training.optimizer", "sgd", "--training.bf16", "true"])
    assert "training.optimizer sgd with training.bf16: not built" in str(e.value)
    assert "\n" not in str(e.value)
    assert "one of adamw, muon, sgd" in schema_help()
    tr = translate(MEGATRON + ["--optimizer", "sgd"])
    assert tr.keys["training.optimizer"] == "sgd"
    with pytest.raises(ConfigError, match=r"--optimizer lion: not supported \(adam, muon, "
                                          r"dist_muon and sgd are built\)"):
        translate(MEGATRON + ["--optimizer", "lion"])
    assert get_optimizer("sgd") is sgd


def test_unregistered_names_are_refused_in_one_line():
    from ms_llm.config import ConfigError, load_config
    assert "sgd" not in optimizer_names()
    with pytest.raises(ConfigError) as e:
        load_config(CONFIG, ["--training.optimizer", "sgd"])
    assert "training.optimizer must be one of adamw, muon, got 'sgd'" in str(e.value)
    with pytest.raises(ValueError, match="'muon' is already registered"):
        register_optimizer(OptimizerKind(name="muon", title="x", build=None,
                                         state_elements=None))
    with pytest.raises(ValueError, match="--optimizer word adam is already adamw's"):
        register_optimizer(OptimizerKind(name="adam2", title="x", build=None,
                                         state_elements=None, megatron_names={"adam": {}}))


def test_the_registry_imports_no_mindspore():
    """The config schema validates through the registrations in every ``--help`` path, which
    must not pay for importing MindSpore (the classes are imported when a run builds one)."""
    import subprocess
    import sys
    code = ("import sys, ms_llm.config, ms_llm.optim.kinds, ms_llm.mindspeed.flag_table; "
            "from ms_llm.config.help import schema_help; schema_help(); "
            "print('mindspore' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
