"""Activation recompute (training.recompute_*): the same numbers with less kept in memory.

Recomputing runs the same kernels on the same inputs, so losses and gradient norms must be
identical to the run without it (rtol 1e-7: float32 identity, allowing only the printing of
Python floats); MoE routing is re-run in backward and must be counted once."""
import numpy as np
import mindspore as ms
import pytest
from mindspore import Tensor

from helpers.parallel_common import BASE, CONFIG, MOE, MOE_DEAD

from ms_llm.config import ConfigError, load_config
from ms_llm.models import GPTModel
from ms_llm.models.config import TransformerConfig
from ms_llm.models.moe import collect_router_counts, moe_layers
from ms_llm.parallel.recompute import apply_recompute
from ms_llm.training.trainer import Trainer

FULL = ["--training.recompute_granularity", "full"]


def _curve(tmp_path, *extra):
    cfg = load_config(CONFIG, BASE + ["--model.num_layers", "3", "--training.max_steps", "3",
                                      "--training.jit", "false", "--training.output_dir",
                                      str(tmp_path / "out")] + list(extra))
    recs = Trainer(cfg).fit()
    return [r["loss"] for r in recs] + [r["grad_norm"] for r in recs]


@pytest.mark.parametrize("extra", [
    FULL + ["--training.recompute_method", "uniform"],
    FULL + ["--training.recompute_method", "block", "--training.recompute_num_layers", "1",
            "--training.recompute_norm", "true"],
    ["--training.recompute_norm", "true"],
    ["--training.recompute_granularity", "selective"],
])
def test_recompute_gives_the_same_curve(tmp_path, extra):
    np.testing.assert_allclose(_curve(tmp_path, *extra), _curve(tmp_path), rtol=1e-7)


def test_moe_recompute_same_curve_and_counts_once(tmp_path):
    np.testing.assert_allclose(_curve(tmp_path, *MOE, *MOE_DEAD, *FULL),
                               _curve(tmp_path, *MOE, *MOE_DEAD), rtol=1e-7)
    # The bias update only sees the counts' signs around their mean, so check them directly:
    # after one forward + backward with the layers recomputed, every router holds exactly
    # tokens x top-k routed slots.
    cfg = TransformerConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128,
                            num_attention_heads=4, num_query_groups=2, kv_channels=16,
                            padded_vocab_size=97, mlp_type="moe", num_moe_experts=4,
                            moe_router_topk=2, moe_ffn_hidden_size=32,
                            moe_router_score_function="sigmoid",
                            moe_router_enable_expert_bias=True)
    model = GPTModel(cfg)
    model.set_train(True)
    names = apply_recompute([model], "full", "uniform")
    assert names == ["decoder.layers.0", "decoder.layers.1"]
    ids = Tensor(np.arange(24).reshape(2, 12).astype(np.int32) % 97)
    grad = ms.value_and_grad(lambda t: model(t, labels=t).sum(), None, model.trainable_params())
    grad(ids)
    collect_router_counts(model)
    for layer in moe_layers(model):
        assert layer.router.local_tokens_per_expert.sum() == 24 * 2


def test_recompute_config_errors(tmp_path):
    # (recompute with FSDP is built: tests/parallel/test_fsdp_recompute.py,
    # tests/parallel/test_fsdp.py)
    cases = [(FULL + ["--training.recompute_method", "block"], "recompute_num_layers")]
    for extra, msg in cases:
        with pytest.raises((ConfigError, ValueError), match=msg):
            cfg = load_config(CONFIG, BASE + ["--training.jit", "false"] + extra)
            from ms_llm.parallel.parallelize import parallelize_model
            from ms_llm.parallel.state import ParallelSizes, ParallelState
            parallelize_model(GPTModel(cfg.model), cfg, ParallelState(
                ParallelSizes(world=1), rank=0).build_groups())
    with pytest.raises(ConfigError, match="training.recompute_granularity must be null or one of full, selective"):
        load_config(CONFIG, BASE + ["--training.recompute_granularity", "some"])


def test_full_recompute_keeps_the_moe_aux_loss_gradient():
    """With an auxiliary (and z-) loss the router is left out of the recomputed parts: every
    gradient, the routers' included, equals the run without recompute (rtol 1e-6: the same
    kernels on the same inputs). Recomputing the whole layer lost the aux loss's gradient
    (PyNative's recompute runs the first forward without gradient)."""
    cfg = TransformerConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128,
                            num_attention_heads=4, num_query_groups=2, kv_channels=16,
                            padded_vocab_size=97, mlp_type="moe", num_moe_experts=4,
                            moe_router_topk=2, moe_ffn_hidden_size=32,
                            moe_aux_loss_coeff=0.5, moe_z_loss_coeff=0.1,
                            moe_shared_expert_intermediate_size=32)
    ids = Tensor(np.arange(24).reshape(2, 12).astype(np.int32) % 97)

    weights = {n: p.asnumpy().copy() for n, p in GPTModel(cfg).parameters_and_names()}

    def grads(recompute):
        model = GPTModel(cfg)
        for n, p in model.parameters_and_names():
            p.set_data(Tensor(weights[n]))
        model.set_train(True)
        if recompute:
            names = apply_recompute([model], "full", "uniform")
            assert "decoder.layers.0.mlp.experts" in names and \
                not any(n.endswith("router") or n == "decoder.layers.0" for n in names)
        params = model.trainable_params()

        def loss_fn(t):
            return model(t, labels=t).sum() + model.aux_loss()

        _, g = ms.value_and_grad(loss_fn, None, params)(ids)
        return {p.name: x.asnumpy() for p, x in zip(params, g)}

    plain, recomputed = grads(False), grads(True)
    assert any("router" in n for n in plain)
    for name, g in plain.items():
        assert np.abs(g).max() > 0 or "expert_bias" in name, name
        np.testing.assert_allclose(recomputed[name], g, rtol=1e-6, atol=1e-9, err_msg=name)
