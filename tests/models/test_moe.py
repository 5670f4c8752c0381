"""Dropless MoE layer and the ``qwen3-moe`` family against independent references.

* A tiny HF Qwen3-MoE checkpoint (8 experts, top-2, 3 layers with layer 1 dense through
  ``mlp_only_layers``) is written with HF's key names and ``config.json`` fields
  (tests/helpers/qwen3_moe_checkpoint.py). Its logits and per-layer router choices are
  compared with a float64 NumPy forward of HF's ``Qwen3MoeForCausalLM``
  (tests/helpers/moe_reference.py, from the HF modeling semantics: ``Qwen3MoeSparseMoeBlock``:
  ``softmax(gate(x))`` -> top-k -> divide by their sum if ``norm_topk_prob`` -> weighted sum of
  ``down(silu(gate_proj x) * up_proj x)``). Tolerance 1e-4 (fp32 vs float64 over 3 layers; the
  measured error is ~1e-6). Router choices must be identical; the reference's gap between the
  k-th and (k+1)-th probability is asserted > 1e-4 first so the comparison is well posed.
* Auxiliary losses against NumPy formulas: HF's ``load_balancing_loss_func`` (layers pooled) and
  Megatron's per-layer ``switch_load_balancing_loss_func`` + ``z_loss_func`` (rtol 1e-5: fp32
  reductions of O(10) terms).
* Gradients of one MoE layer (router, experts, shared expert and its gate, input) against torch
  float64 autograd of the same HF semantics (rtol 1e-4), on a batch small enough that some experts
  receive no token: their gradients must be exactly zero and all others non-zero.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor

from helpers.moe_reference import softmax
from helpers.qwen3_moe_checkpoint import (AUX_COEF, D, E, FFN, FM, H, K, NG, NH, V,
                                          reference_forward, write_qwen3_moe)
from ms_llm.checkpoint.hf.pretrained import experts_to_grouped
from ms_llm.compat import load_state_dict, manual_seed
from ms_llm.models import GPTModel, TransformerConfig, config_from_hf
from ms_llm.checkpoint import from_pretrained
from ms_llm.models import moe
from ms_llm.models.layers import MLP
from ms_llm import ops as hot
from ms_llm.ops import moe as moe_ops


# ----------------------------------------------------------------------------- NumPy reference
def hf_load_balancing_loss(routing) -> float:
    """HF ``load_balancing_loss_func`` (no attention mask): layers' router logits concatenated."""
    logits = np.concatenate([routing[i][0] for i in sorted(routing)])
    probs = softmax(logits)
    top = np.argsort(-probs, -1, kind="stable")[:, :K]
    mask = np.eye(E)[top]                                   # [N, k, E]
    tokens_per_expert = mask.mean(0)                        # [k, E]
    router_prob_per_expert = probs.mean(0)                  # [E]
    return float(np.sum(tokens_per_expert * router_prob_per_expert[None]) * E)


def megatron_aux_losses(routing, coef, z_coef) -> float:
    """Megatron: per layer coef * E / (k T^2) * sum_e (sum_t p_te) * count_e, plus
    z_coef * mean_t logsumexp(logits_t)^2; summed over layers."""
    total = 0.0
    for logits, top, probs in routing.values():
        t = logits.shape[0]
        counts = np.bincount(top.ravel(), minlength=E)
        total += coef * E / (K * t * t) * np.sum(probs.sum(0) * counts)
        m = logits.max(-1)
        lse = m + np.log(np.exp(logits - m[:, None]).sum(-1))
        total += z_coef * np.mean(lse ** 2)
    return float(total)


