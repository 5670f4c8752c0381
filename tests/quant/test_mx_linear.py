"""mx_linear's forward and gradients against the explicit recipe, MXFP8 modules and
``apply_quantization``.

The reference quantizes with the independent spec implementation in ``helpers.mx_reference`` and
multiplies in float64. Tolerance 1e-5 relative to the largest entry: the only difference left is
fp32 accumulation over K <= 128 products (~1e-6 relative), the quantized operands are identical.
"""
import dataclasses
import numpy as np
import pytest
import mindspore as ms
from mindspore import Parameter, Tensor, mint

from helpers.mx_reference import assert_close, qd
from ms_llm.compat import nn
from ms_llm.compat.environment import configure
from ms_llm.config import load_config
from ms_llm.models import GPTModel
from ms_llm.quant import (MXFP8GroupedLinear, MXFP8Linear, apply_quantization, kept_unaligned,
                          mx_linear)
from ms_llm.quant import _dispatch


@pytest.mark.parametrize("elem,mode", [("float8_e4m3fn", "floor"), ("float8_e5m2", "rceil")])
def test_mx_linear_matches_recipe(elem, mode):
    rng = np.random.default_rng(3)
    B, S, K, N = 2, 25, 96, 64          # M = 50 tokens: not a multiple of 32 (padded in wgrad)
    x = rng.standard_normal((B, S, K)).astype(np.float32) * 3
    w = (rng.standard_normal((N, K)) * 0.05).astype(np.float32)
    b = rng.standard_normal(N).astype(np.float32)
    g = rng.standard_normal((B, S, N)).astype(np.float32)
    wp, bp = Parameter(Tensor(w), name="w"), Parameter(Tensor(b), name="b")

    def loss(xt):
        return (mx_linear(xt, wp, bp, scale_mode=mode, elem_dtype=elem) * Tensor(g)).sum()
    y = mx_linear(Tensor(x), wp, bp, scale_mode=mode, elem_dtype=elem).asnumpy()
    _, (dx, (dw, db)) = ms.value_and_grad(loss, grad_position=0, weights=[wp, bp])(Tensor(x))
    x2, g2 = x.reshape(-1, K), g.reshape(-1, N)
    y_ref = qd(x2, -1, elem, mode) @ qd(w, -1, elem, mode).T + b
    dx_ref = qd(g2, -1, elem, mode) @ qd(w, 0, elem, mode)          # dY, W along N
    dw_ref = qd(g2, 0, elem, mode).T @ qd(x2, 0, elem, mode)        # dY, X along M
    assert y.shape == (B, S, N)
    assert_close(y.reshape(-1, N), y_ref, "forward")
    assert_close(dx.asnumpy().reshape(-1, K), dx_ref, "dgrad")
    assert_close(dw.asnumpy(), dw_ref, "wgrad")
    assert_close(db.asnumpy(), g2.sum(0), "bias grad")
    # The recipe is not the unquantized linear (the test would pass vacuously otherwise).
    assert np.abs(dw_ref - g2.T.astype(np.float64) @ x2).max() > 1e-3 * np.abs(dw_ref).max()


class _TwoLayer(nn.Module):
    def __init__(self, bias):
        super().__init__()
        self.a = MXFP8Linear.from_float(nn.Linear(64, 96, bias=bias), name="a")
        self.b = MXFP8Linear.from_float(nn.Linear(96, 64, bias=bias), name="b")

    def forward(self, x):
        return (self.b(mint.nn.functional.silu(self.a(x))) ** 2).sum()


def test_jit_equals_pynative():
    """The default config trains under mindspore.jit: the custom backward must compile there
    and give exactly the PyNative numbers."""
    x = Tensor(np.random.default_rng(0).standard_normal((2, 20, 64)).astype(np.float32))
    for bias in (False, True):
        net = _TwoLayer(bias)
        gf = ms.value_and_grad(net, None, net.trainable_params())
        l1, g1 = gf(x)
        l2, g2 = ms.jit(gf)(x)
        assert float(l1) == float(l2)
        for a, b in zip(g1, g2):
            assert np.array_equal(a.asnumpy(), b.asnumpy())
        assert all(np.abs(a.asnumpy()).max() > 0 for a in g1)


