"""Activation recompute of FSDP units (``ms_llm.parallel.fsdp.recompute``), single process.

FSDP over the one-process world group runs the whole unit path (flat gather, freed storage,
pre-backward refill, reduce-scatter into the gradient views); the recomputed layers must give the
same loss and gradients as the plain, unsharded model without recompute. Same kernels in the same
order, so rtol 1e-6 (they come out bit-equal). The msrun run (fsdp=2 + full recompute against
fsdp=2 and one process) is in tests/test_fsdp.py.
"""
import numpy as np
import pytest


def _setup():
    import mindspore as ms
    from mindspore import Tensor
    from ms_llm.compat import manual_seed
    from ms_llm.models import GPTModel, TransformerConfig
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                            num_query_groups=2, ffn_hidden_size=48, padded_vocab_size=37,
                            untie_embeddings_and_output_weights=True)
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


def _shard(model):
    from ms_llm.parallel import comm
    from ms_llm.parallel.fsdp import fully_shard
    units = [model.embedding] + list(model.decoder.layers) + [model.output_layer]
    for u in units:
        fully_shard(u, comm.world_group())
    fully_shard(model, comm.world_group(), reshard_after_forward=False)
    return units


def test_recomputed_fsdp_units_match_plain_model():
    from ms_llm.parallel.fsdp.recompute import recompute_marker
    from ms_llm.parallel.recompute import apply_recompute
    build, grads = _setup()
    want_loss, want = grads(build())
    model = build()
    _shard(model)
    names = apply_recompute([model], "full", "uniform", mark=recompute_marker([model]))
    assert names == ["decoder.layers.0", "decoder.layers.1"]
    calls = []     # the MLP runs twice per layer and step: forward, and again in backward
    model.decoder.layers[0].mlp.register_forward_pre_hook(lambda cell, args: calls.append(1))
    for step in range(2):       # the second step reuses the units (storage refilled, re-freed)
        loss, got = grads(model)
        np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
        assert set(got) == set(want)
        for k, w in want.items():
            np.testing.assert_allclose(got[k], w, rtol=1e-6, atol=1e-7, err_msg=k)
        assert len(calls) == 2 * (step + 1), calls


@pytest.mark.parametrize("what", ["norm", "layer_not_unit"])
def test_unbuilt_recompute_under_fsdp_is_a_clear_error(what):
    """A recomputed module whose weights an enclosing unit gathers would need them as explicit
    inputs too: refused with one line naming the case."""
    from ms_llm.parallel import comm
    from ms_llm.parallel.fsdp import fully_shard
    from ms_llm.parallel.fsdp.recompute import recompute_marker
    from ms_llm.parallel.recompute import apply_recompute
    build, _ = _setup()
    model = build()
    if what == "norm":
        _shard(model)
        args = dict(granularity=None, norm=True)
    else:                         # only the root is a unit: layers' weights are the root's
        fully_shard(model, comm.world_group())
        args = dict(granularity="full", method="uniform")
    with pytest.raises(ValueError, match="holds FSDP-sharded weights.*not built yet") as e:
        apply_recompute([model], mark=recompute_marker([model]), **args)
    assert "\n" not in str(e.value)