def top_gap(probs) -> float:
    srt = -np.sort(-probs, -1)
    return float((srt[:, K - 1] - srt[:, K]).min())


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_qwen3_moe_from_hf_matches_numpy(tmp_path, norm_topk_prob):
    w = write_qwen3_moe(tmp_path / "hf", norm_topk_prob, seed=1 if norm_topk_prob else 2)
    ids = np.random.default_rng(3).integers(0, V, (2, 12)).astype(np.int32)
    ref_logits, routing = reference_forward(w, ids, norm_topk_prob)
    for i, (_, _, probs) in routing.items():
        assert top_gap(probs) > 1e-4, f"layer {i}: near-tie in the reference routing"

    layouts = [False, True] if norm_topk_prob else [False]  # GroupedMLP layout once
    for grouped in layouts:
        cfg = config_from_hf(json.load(open(tmp_path / "hf" / "config.json")))
        cfg = cfg.replace(moe_grouped_gemm=grouped, moe_z_loss_coeff=1e-3)
        model = from_pretrained(str(tmp_path / "hf"), config=cfg)
        keys = dict(model.named_parameters())
        assert type(model.decoder.layers[1].mlp) is MLP                    # mlp_only_layers
        assert "decoder.layers.0.mlp.router.weight" in keys
        if grouped:
            assert keys["decoder.layers.2.mlp.experts.weight1"].shape == (H, E * 2 * FM)
            assert keys["decoder.layers.2.mlp.experts.weight2"].shape == (E * FM, H)
        else:
            fc1 = keys["decoder.layers.2.mlp.experts.local_experts.5.linear_fc1.weight"].asnumpy()
            p = "model.layers.2.mlp.experts.5."
            np.testing.assert_array_equal(fc1, np.concatenate([w[p + "gate_proj.weight"],
                                                               w[p + "up_proj.weight"]]))
        logits = model(Tensor(ids)).asnumpy()
        err = np.abs(logits - ref_logits).max()
        assert err < 1e-4 * max(1.0, np.abs(ref_logits).max()), (grouped, err)
        for i, (_, top, _) in routing.items():
            got = model.decoder.layers[i].mlp.last_top_indices.asnumpy()
            np.testing.assert_array_equal(got, top, err_msg=f"layer {i} router choices")
        np.testing.assert_allclose(float(moe.hf_load_balancing_loss(model).asnumpy()),
                                   hf_load_balancing_loss(routing), rtol=1e-5)
        np.testing.assert_allclose(float(model.aux_loss().asnumpy()),
                                   megatron_aux_losses(routing, AUX_COEF, 1e-3), rtol=1e-5)