def test_bf16_inputs_and_bad_shapes():
    w = Parameter(Tensor(np.random.default_rng(1).standard_normal((64, 32)).astype(np.float32))
                  .astype(ms.bfloat16), name="w")
    x = Tensor(np.ones((4, 32), np.float32)).astype(ms.bfloat16)
    _, (dx, (dw,)) = ms.value_and_grad(lambda t: mx_linear(t, w).astype(ms.float32).sum(),
                                       grad_position=0, weights=[w])(x)
    assert dx.dtype == ms.bfloat16 and dw.dtype == ms.bfloat16
    with pytest.raises(ValueError, match="multiples of 32"):
        mx_linear(Tensor(np.ones((4, 48), np.float32)), Tensor(np.ones((64, 48), np.float32)))
    with pytest.raises(ValueError, match="quant: module 'odd'"):
        MXFP8Linear.from_float(nn.Linear(64, 40), name="odd")


def test_grouped_experts_match_per_expert_recipe():
    rng = np.random.default_rng(5)
    E, K, N, sizes = 3, 64, 32, [7, 0, 20]
    src = nn.Module()
    src.weight = Parameter(Tensor((rng.standard_normal((E, N, K)) * 0.1).astype(np.float32)),
                           name="weight")
    mod = MXFP8GroupedLinear.from_float(src, name="experts")
    assert mod.weight is src.weight
    x = rng.standard_normal((sum(sizes), K)).astype(np.float32)
    g = rng.standard_normal((sum(sizes), N)).astype(np.float32)
    loss = lambda t: (mod(t, sizes) * Tensor(g)).sum()  # noqa: E731
    _, (dx, (dw,)) = ms.value_and_grad(loss, grad_position=0, weights=[mod.weight])(Tensor(x))
    w = src.weight.asnumpy()
    start = 0
    for e, n in enumerate(sizes):
        xe, ge = x[start:start + n], g[start:start + n]
        if n:
            e4 = ("float8_e4m3fn", "floor")
            assert_close(dx.asnumpy()[start:start + n], qd(ge, -1, *e4) @ qd(w[e], 0, *e4),
                         f"dx{e}")
            assert_close(dw.asnumpy()[e], qd(ge, 0, *e4).T @ qd(xe, 0, *e4), f"dw{e}")
        else:
            assert np.all(dw.asnumpy()[e] == 0)
        start += n
    with pytest.raises(ValueError, match="tokens_per_expert"):
        mod(Tensor(x), [1, 2, 3])


def _tiny_cfg(*extra):
    return load_config(None, ["--model.family", "qwen3", "--model.num_layers", "2",
                              "--model.hidden_size", "64", "--model.ffn_hidden_size", "96",
                              "--model.num_attention_heads", "4", "--model.num_query_groups", "2",
                              "--model.kv_channels", "16", "--model.padded_vocab_size", "256",
                              "--model.untie_embeddings_and_output_weights", "true", *extra])


