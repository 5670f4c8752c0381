"""The chunked output layer + cross entropy (``model.cross_entropy_loss_fusion``,
``ms_llm.ops.fused_cross_entropy``): values and gradients against a float64 NumPy reference
written here, in PyNative and under ``mindspore.jit``, on the AOT kernels and on the composed
fallback; the model and the trainer with the flag against the plain head; the config refusals.

Tolerances: the op computes in fp32 (GEMMs with fp32 accumulation over H <= 64 terms, softmax
statistics in fp32), so it matches float64 to a few fp32 ulps: 1e-5 relative to the largest
value of each tensor (measured 1e-7 .. 2e-6). Against the plain head (the same fp32 math in
another order and chunking) the same 1e-5 bound holds for losses, gradients and AdamW steps.
"""
import numpy as np
import pytest
import mindspore as ms
from mindspore import Parameter, Tensor

from helpers.parallel_common import CONFIG, TINY_MODEL
from ms_llm.config import ConfigError, load_config
from ms_llm.ops import fused_linear_cross_entropy
from ms_llm.ops.cpu_kernels.model import composed
from ms_llm.ops.fused_cross_entropy import chunk_tokens_for

RTOL = 1e-5


def reference(h, w, labels, dloss):
    """float64: per-token loss, dL/dh and dL/dW of sum(loss * dloss)."""
    h64, w64 = h.reshape(-1, h.shape[-1]).astype(np.float64), w.astype(np.float64)
    lab = labels.reshape(-1)
    keep = lab != -100
    safe = np.where(keep, lab, 0)
    logits = h64 @ w64.T
    m = logits.max(-1, keepdims=True)
    lse = np.log(np.exp(logits - m).sum(-1)) + m[:, 0]
    rows = np.arange(len(lab))
    loss = np.where(keep, lse - logits[rows, safe], 0.0)
    d = np.exp(logits - lse[:, None])
    d[rows, safe] -= 1.0
    d *= (dloss.reshape(-1) * keep)[:, None]
    return loss.reshape(labels.shape), (d @ w64).reshape(h.shape), d.T @ h64


def _close(got, want, what):
    err = np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max()
    assert err < RTOL, f"{what}: relative error {err:.3g}"


def _data(seed=0, b=2, s=35, hdim=24, vocab=101):
    rng = np.random.default_rng(seed)
    h = rng.standard_normal((b, s, hdim)).astype(np.float32)
    w = (rng.standard_normal((vocab, hdim)) * 0.3).astype(np.float32)
    labels = rng.integers(0, vocab, size=(b, s)).astype(np.int32)
    labels[0, :5] = -100                      # ignored tokens: loss 0, no gradient
    dloss = rng.standard_normal((b, s)).astype(np.float32)   # any per-token upstream gradient
    return h, w, labels, dloss


def test_op_matches_float64_pynative_and_jit():
    h, w, labels, dloss = _data()
    want_loss, want_dh, want_dw = reference(h, w, labels, dloss)
    weight = Parameter(Tensor(w), name="w")
    for chunk in (16, 32, 128):          # uneven last chunk (70 rows), several, and one chunk
        def f(x, y, s, chunk=chunk):
            return (fused_linear_cross_entropy(x, weight, y, chunk_tokens=chunk) * s).sum()
        loss = fused_linear_cross_entropy(Tensor(h), weight, Tensor(labels), chunk_tokens=chunk)
        assert loss.shape == labels.shape and loss.dtype == ms.float32
        _close(loss.asnumpy(), want_loss, f"loss (chunk {chunk})")
        _, (dh, (dw,)) = ms.value_and_grad(f, grad_position=0, weights=[weight])(
            Tensor(h), Tensor(labels), Tensor(dloss))
        _close(dh.asnumpy(), want_dh, f"dh (chunk {chunk})")
        _close(dw.asnumpy(), want_dw, f"dW (chunk {chunk})")

    def f16(x, y, s):
        return (fused_linear_cross_entropy(x, weight, y, chunk_tokens=16) * s).sum()
    grad_fn = ms.value_and_grad(f16, grad_position=0, weights=[weight])

    def step(x, y, s):
        return grad_fn(x, y, s)
    _, (dh, (dw,)) = ms.jit(step)(Tensor(h), Tensor(labels), Tensor(dloss))
    _close(dh.asnumpy(), want_dh, "dh (jit)")
    _close(dw.asnumpy(), want_dw, "dW (jit)")