def test_config_from_hf_sparse_step_and_errors():
    base = {"model_type": "qwen3_moe", "num_hidden_layers": 4, "hidden_size": H,
            "intermediate_size": FFN, "num_attention_heads": NH, "num_key_value_heads": NG,
            "head_dim": D, "vocab_size": V, "num_experts": E, "num_experts_per_tok": K,
            "moe_intermediate_size": FM, "norm_topk_prob": True}
    c = config_from_hf({**base, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert c.moe_layer_pattern == [0, 1, 0, 0] and c.mlp_type == "moe" and c.qk_layernorm
    assert [c.is_moe_layer(i) for i in range(4)] == [False, True, False, False]
    assert not c.moe_router_pre_softmax and c.moe_ffn_hidden_size == FM
    assert config_from_hf({**base, "norm_topk_prob": False}).moe_router_pre_softmax
    with pytest.raises(ValueError, match="missing key 'num_experts'"):
        config_from_hf({k: v for k, v in base.items() if k != "num_experts"})
    with pytest.raises(ValueError, match="no sparse layer"):
        config_from_hf({**base, "mlp_only_layers": [0, 1, 2, 3]})
    small = dict(num_layers=2, hidden_size=H, num_attention_heads=NH, mlp_type="moe")
    for bad, msg in [(dict(), "num_moe_experts must be set"),
                     (dict(num_moe_experts=4, moe_router_topk=5), "moe_router_topk"),
                     (dict(num_moe_experts=4, moe_router_enable_expert_bias=True), "sigmoid"),
                     (dict(num_moe_experts=4, moe_layer_pattern=[1]), "moe_layer_pattern"),
                     (dict(num_moe_experts=4, moe_router_load_balancing_type="sinkhorn"),
                      "load_balancing_type")]:
        with pytest.raises(ValueError, match=msg):
            TransformerConfig(**small, **bad)
    four = {**small, "num_layers": 4}
    assert TransformerConfig(**four, num_moe_experts=4, moe_layer_freq=2).is_moe_layer(2)
    assert not TransformerConfig(**four, num_moe_experts=4, moe_layer_freq=2).is_moe_layer(1)
    # index num_layers is the first MTP layer: built like the last decoder layer (1: dense)
    assert not TransformerConfig(**small, num_moe_experts=4, moe_layer_freq=2).is_moe_layer(2)


def test_grouped_matmul_forms_and_permutation():
    rng = np.random.default_rng(0)
    sizes = [3, 0, 5, 1, 0, 2]
    n, kin, kout = sum(sizes), 6, 4
    x = rng.standard_normal((n, kin)).astype(np.float32)
    w_t = rng.standard_normal((len(sizes), kout, kin)).astype(np.float32)   # [E, M, K]
    ends = np.cumsum(sizes)
    ref = np.concatenate([x[e0:e1] @ w_t[e].T for e, (e0, e1)
                          in enumerate(zip(ends - sizes, ends))])
    for impl in ("loop", "padded_bmm"):
        for weight, tb in [(Tensor(w_t), True), ([Tensor(m) for m in w_t], True),
                           (Tensor(np.ascontiguousarray(w_t.transpose(0, 2, 1))), False)]:
            got = moe_ops.grouped_matmul(Tensor(x), weight, sizes, transpose_b=tb, impl=impl)
            np.testing.assert_allclose(got.asnumpy(), ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="add up to 11, x has 12 rows"):
        moe_ops.grouped_matmul(Tensor(np.zeros((12, kin), np.float32)), Tensor(w_t), sizes,
                               transpose_b=True)
    with pytest.raises(RuntimeError, match="needs an Ascend device"):
        moe_ops.grouped_matmul(Tensor(x), Tensor(w_t), sizes, transpose_b=True, impl="native")
    # Sort by expert: expert-major, slot order inside an expert; restore inverts it.
    top = rng.integers(0, 5, (7, 2)).astype(np.int32)
    slots, restore, counts = moe_ops.sort_by_expert(Tensor(top), 5)
    np.testing.assert_array_equal(slots.asnumpy(), np.argsort(top.ravel(), kind="stable"))
    np.testing.assert_array_equal(restore.asnumpy()[slots.asnumpy()], np.arange(14))
    assert counts == np.bincount(top.ravel(), minlength=5).tolist()


def _torch_moe_block(tw, x, norm_topk_prob, z_coef, aux_coef):
    """HF Qwen2-MoE-style block (Qwen3-MoE experts + a sigmoid-gated shared expert) in torch
    float64, plus Megatron's aux + z losses; returns (out, aux)."""
    import torch
    logits = x @ tw["router"].T
    probs = torch.softmax(logits, -1)
    wts, top = torch.topk(probs, K, -1)
    if norm_topk_prob:
        wts = wts / wts.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for e in range(E):
        rows, slot = torch.nonzero(top == e, as_tuple=True)
        if rows.numel():
            h = x[rows] @ tw[f"fc1_{e}"].T
            y = (torch.nn.functional.silu(h[:, :FM]) * h[:, FM:]) @ tw[f"fc2_{e}"].T
            out = out.index_add(0, rows, y * wts[rows, slot][:, None])
    hs = x @ tw["sfc1"].T
    shared = (torch.nn.functional.silu(hs[:, :FFN]) * hs[:, FFN:]) @ tw["sfc2"].T
    out = out + torch.sigmoid(x @ tw["sgate"].T) * shared
    counts = torch.bincount(top.reshape(-1), minlength=E).to(x.dtype)
    t = x.shape[0]
    aux = aux_coef * E / (K * t * t) * (probs.sum(0) * counts).sum()
    aux = aux + z_coef * (torch.logsumexp(logits, -1) ** 2).mean()
    return out, aux, top


@pytest.mark.parametrize("impl,grouped", [("loop", False), ("padded_bmm", False),
                                          ("loop", True), ("padded_bmm", True),
                                          ("fused", False), ("fused", True)])
def test_moe_layer_grads_vs_torch(impl, grouped):
    """``loop`` / ``padded_bmm``: the composed ops throughout (``composed_only``); ``fused``:
    the fused CPU kernels (sort, permute, expert FFN, combine), same reference."""
    if impl == "fused" and not moe_ops.fused_available():
        pytest.skip("the fused MoE kernels need the CPU BLAS kernel library")
    torch = pytest.importorskip("torch")
    cfg = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=NH,
                            ffn_hidden_size=FFN, padded_vocab_size=V, mlp_type="moe",
                            num_moe_experts=E, moe_router_topk=K, moe_ffn_hidden_size=FM,
                            moe_shared_expert_intermediate_size=FFN, moe_shared_expert_gate=True,
                            moe_aux_loss_coeff=0.05, moe_z_loss_coeff=0.01)
    seq_layer = moe.MoELayer(cfg)
    rng = np.random.default_rng(7)
    sd = {n: rng.standard_normal(p.shape).astype(np.float32) * 0.3
          for n, p in seq_layer.named_parameters()}
    if grouped:   # the same experts in Megatron's GroupedMLP layout (weight1/weight2)
        layer = moe.MoELayer(cfg.replace(moe_grouped_gemm=True))
        gsd = experts_to_grouped({"mlp." + k: v for k, v in sd.items()}, E)
        load_state_dict(layer, {k[len("mlp."):]: v for k, v in gsd.items()})
    else:
        layer = seq_layer
        load_state_dict(layer, sd)
    layer.experts.gmm_impl = impl
    params = dict(layer.named_parameters())
    # 3 tokens x top-2 reach at most 6 of the 8 experts.
    x = rng.standard_normal((1, 3, H)).astype(np.float32)
    dy = rng.standard_normal((1, 3, H)).astype(np.float32)

    def loss(inp):
        return (layer(inp) * Tensor(dy)).sum() + layer.router.aux_loss
    weights = list(params.values())
    if impl == "fused":
        val, (gx, gws) = ms.value_and_grad(loss, 0, weights)(Tensor(x))
    else:
        with moe_ops.composed_only():
            val, (gx, gws) = ms.value_and_grad(loss, 0, weights)(Tensor(x))
    grads = dict(zip(params, (g.asnumpy() for g in gws)))
    if grouped:   # back to per-expert [out, in] gradients
        g1 = grads.pop("experts.weight1").reshape(E, H, 2 * FM)
        g2 = grads.pop("experts.weight2").reshape(E, FM, H)
        for e in range(E):
            grads[f"experts.local_experts.{e}.linear_fc1.weight"] = g1[e].T
            grads[f"experts.local_experts.{e}.linear_fc2.weight"] = g2[e].T

    tw = {"router": sd["router.weight"], "sfc1": sd["shared_experts.linear_fc1.weight"],
          "sfc2": sd["shared_experts.linear_fc2.weight"], "sgate": sd["shared_experts.gate_weight"]}
    for e in range(E):
        tw[f"fc1_{e}"] = sd[f"experts.local_experts.{e}.linear_fc1.weight"]
        tw[f"fc2_{e}"] = sd[f"experts.local_experts.{e}.linear_fc2.weight"]
    tw = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in tw.items()}
    tx = torch.tensor(x[0], dtype=torch.float64, requires_grad=True)
    out, aux, top = _torch_moe_block(tw, tx, True, 0.01, 0.05)
    tloss = (out * torch.tensor(dy[0], dtype=torch.float64)).sum() + aux
    tloss.backward()

    np.testing.assert_array_equal(layer.last_top_indices.asnumpy(), top.numpy())
    np.testing.assert_allclose(float(val.asnumpy()), tloss.item(), rtol=1e-5)
    scale = lambda a: 1e-4 * max(1.0, np.abs(a).max())  # noqa: E731
    np.testing.assert_allclose(gx.asnumpy()[0], tx.grad.numpy(), atol=scale(tx.grad.numpy()))
    names = {"router": "router.weight", "sfc1": "shared_experts.linear_fc1.weight",
             "sfc2": "shared_experts.linear_fc2.weight", "sgate": "shared_experts.gate_weight"}
    names.update({f"fc{j}_{e}": f"experts.local_experts.{e}.linear_fc{j}.weight"
                  for e in range(E) for j in (1, 2)})
    used = set(top.numpy().ravel().tolist())
    assert len(used) < E, "the test needs experts without tokens"
    for tk, mk in names.items():
        g = tw[tk].grad   # None: torch never used the tensor (an expert without tokens)
        ref = np.zeros(tuple(tw[tk].shape)) if g is None else g.numpy()
        np.testing.assert_allclose(grads[mk], ref, atol=scale(ref), err_msg=mk)
        if tk.startswith("fc"):
            e = int(tk.split("_")[1])
            if e in used:
                assert np.abs(grads[mk]).max() > 0, f"{mk}: no gradient though routed to"
            else:
                assert not np.any(grads[mk]), f"{mk}: gradient without tokens"


