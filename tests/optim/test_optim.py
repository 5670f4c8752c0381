"""``ms_llm.optim``: the optimizer protocol, parameter groups by rule (Megatron's), per-group
multipliers against torch.optim.AdamW's param groups, the wrappers delegating to any optimizer,
and the planner asking the optimizer for its state size."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from mindspore import Parameter, Tensor

from ms_llm.optim import AdamW, MainParams, Optimizer, param_groups
from ms_llm.optim.build import state_elements
from ms_llm.optim.kinds import get_optimizer
from ms_llm.compat import bfloat16
from helpers.paths import ROOT


def _named(rng):
    shapes = {"decoder.layers.0.self_attention.linear_qkv.weight": (12, 8),
              "decoder.layers.0.self_attention.linear_qkv.bias": (12,),
              "decoder.layers.0.input_layernorm.weight": (8,),
              "decoder.layers.0.mlp.router.weight": (4, 8),
              "embedding.word_embeddings.weight": (16, 8)}
    return [(n, Parameter(Tensor(rng.normal(size=s).astype(np.float32)), name=n))
            for n, s in shapes.items()]


def test_param_groups_follow_megatrons_rule():
    named = _named(np.random.default_rng(0))
    groups = param_groups.build_groups(named, get_optimizer("adamw").rule)
    by = {g.label: g.names for g in groups}
    assert by == {"adamw": ["decoder.layers.0.self_attention.linear_qkv.weight",
                            "decoder.layers.0.mlp.router.weight",
                            "embedding.word_embeddings.weight"],
                  "adamw no-decay": ["decoder.layers.0.self_attention.linear_qkv.bias",
                                     "decoder.layers.0.input_layernorm.weight"]}
    muon = {g.label: g.names for g in param_groups.build_groups(named, get_optimizer("muon").rule)}
    # Muon on hidden matrices only: not the router, the embedding, norms or biases
    assert muon["muon"] == ["decoder.layers.0.self_attention.linear_qkv.weight"]
    lines = param_groups.describe(groups)
    assert lines[0].startswith("param group adamw: 3 tensors") and "weight decay x0" in lines[1]


def test_adamw_group_multipliers_match_torch_param_groups():
    """lr_mult / wd_mult per group equal torch.optim.AdamW with per-group lr and weight decay
    (fp32 vs torch's fp32: 1e-6 absolute after 3 steps of O(1e-2) updates)."""
    rng = np.random.default_rng(1)
    named = _named(rng)
    scale = lambda n, p: n.startswith("embedding")          # noqa: E731
    groups = param_groups.build_groups(named, "adamw", scale_lr=scale, lr_mult=0.5)
    assert {g.label for g in groups} == {"adamw", "adamw lr x0.5", "adamw no-decay"}
    tparams = {n: torch.tensor(p.asnumpy(), requires_grad=True) for n, p in named}
    opt = AdamW(named, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                groups=param_groups.assignment(groups))
    topt = torch.optim.AdamW([{"params": [tparams[n] for n in g.names], "lr": 1e-2 * g.lr_mult,
                               "weight_decay": 0.1 * g.wd_mult} for g in groups],
                             betas=(0.9, 0.95), eps=1e-8)
    for _ in range(3):
        grads = [rng.normal(size=p.shape).astype(np.float32) for _, p in named]
        opt.step([Tensor(g) for g in grads])
        for (n, _), g in zip(named, grads):
            tparams[n].grad = torch.tensor(g)
        topt.step()
    for n, p in named:
        np.testing.assert_allclose(p.asnumpy(), tparams[n].detach().numpy(), atol=1e-6)


@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_adamw_kernel_equals_mindsporess_adamweightdecay(threads, monkeypatch):
    """ms-llm's in-place CPU kernel (the default path here) against MindSpore's AdamWeightDecay
    on the same parameters (``_threads = 0``), 4 steps, shapes large enough to split over
    threads (2^20 elements): the same fp32 arithmetic per element, rounded differently where the
    compiler fuses a multiply-add: a few ulp of the O(1) values (|p| < 5: 1e-6 absolute)."""
    from ms_llm.optim.adamw import _cpu_kernel_threads
    rng = np.random.default_rng(2)
    shapes = [(1024, 1024), (7, 5), (1 << 19,)]
    init = [rng.normal(size=s).astype(np.float32) for s in shapes]
    runs = []
    for use_kernel in (True, False):
        named = [(f"p{i}", Parameter(Tensor(a.copy()), name=f"p{i}")) for i, a in enumerate(init)]
        opt = AdamW(named, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
        assert opt._threads == _cpu_kernel_threads([p for _, p in named]) > 0
        opt._threads = threads if use_kernel else 0
        grng = np.random.default_rng(3)
        for _ in range(4):
            opt.step([Tensor(grng.normal(size=s).astype(np.float32)) for s in shapes])
        runs.append([p.asnumpy() for _, p in named] + [m.asnumpy() for m in opt.exp_avg] +
                    [v.asnumpy() for v in opt.exp_avg_sq])
    assert any(not np.array_equal(a, b) for a, b in zip(runs[0], init))   # it did update
    for got, want in zip(*runs):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


def test_wrappers_speak_the_protocol():
    rng = np.random.default_rng(2)
    named = _named(rng)
    plain = AdamW(named)
    low = [(n, Parameter(p.astype(bfloat16), name=n)) for n, p in named]
    wrapped = MainParams(low, lambda nm: AdamW(nm, lr=1e-3))
    for opt in (plain, wrapped):
        assert isinstance(opt, Optimizer)
        assert opt.grad_sync is None and opt.step_count == 0
    qkv = low[0][1]
    main = wrapped.checkpoint_tensor(qkv)
    assert main.dtype != qkv.dtype and wrapped.params[0] is main
    assert [s.prefix for s in wrapped.state_tensors(qkv)] == ["optimizer.exp_avg.",
                                                              "optimizer.exp_avg_sq."]
    assert wrapped.state_bytes()["main_params"] == sum(int(p.size) * 4 for _, p in named)
    wrapped.step([Tensor(np.ones(p.shape, np.float32)) for _, p in named], lr=1e-3)
    assert wrapped.step_count == 1 and wrapped.inner.step_count == 1


def test_planner_asks_the_optimizer():
    from ms_llm.config import load_config
    import os
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), [])
    assert state_elements(cfg, "decoder.layers.0.mlp.linear_fc1.weight", (8, 4)) == 2
