"""Muon (``training.optimizer: muon``) against two independent references:

* a NumPy (float64) implementation of Megatron-Core's variant written here (``TensorParallelMuon``
  on NVIDIA emerging_optimizers: EMA momentum, optional Nesterov, decoupled weight decay,
  quintic Newton-Schulz, spectral scale, QKV split across query groups, one matrix per expert);
* ``torch.optim.Muon`` (torch 2.13) on the same matrices with the same lr adjustment
  (``adjust_lr_fn="original"`` = ``muon_scale_mode: shape_scaling``, its coefficients = ``simple``).

and through the trainer: param groups, exact resume (momentum in the checkpoint), the planner.
"""
from __future__ import annotations

import functools
import itertools
import json
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from mindspore import Parameter, Tensor

from ms_llm.optim import AdamW, Muon, param_groups
from ms_llm.optim.kinds import get_optimizer
from helpers.paths import ROOT

CFG = SimpleNamespace(num_attention_heads=4, num_query_groups=2, kv_channels=4, hidden_size=8,
                      moe_ffn_hidden_size=6)
SHAPES = {
    "decoder.layers.0.self_attention.linear_qkv.weight": (2 * (2 + 2) * 4, 8),  # [ng*(r+2)*d, h]
    "decoder.layers.0.self_attention.linear_proj.weight": (8, 16),
    "decoder.layers.0.mlp.linear_fc1.weight": (24, 8),                          # [gate; up]
    "decoder.layers.1.mlp.experts.weight1": (8, 2 * 12),                        # [H, E*2F]
    "decoder.layers.1.mlp.experts.weight2": (2 * 6, 8),                         # [E*F, H]
    "decoder.layers.1.mlp.router.weight": (2, 8),
    "decoder.final_layernorm.weight": (8,),
    "embedding.word_embeddings.weight": (20, 8),
}
# The reference's coefficient sets (emerging_optimizers muon_utils._COEFFICIENT_SETS).
QUINTIC = [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
           (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)]


def np_newton_schulz(x, steps=5, coeffs=QUINTIC):
    t = x.shape[0] > x.shape[1]
    x = x.T if t else x
    x = x / max(np.linalg.norm(x), 1e-15)
    for a, b, c in itertools.islice(itertools.cycle(coeffs), steps):
        g = x @ x.T
        x = a * x + (b * g + c * g @ g) @ x
    return x.T if t else x


def np_orthogonalize(name, u):
    """Megatron's matrix views, written from its description (not from ms_llm)."""
    spectral = lambda m: np_newton_schulz(m) * np.sqrt(max(m.shape))   # noqa: E731
    if name.endswith("linear_qkv.weight"):
        ng, r, d = 2, 2, 4
        per = u.reshape(ng, (r + 2) * d, -1)
        q, k, v = per[:, :r * d], per[:, r * d:(r + 1) * d], per[:, (r + 1) * d:]
        outs = [spectral(m.reshape(-1, u.shape[1])).reshape(ng, -1, u.shape[1])
                for m in (q, k, v)]
        return np.concatenate(outs, axis=1).reshape(u.shape)
    if name.endswith("experts.weight1"):          # expert e: u.flat[e] as [H, 2F]
        return np.stack([spectral(m) for m in u.reshape(2, 8, 12)]).reshape(u.shape)
    if name.endswith("experts.weight2"):          # expert e: [F, H]
        return np.stack([spectral(m) for m in u.reshape(2, 6, 8)]).reshape(u.shape)
    return spectral(u)


def np_adamw(p, m, v, g, t, lr, wd, b1=0.9, b2=0.95, eps=1e-8):
    m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
    p = p * (1 - lr * wd) - lr * (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps)
    return p, m, v


def _params(rng):
    return {n: rng.normal(scale=0.5, size=s) for n, s in SHAPES.items()}


def _run_both(steps, nesterov, lr=0.02, wd=0.1, mom=0.95, precision="highest"):
    rng = np.random.default_rng(0)
    init = _params(rng)
    named = [(n, Parameter(Tensor(v.astype(np.float32)), name=n)) for n, v in init.items()]
    opt = Muon(named, lr=lr, momentum=mom, nesterov=nesterov, weight_decay=wd,
               model_config=CFG, fp32_matmul_prec=precision,
               adam=functools.partial(AdamW, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd))
    ref = {n: v.copy() for n, v in init.items()}
    state = {n: [np.zeros_like(v), np.zeros_like(v)] for n, v in init.items()}
    muon = {n for n, p in named if param_groups.is_muon_matrix(n, p.ndim)}
    history = []
    for t in range(1, steps + 1):
        grads = {n: rng.normal(size=v.shape).astype(np.float32) for n, v in init.items()}
        opt.step([Tensor(grads[n]) for n, _ in named])
        for n, g in grads.items():
            g = g.astype(np.float64)
            wd_n = 0.0 if ref[n].ndim == 1 else wd
            if n in muon:
                buf = state[n][0] = mom * state[n][0] + (1 - mom) * g
                u = (1 - mom) * g + mom * buf if nesterov else buf
                ref[n] = ref[n] * (1 - lr * wd_n) - lr * np_orthogonalize(n, u)
            else:
                ref[n], state[n][0], state[n][1] = np_adamw(ref[n], *state[n], g, t, lr, wd_n)
        history.append({n: (p.asnumpy().copy(), ref[n].copy()) for n, p in named})
    return opt, init, history, muon