def test_sigmoid_router_with_expert_bias_and_update():
    cfg = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=NH,
                            padded_vocab_size=V, mlp_type="moe", num_moe_experts=E,
                            moe_router_topk=K, moe_router_score_function="sigmoid",
                            moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.1,
                            moe_router_topk_scaling_factor=2.5)
    router = moe.TopKRouter(cfg)
    router.set_train(True)
    rng = np.random.default_rng(4)
    w = rng.standard_normal((E, H)).astype(np.float32)
    bias = rng.uniform(-0.3, 0.3, E).astype(np.float32)
    load_state_dict(router, {"weight": w, "expert_bias": bias})
    assert not router.expert_bias.requires_grad
    x = rng.standard_normal((16, H)).astype(np.float32)
    probs, idx = router(Tensor(x))
    s = 1.0 / (1.0 + np.exp(-(x.astype(np.float64) @ w.T)))
    top = np.argsort(-(s + bias), -1, kind="stable")[:, :K]        # bias only for the choice
    wts = np.take_along_axis(s, top, -1)
    wts = wts / wts.sum(-1, keepdims=True) * 2.5
    np.testing.assert_array_equal(idx.asnumpy(), top)
    np.testing.assert_allclose(probs.asnumpy(), wts, rtol=1e-5)
    # Aux-loss-free update: bias += rate * sign(mean(count) - count).
    counts = np.bincount(top.ravel(), minlength=E).astype(np.float64)
    moe.update_expert_bias(router)
    np.testing.assert_allclose(router.expert_bias.asnumpy(),
                               bias + 0.1 * np.sign(counts.mean() - counts), rtol=1e-6)
    assert not router.local_tokens_per_expert.any()