def test_composed_fallback_matches_float64():
    """The kernels' composed forms (used without the AOT library) on one chunk."""
    h, w, labels, dloss = _data(seed=1)
    h2, lab = h.reshape(-1, h.shape[-1]), labels.reshape(-1)
    want_loss, want_dh, _ = reference(h, w, labels, dloss)
    logits = Tensor(h2 @ w.T)
    loss, lse = composed.cross_entropy_lse(logits, Tensor(lab))
    _close(loss.asnumpy(), want_loss.reshape(-1), "composed loss")
    dlogits = composed.cross_entropy_grad(logits, Tensor(lab), lse, Tensor(dloss.reshape(-1)))
    _close(dlogits.asnumpy() @ w, want_dh.reshape(h2.shape), "composed dlogits @ W")


def test_chunk_size_rule():
    assert chunk_tokens_for(32000) == 256          # 32 MiB of fp32 logits, multiple of 16
    assert chunk_tokens_for(10 ** 7) == 16         # never below 16 tokens


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_model_with_fusion_matches_plain_head(tied, monkeypatch):
    """The whole model: per-token losses and every parameter's gradient, both heads, with the
    80 tokens in 5 chunks of 16."""
    from ms_llm.models import GPTModel
    from ms_llm.ops import fused_cross_entropy as fce
    monkeypatch.setattr(fce, "CHUNK_BYTES", 16 * 4 * 97)
    assert fce.chunk_tokens_for(97) == 16
    from ms_llm.models.config import TransformerConfig
    base = dict(num_layers=1, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                num_query_groups=2, padded_vocab_size=97,
                untie_embeddings_and_output_weights=not tied)
    rng = np.random.default_rng(3)
    ids = Tensor(rng.integers(0, 97, size=(2, 40)).astype(np.int32))
    labels = rng.integers(0, 97, size=(2, 40)).astype(np.int32)
    labels[1, -4:] = -100
    scale = Tensor(rng.standard_normal((2, 40)).astype(np.float32))
    out = {}
    for fused in (False, True):
        ms.set_seed(11)
        np.random.seed(11)
        model = GPTModel(TransformerConfig(**base, cross_entropy_loss_fusion=fused))
        if fused:                                  # identical weights
            for p, q in zip(model.trainable_params(), out[False][2]):
                p.set_data(Tensor(q))
        params = model.trainable_params()

        def f(x, y, s, model=model):
            return (model(x, labels=y) * s).sum()
        per_tok = model(ids, labels=Tensor(labels)).asnumpy()
        _, grads = ms.value_and_grad(f, None, params)(ids, Tensor(labels), scale)
        out[fused] = (per_tok, [g.asnumpy() for g in grads], [p.asnumpy() for p in params])
    np.testing.assert_allclose(out[True][0], out[False][0], rtol=RTOL, atol=1e-6)
    for g1, g0 in zip(out[True][1], out[False][1]):
        _close(g1, g0.astype(np.float64), "model gradient")


def test_trainer_with_fusion_matches_and_refusals(tmp_path):
    from ms_llm.training.trainer import Trainer
    args = TINY_MODEL + ["--training.micro_batch_size", "2", "--training.global_batch_size", "4",
                         "--training.max_steps", "2", "--training.progress_bar", "false",
                         "--training.jit", "false", "--training.log_interval", "1"]
    runs = {}
    for fused in ("false", "true"):
        cfg = load_config(CONFIG, args + ["--model.cross_entropy_loss_fusion", fused,
                                          "--training.output_dir", str(tmp_path / fused)])
        runs[fused] = [(r["loss"], r["grad_norm"]) for r in Trainer(cfg).fit()]
    np.testing.assert_allclose(runs["true"], runs["false"], rtol=RTOL)
    for extra, key in ((["--parallel.tensor_model_parallel_size", "2"], "tensor_model"),
                       (["--parallel.pipeline_model_parallel_size", "2"], "pipeline_model"),
                       (["--parallel.fsdp_size", "2"], "fsdp_size")):
        with pytest.raises(ConfigError) as e:
            load_config(CONFIG, ["--model.cross_entropy_loss_fusion", "true", *extra])
        msg = str(e.value)
        assert "cross_entropy_loss_fusion" in msg and key in msg and "\n" not in msg