@pytest.mark.parametrize("nesterov", [False, True])
def test_muon_matches_numpy_megatron_variant(nesterov):
    """One step: each update within 1e-5 of the float64 reference (fp32 Newton-Schulz on O(1)
    matrices: ~1e-6 observed); 20 steps: parameters within 1e-4 (fp32 rounding carried through
    momentum and 20 updates of O(0.02))."""
    opt, init, history, muon = _run_both(20, nesterov)
    assert muon == {n for n in SHAPES if "layers.0" in n or "experts" in n}
    for n, (got, want) in history[0].items():
        np.testing.assert_allclose(got - init[n], want - init[n], atol=1e-5, err_msg=n)
    for n, (got, want) in history[-1].items():
        np.testing.assert_allclose(got, want, atol=1e-4, err_msg=n)
    assert set(opt.state_dict()) >= {f"momentum_buffer.{n}" for n in muon}
    assert opt.state_bytes()["momentum_buffer"] == 4 * sum(np.prod(SHAPES[n]) for n in muon)


def test_muon_bf16_newton_schulz_option():
    """``training.muon_fp32_matmul_prec: medium`` (bf16 GEMM operands in Newton-Schulz): one
    step's Muon updates within 5e-2 of the float64 reference's, relative to their largest
    element (the bf16 Newton-Schulz bound test_muon_kernel justifies), AdamW's as in fp32."""
    from ms_llm.ops.cpu_kernels.optimizer.muon_ns import bf16_ns_available
    if not bf16_ns_available()[0]:
        pytest.skip(bf16_ns_available()[1])
    _, init, history, muon = _run_both(1, False, precision="medium")
    for n, (got, want) in history[0].items():
        d, r = got - init[n], want - init[n]
        if n in muon:
            assert np.abs(d - r).max() <= 5e-2 * np.abs(r).max(), n
        else:
            np.testing.assert_allclose(d, r, atol=1e-5, err_msg=n)


def _qkv_parts(w):
    """Q, K, V matrices of a fused QKV weight (per-query-group rows: [q (r*d) | k (d) | v (d)])."""
    per = w.reshape(2, 16, -1)
    return [per[:, :8].reshape(-1, w.shape[-1]), per[:, 8:12].reshape(-1, w.shape[-1]),
            per[:, 12:].reshape(-1, w.shape[-1])]


def test_muon_matches_torch_optim_muon():
    """torch.optim.Muon on the same matrices (Q, K, V apart: ``muon_split_qkv``; fc1 whole) with
    its ``original`` lr adjustment (= ``muon_scale_mode: shape_scaling``) and coefficients
    (= ``simple``). torch runs Newton-Schulz in bfloat16 (``grad.bfloat16()``, 8-bit
    mantissa), ms-llm in fp32: the updates agree to bf16 precision, not fp32. bf16 against fp32
    Newton-Schulz alone differs by 1.4 % on a 16x8 matrix, and 1.5-3.3 % per update is observed
    here (the 8x8 K and V matrices are the noisiest), so each update's relative error must stay
    below 5 % (a wrong scale, split or momentum form is off by 30 % or more) over 20 steps; the
    fp32 equality is ``test_muon_matches_numpy_megatron_variant``'s."""
    rng = np.random.default_rng(3)
    names = ["decoder.layers.0.self_attention.linear_qkv.weight",
             "decoder.layers.0.self_attention.linear_proj.weight",
             "decoder.layers.0.mlp.linear_fc1.weight"]
    init = {n: rng.normal(scale=0.5, size=SHAPES[n]).astype(np.float32) for n in names}
    named = [(n, Parameter(Tensor(init[n].copy()), name=n)) for n in names]
    opt = Muon(named, lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1,
               coefficient_type="simple", scale_mode="shape_scaling", model_config=CFG)
    tmats = _qkv_parts(init[names[0]]) + [init[names[1]], init[names[2]]]
    tparams = [torch.tensor(m, requires_grad=True) for m in tmats]
    topt = torch.optim.Muon(tparams, lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1,
                            adjust_lr_fn="original")
    for step in range(20):
        grads = [rng.normal(size=SHAPES[n]).astype(np.float32) for n in names]
        before = [p.asnumpy().copy() for _, p in named]
        opt.step([Tensor(g) for g in grads])
        tbefore = [p.detach().clone() for p in tparams]
        for p, g in zip(tparams, _qkv_parts(grads[0]) + grads[1:]):
            p.grad = torch.tensor(g)
        topt.step()
        got = [p.asnumpy() - b for (_, p), b in zip(named, before)]
        got = _qkv_parts(got[0]) + got[1:]
        for g, p, b in zip(got, tparams, tbefore):
            want = (p.detach() - b).numpy()
            assert np.linalg.norm(g - want) / np.linalg.norm(want) < 5e-2, step
    final = _qkv_parts(named[0][1].asnumpy()) + [named[1][1].asnumpy(), named[2][1].asnumpy()]
    for f, p in zip(final, tparams):
        np.testing.assert_allclose(f, p.detach().numpy(), atol=2e-3)