def test_moe_model_trains_and_rejects_jit(tmp_path, monkeypatch):
    cfg = TransformerConfig(num_layers=2, hidden_size=H, num_attention_heads=NH,
                            ffn_hidden_size=FFN, padded_vocab_size=V, mlp_type="moe",
                            num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=FM,
                            moe_aux_loss_coeff=0.01, moe_layer_freq=2)
    model = GPTModel(cfg)
    assert isinstance(model.decoder.layers[0].mlp, moe.MoELayer)
    assert not isinstance(model.decoder.layers[1].mlp, moe.MoELayer)
    ids = Tensor(np.random.default_rng(0).integers(0, V, (2, 8)).astype(np.int32))
    params = model.trainable_params()

    def loss(t):
        return model(t, labels=t).mean() + model.aux_loss()
    grad_fn = ms.value_and_grad(loss, None, params)
    l0, grads = grad_fn(ids)
    assert model.aux_loss() is not None and np.isfinite(float(l0.asnumpy()))
    router_g = dict(zip([p.name for p in params], grads))["decoder.layers.0.mlp.router.weight"]
    assert np.abs(router_g.asnumpy()).max() > 0
    assert GPTModel(cfg.replace(mlp_type="dense")).aux_loss() is None

    def step(t):
        return grad_fn(t)[0]
    monkeypatch.chdir(tmp_path)   # a failed compile writes rank_0/om/analyze_fail.ir to the cwd
    with pytest.raises(RuntimeError, match="runs in PyNative only"):
        ms.jit(step)(ids)


