"""Activation recompute of FSDP units (``ms_llm.parallel.fsdp.recompute``), single process.

FSDP over the one-process world group runs the whole unit path (flat gather, freed storage,
pre-backward refill, reduce-scatter into the gradient views); the recomputed modules must give
the same loss and gradients as the plain, unsharded model without recompute. Same kernels in the
same order, so rtol 1e-6 (they come out bit-equal). The msrun run (fsdp=2 + full recompute against
fsdp=2 and one process) is in tests/parallel/test_fsdp.py.
"""
import numpy as np
import pytest


def _setup(moe=False):
    import mindspore as ms
    from mindspore import Tensor
    from ms_llm.compat import manual_seed
    from ms_llm.models import GPTModel, TransformerConfig
    extra = dict(mlp_type="moe", num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16,
                 moe_aux_loss_coeff=0.0) if moe else {}
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                            num_query_groups=2, ffn_hidden_size=48, padded_vocab_size=37,
                            untie_embeddings_and_output_weights=True, **extra)
    ids = Tensor(np.random.default_rng(0).integers(0, 37, (2, 8)).astype(np.int32))

    def build():
        manual_seed(0)
        m = GPTModel(cfg)
        m.set_train(True)
        return m

    def grads(model):
        params = model.trainable_params()
        fn = ms.value_and_grad(lambda t: model(t, labels=t).sum(), None, params)
        loss, g = fn(ids)
        return float(loss.asnumpy()), {p.name: x.asnumpy() for p, x in zip(params, g)}
    return build, grads


def _shard(model, ignored=()):
    from ms_llm.parallel import comm
    from ms_llm.parallel.fsdp import fully_shard
    units = [model.embedding] + list(model.decoder.layers) + [model.output_layer]
    for u in units:
        fully_shard(u, comm.world_group(), ignored_params=ignored)
    fully_shard(model, comm.world_group(), reshard_after_forward=False, ignored_params=ignored)
    return units


@pytest.mark.parametrize("what", ["full", "norm", "full_unsharded_param", "moe"])
def test_recompute_under_fsdp_matches_plain_model(what):
    """``full``: whole units re-run; ``norm``: RMSNorms inside the units (their weights are the
    unit's gathered tensors); ``full_unsharded_param``: a unit also holding a parameter FSDP
    leaves whole, which reaches the re-run as the Parameter itself; ``moe``: MoE layers, whose
    expert weights FSDP leaves to expert parallel (aux loss coefficient 0: recompute's no-grad
    forward drops the routers' aux-loss gradient, with or without FSDP, a separate issue)."""
    from ms_llm.models.moe import moe_layers
    from ms_llm.parallel.fsdp.recompute import check_recompute_under_fsdp, recompute_under_fsdp
    from ms_llm.parallel.recompute import apply_recompute
    build, grads = _setup(moe=what == "moe")
    want_loss, want = grads(build())
    model = build()
    args = dict(granularity=None, norm=True) if what == "norm" else \
        dict(granularity="full", method="uniform")
    names = apply_recompute([model], mark=recompute_under_fsdp, **args)
    assert len(names) == (4 if what == "norm" else 2), names
    layer0 = model.decoder.layers[0]
    ignored = [layer0.mlp.linear_fc1.weight] if what == "full_unsharded_param" else []
    if what == "moe":
        ignored = [p for layer in moe_layers(model) for p in layer.experts.trainable_params()]
        assert ignored
    _shard(model, ignored)
    check_recompute_under_fsdp([model])
    calls = []     # the module runs twice per step: in forward, and again in backward
    # (a norm has no sub-module to watch: watch its recompute cell, called in both passes)
    probe = layer0.pre_mlp_layernorm._fsdp_recompute.rerun if what == "norm" else layer0.mlp
    probe.register_forward_pre_hook(lambda cell, args: calls.append(1))
    after_norm = []   # inside the unit, after the recomputed norm ran: still the gathered weight
    layer0.mlp.register_forward_pre_hook(lambda cell, args: after_norm.append(
        type(layer0.pre_mlp_layernorm.weight).__name__))
    for step in range(2):       # the second step reuses the units (storage refilled, re-freed)
        loss, got = grads(model)
        np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
        assert set(got) == set(want)
        for k, w in want.items():
            np.testing.assert_allclose(got[k], w, rtol=1e-6, atol=1e-7, err_msg=k)
        assert len(calls) == 2 * (step + 1), calls
    assert after_norm and "Parameter" not in after_norm, after_norm


def test_recompute_around_a_unit_is_a_clear_error():
    """A recomputed layer containing an FSDP unit would gather it again in its re-run: refused
    with one line naming both."""
    from ms_llm.parallel import comm
    from ms_llm.parallel.fsdp import fully_shard
    from ms_llm.parallel.fsdp.recompute import check_recompute_under_fsdp, recompute_under_fsdp
    from ms_llm.parallel.recompute import apply_recompute
    build, _ = _setup()
    model = build()
    apply_recompute([model], "full", "uniform", mark=recompute_under_fsdp)
    fully_shard(model.decoder.layers[1].mlp, comm.world_group())
    fully_shard(model, comm.world_group())
    with pytest.raises(ValueError, match="decoder.layers.1 contains the FSDP unit "
                                         "decoder.layers.1.mlp.*not built yet") as e:
        check_recompute_under_fsdp([model])
    assert "\n" not in str(e.value)