CONFIG = os.path.join(ROOT, "configs", "tiny.yaml")


def test_muon_training_resumes_exactly_and_is_planned(tmp_path, capsys):
    """``training.optimizer: muon`` through the trainer: the groups are printed, the loss falls,
    the momentum buffers go through the checkpoint (2 steps + resume = 3 steps, bit-exact), and
    ``ms-llm plan`` counts one buffer per Muon element instead of AdamW's two moments."""
    from helpers.parallel_common import TINY_MODEL
    from ms_llm.config import load_config
    from ms_llm.planning.memory_plan import plan_memory
    from ms_llm.training.trainer import Trainer
    base = TINY_MODEL + ["--training.micro_batch_size", "2", "--training.global_batch_size", "4",
                         "--training.progress_bar", "false", "--training.lr_warmup_steps", "1",
                         "--training.lr", "3e-3", "--training.optimizer", "muon",
                         "--training.log_interval", "1", "--training.lr_decay_steps", "3"]

    def run(name, *extra):
        cfg = load_config(CONFIG, base + ["--training.output_dir", str(tmp_path / name), *extra])
        trainer = Trainer(cfg)
        return trainer, [r["loss"] for r in trainer.fit()]

    save = ["--checkpoint.save_dir", str(tmp_path / "ckpt")]
    _, first = run("first", "--training.max_steps", "2", *save)
    full, losses = run("full", "--training.max_steps", "3")
    rest, rest_losses = run("rest", "--training.max_steps", "3", "--training.resume", "auto",
                            *save)
    assert first + rest_losses == losses and losses[-1] < losses[0]
    for (n, a), (_, b) in zip(full.named_params, rest.named_params):
        np.testing.assert_array_equal(a.asnumpy(), b.asnumpy(), err_msg=n)
    out = capsys.readouterr()
    assert "param group muon:" in out.out + out.err
    opt = full.optimizer
    assert isinstance(opt, Muon) and opt.muon_idx and opt.adam_idx
    kinds = opt.state_bytes()
    cfg = load_config(CONFIG, base)
    plan = plan_memory(cfg, 1, model_config=full.cfg.model).stages[0]
    assert plan.optimizer == sum(kinds.values())


def test_muon_bad_options_are_refused_in_one_line():
    from ms_llm.config import ConfigError, load_config
    muon = ["--training.optimizer", "muon"]
    for extra, msg in ((["--training.muon_scale_mode", "rms"], "training.muon_scale_mode"),
                       (["--training.muon_tp_mode", "rows"], "training.muon_tp_mode"),
                       (["--training.muon_fp32_matmul_prec", "high"],
                        "training.muon_fp32_matmul_prec")):
        with pytest.raises(ConfigError) as e:
            load_config(CONFIG, muon + extra)
        assert msg in str(e.value) and "\n" not in str(e.value)
    for mode in ("blockwise", "duplicated", "distributed"):
        assert load_config(CONFIG, muon + ["--parallel.tensor_model_parallel_size", "2",
                                           "--training.muon_tp_mode", mode])


def test_muon_distributed_optimizer_refuses_an_empty_cut_in_one_line():
    """Under the distributed optimizer every rank of the group must hold rows of each Muon
    matrix (uneven cuts are fine); 5 rows over 4 ranks in chunks of 2 leave the last one empty:
    refused before any collective, the same on every rank (it depends on sizes only)."""
    from ms_llm.optim.muon_owners import refuse_empty_shards
    group = SimpleNamespace(size=4, rank=0)
    pstate = SimpleNamespace(sizes=SimpleNamespace(cp=1), group=lambda dim: group)

    def named(rows):
        return [("decoder.layers.0.mlp.linear_fc2.weight",
                 Parameter(Tensor(np.zeros((rows, 8), np.float32)), name="w"))]
    for rows, empty in ((5, True), (7, False), (4, False)):
        params = named(rows)
        groups = param_groups.assignment(
            param_groups.build_groups(params, get_optimizer("muon").rule))
        if not empty:
            refuse_empty_shards(params, groups, pstate)
            continue
        with pytest.raises(ValueError) as e:
            refuse_empty_shards(params, groups, pstate)
        assert "linear_fc2.weight's 5 rows cut over 4 ranks" in str(e.value)
        assert "\n" not in str(e.value)