@pytest.mark.parametrize("grouped", [False, True])
def test_qwen3_moe_from_megatron_folder(tmp_path, grouped):
    """HF -> Megatron (tp 2, ep 2, per-expert or grouped-GEMM files) with the converter, then
    ``from_pretrained`` on the Megatron folder gives the HF model's logits and routing."""
    from ms_llm.checkpoint.convert import main as convert_main
    w = write_qwen3_moe(tmp_path / "hf", True, seed=1)
    mg = tmp_path / "mg"
    args = ["--load-model-type", "hf", "--save-model-type", "mg", "--model-type-hf", "qwen3-moe",
            "--load-dir", str(tmp_path / "hf"), "--save-dir", str(mg),
            "--target-tensor-parallel-size", "2", "--target-expert-parallel-size", "2"]
    assert convert_main(args + (["--moe-grouped-gemm"] if grouped else [])) == 0
    ids = np.random.default_rng(3).integers(0, V, (2, 12)).astype(np.int32)
    ref_logits, routing = reference_forward(w, ids, True)
    model = from_pretrained(str(mg))
    logits = model(Tensor(ids)).asnumpy()
    assert logits.shape[-1] >= V   # a Megatron folder keeps its padded vocabulary
    np.testing.assert_allclose(logits[..., :V], ref_logits, atol=1e-4 * np.abs(ref_logits).max())
    for i, (_, top, _) in routing.items():
        np.testing.assert_array_equal(model.decoder.layers[i].mlp.last_top_indices.asnumpy(), top)


def test_mxfp8_experts_run_their_own_forward():
    """quant.recipe mxfp8 replaces the experts' linears; the layer must then call them (a
    grouped matmul over their raw weights would silently skip the quantization)."""
    from types import SimpleNamespace
    from ms_llm.quant import MXFP8Linear, apply_quantization
    from ms_llm.parallel import comm
    from ms_llm.parallel.expert_parallel import apply_expert_parallel
    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=2,
                            ffn_hidden_size=64, padded_vocab_size=64, mlp_type="moe",
                            num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32)
    manual_seed(0)
    model = GPTModel(cfg)
    ids = Tensor(np.random.default_rng(0).integers(0, 64, (2, 8)).astype(np.int32))
    plain = model(ids).asnumpy()
    names = apply_quantization(model, SimpleNamespace(recipe="mxfp8", scale_mode="floor",
                                                      elem_dtype="float8_e4m3fn",
                                                      apply_modules=[], ignored_modules=[]))
    assert any(".experts.local_experts.3.linear_fc1" in n for n in names)
    experts = model.decoder.layers[0].mlp.experts
    assert type(experts.local_experts[0].linear_fc1) is MXFP8Linear
    assert not experts.plain_linears()
    quant = model(ids).asnumpy()
    x = Tensor(np.random.default_rng(1).standard_normal((10, 64)).astype(np.float32))
    sizes = [4, 0, 5, 1]
    got = experts(x, sizes).asnumpy()
    want, start = [], 0
    for e, n in enumerate(sizes):   # each quantized expert module on its own rows
        if n:
            mod = experts.local_experts[e]
            want.append(mod.linear_fc2(hot.swiglu(mod.linear_fc1(x[start:start + n]))).asnumpy())
        start += n
    np.testing.assert_array_equal(got, np.concatenate(want))
    assert np.abs(quant - plain).max() > 1e-4          # the experts are really quantized
    with pytest.raises(ValueError, match="megamoe"):
        apply_expert_parallel(model, comm.world_group(), dispatcher="megamoe")