def test_apply_quantization_selection_and_errors(caplog):
    cfg = _tiny_cfg()
    model = GPTModel(cfg.model)
    assert apply_quantization(model, cfg.quant) == []            # recipe unset: no-op
    before = dict(model.named_parameters())
    quant = dataclasses.replace(cfg.quant, recipe="mxfp8",   # the loaded config is frozen
                                ignored_modules=["*.linear_proj"])
    with caplog.at_level("INFO", logger="ms_llm.quant"):
        names = apply_quantization(model, quant)
    assert names == [f"decoder.layers.{i}.{m}" for i in range(2)
                     for m in ("self_attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2")]
    assert "emulated path" in caplog.text and names[0] in caplog.text
    after = dict(model.named_parameters())
    assert list(after) == list(before) and all(after[k] is before[k] for k in before)
    assert not isinstance(model.output_layer, MXFP8Linear)             # never by default
    assert not isinstance(model.decoder.layers[1].self_attention.linear_proj, MXFP8Linear)
    assert isinstance(model.decoder.layers[1].mlp.linear_fc2, MXFP8Linear)

    bad = [({"apply_modules": ["decoder.layers.*.mlp.nope"]},
            "pattern 'decoder.layers.*.mlp.nope'"),
           ({"ignored_modules": ["typo*"]}, "quant.ignored_modules: pattern 'typo\\*'"),
           ({"recipe": "mxfp4"}, "quant.recipe"),
           ({"scale_mode": "ceil"}, "quant.scale_mode"),
           ({"apply_modules": ["output_layer"]}, "selects no module")]
    for over, msg in bad:
        c = dataclasses.replace(_tiny_cfg().quant, **{"recipe": "mxfp8", **over})
        m = GPTModel(cfg.model)
        with pytest.raises(ValueError, match=msg):
            apply_quantization(m, c)
    # A selected module whose dims are not multiples of 32: quant.mx_unaligned error names the
    # module and replaces nothing; keep (the default) leaves it in high precision and lists it.
    odd = GPTModel(_tiny_cfg("--model.ffn_hidden_size", "80").model)
    c = dataclasses.replace(_tiny_cfg().quant, recipe="mxfp8", mx_unaligned="error")
    msg = ("'decoder.layers.0.mlp.linear_fc2' has in_features=80.*multiple of 32.*"
           "quant.mx_unaligned: keep")
    with pytest.raises(ValueError, match=msg):
        apply_quantization(odd, c)
    assert not any(isinstance(x, MXFP8Linear) for _, x in odd.cells_and_names())
    names = apply_quantization(odd, dataclasses.replace(c, mx_unaligned="keep"))
    fc2 = [f"decoder.layers.{i}.mlp.linear_fc2" for i in range(2)]
    assert kept_unaligned(odd) == fc2 and not set(fc2) & set(names)
    assert isinstance(odd.decoder.layers[0].mlp.linear_fc1, MXFP8Linear)     # 2x80 rows
    assert not isinstance(odd.decoder.layers[0].mlp.linear_fc2, MXFP8Linear)


def test_dispatch_is_emulated_here(monkeypatch, caplog):
    assert _dispatch.resolve_mx_path() == "emulated"
    monkeypatch.setattr(_dispatch, "_STATE", {})
    configure({"quant.mx_path": "native"})     # the key, as the trainer hands it down
    try:
        with pytest.raises(RuntimeError, match="quant.mx_path native.*not Ascend"):
            _dispatch.resolve_mx_path()
    finally:
        configure({})
    monkeypatch.setattr(_dispatch, "_STATE", {})
    monkeypatch.setenv("MS_LLM_MX_PATH", "fast")    # the deprecated alias is still read
    with caplog.at_level("WARNING", logger="ms_llm.environment"), \
            pytest.raises(ValueError, match="quant.mx_path"):
        _dispatch.resolve_mx_path()
    assert "MS_LLM_MX_PATH is deprecated: set quant.mx_path" in caplog.text


def test_quantized_model_trains_like_fp32():
    """A few AdamW steps on a fixed batch: the MXFP8 model's loss tracks the fp32 one (the full
    200-step acceptance comparison is ``benchmarks/mx.py --train``)."""
    from ms_llm.compat import manual_seed
    from mindspore.experimental.optim import AdamW
    cfg = _tiny_cfg()
    ids = Tensor(np.random.default_rng(0).integers(0, 256, (4, 32)).astype(np.int32))
    losses = {}
    for recipe in (None, "mxfp8"):
        manual_seed(7)
        model = GPTModel(cfg.model)
        apply_quantization(model, dataclasses.replace(cfg.quant, recipe=recipe))
        params = model.trainable_params()
        opt = AdamW(params, lr=3e-3)
        gf = ms.value_and_grad(lambda t: model(t, labels=t).mean(), None, params)
        hist = []
        for _ in range(8):
            loss, grads = gf(ids)
            opt(grads)
            hist.append(float(loss))
        losses[recipe] = hist
    base, mx = np.array(losses[None]), np.array(losses["mxfp8"])
    assert base[-1] < base[0] - 1.0 and np.all(np.isfinite(mx))
    assert abs(mx[-1] - base[-1]) / base[-1] < 0.03, (base, mx)
    assert not np.array_equal(base, mx)                         # quantization did something