def test_mxfp8_grouped_experts_equal_per_expert_mxfp8():
    """GroupedMLP under quant.recipe mxfp8 becomes MXFP8GroupedMLP (same Parameters). Each
    expert's GEMMs must be exactly what the per-expert MXFP8Linear modules of the
    SequentialMLP layout compute on the same weights (same recipe, same blocks): outputs and
    gradients bit-identical."""
    from types import SimpleNamespace
    from ms_llm.quant import MXFP8GroupedMLP, apply_quantization
    def quant(pattern):
        return SimpleNamespace(recipe="mxfp8", scale_mode="floor", elem_dtype="float8_e4m3fn",
                               apply_modules=[pattern], ignored_modules=[])
    base = dict(num_layers=1, hidden_size=64, num_attention_heads=2, ffn_hidden_size=64,
                padded_vocab_size=64, mlp_type="moe", num_moe_experts=4, moe_router_topk=2,
                moe_ffn_hidden_size=32)
    manual_seed(0)
    seq = GPTModel(TransformerConfig(**base)).decoder.layers[0].mlp.experts
    grouped = GPTModel(TransformerConfig(**base, moe_grouped_gemm=True)).decoder.layers[0]
    fc1 = [e.linear_fc1.weight.asnumpy() for e in seq.local_experts]      # [2F, H] each
    fc2 = [e.linear_fc2.weight.asnumpy() for e in seq.local_experts]      # [H, F] each
    g = grouped.mlp.experts
    g.weight1.set_data(Tensor(np.ascontiguousarray(np.stack([w.T for w in fc1])).reshape(64, -1)))
    g.weight2.set_data(Tensor(np.ascontiguousarray(np.stack([w.T for w in fc2])).reshape(-1, 64)))
    w1_param = g.weight1
    assert len(apply_quantization(seq, quant("local_experts.*"))) == 8
    names = apply_quantization(grouped, quant("mlp.experts"))
    assert names == ["mlp.experts"]
    experts = grouped.mlp.experts
    assert type(experts) is MXFP8GroupedMLP and experts.weight1 is w1_param
    x = Tensor(np.random.default_rng(3).standard_normal((9, 64)).astype(np.float32))
    dy = Tensor(np.random.default_rng(4).standard_normal((9, 64)).astype(np.float32))
    sizes = [3, 0, 5, 1]
    res = []
    for mod in (seq, experts):
        params = mod.trainable_params()
        _, (dx, grads) = ms.value_and_grad(lambda v, m=mod: (m(v, sizes) * dy).sum(), 0,
                                           params)(x)
        res.append((mod(x, sizes).asnumpy(), dx.asnumpy(), [gr.asnumpy() for gr in grads]))
    (y_s, dx_s, g_s), (y_g, dx_g, g_g) = res
    assert np.abs(y_s).max() > 0
    np.testing.assert_array_equal(y_g, y_s)
    np.testing.assert_array_equal(dx_g, dx_s)
    d_fc1, d_fc2 = g_s[0::2], g_s[1::2]      # sequential params: fc1, fc2 per expert
    np.testing.assert_array_equal(g_g[0], np.stack([d.T for d in d_fc1]).reshape(64, -1))
    np.testing.assert_array_equal(g_g[1], np.stack([d.T for d in d_fc2]).reshape(-1, 64))
