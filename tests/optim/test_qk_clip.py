"""QK-clip (MuonClip; Megatron-Core's ``qk_clip`` options) against NumPy written here:

* the per-head max attention logit the attention records (``max_logit``) against a float64
  ``scale * q.k`` over the visible keys (causal, or a given mask), GQA heads reading their
  group's key;
* the clip through the trainer: one Muon step with ``log_max_attention_logit`` (weights W, the
  recorded per-head maxima L) and the same step with ``qk_clip`` at a threshold between the
  groups' maxima must leave ``linear_qkv`` at the NumPy clip of W by L (Megatron-Core's GQA
  rule: per query group eta = min(t / max over its heads, 1), W_q rows x eta^alpha, W_k rows x
  eta^(1-alpha), W_v unchanged), every other parameter equal, and log the max.

Tolerances: the max logit is one fp32 dot product of length d (rtol 1e-5); the clipped weights
are an fp32 multiply of identical weights (rtol 1e-6).
"""
import os

import numpy as np
import pytest
from mindspore import Tensor

from ms_llm.models.max_logit import max_attention_logits
from helpers.paths import ROOT

CONFIG = os.path.join(ROOT, "configs", "tiny.yaml")


def numpy_max_logits(q, k, mask):
    b, nh, s, d = q.shape
    r = nh // k.shape[1]
    out = np.full(nh, -np.inf)
    for h in range(nh):
        logits = np.einsum("bqd,bkd->bqk", q[:, h].astype(np.float64),
                           k[:, h // r].astype(np.float64)) / np.sqrt(d)
        out[h] = logits[~np.broadcast_to(mask, logits.shape)].max()
    return out


@pytest.mark.parametrize("masked", [False, True])
def test_max_attention_logits_match_numpy(masked):
    rng = np.random.default_rng(0)
    q = rng.normal(size=(2, 4, 6, 8)).astype(np.float32) * 3
    k = rng.normal(size=(2, 2, 6, 8)).astype(np.float32)
    causal = np.triu(np.ones((6, 6), bool), 1)
    mask = causal | (rng.random((2, 1, 6, 6)) < 0.3) if masked else causal[None, None]
    mask[..., np.arange(6), np.arange(6)] = False          # every query sees itself
    got = max_attention_logits(Tensor(q), Tensor(k), Tensor(mask) if masked else None)
    np.testing.assert_allclose(got.asnumpy(), numpy_max_logits(q, k, mask[:, 0]), rtol=1e-5)


def numpy_clip(w, logits, heads_per_group, d, threshold, alpha):
    """Megatron-Core's ``SelfAttention.clip_qk`` / ``_clip_linear_qkv``, in NumPy."""
    ng = len(logits) // heads_per_group
    w = w.astype(np.float64).reshape(ng, (heads_per_group + 2) * d, -1).copy()
    for g in range(ng):
        eta = min(threshold / max(logits[g * heads_per_group:(g + 1) * heads_per_group]), 1.0)
        w[g, :heads_per_group * d] *= eta ** alpha
        w[g, heads_per_group * d:(heads_per_group + 1) * d] *= eta ** (1 - alpha)
    return w.reshape(ng * (heads_per_group + 2) * d, -1)


def test_qk_clip_step_matches_numpy(tmp_path):
    from helpers.parallel_common import TINY_MODEL
    from ms_llm.config import load_config
    from ms_llm.training.qk_clip import QKClip
    from ms_llm.training.trainer import Trainer
    base = TINY_MODEL + ["--training.micro_batch_size", "2", "--training.global_batch_size", "4",
                         "--training.progress_bar", "false", "--training.lr_warmup_steps", "0",
                         "--training.lr", "3e-3", "--training.optimizer", "muon",
                         "--training.max_steps", "1", "--training.log_interval", "1",
                         "--training.jit", "false"]

    def run(name, *extra):
        trainer = Trainer(load_config(CONFIG, base + ["--training.output_dir",
                                                      str(tmp_path / name), *extra]))
        records = trainer.fit()
        clip = next(c for c in trainer.callbacks.callbacks if isinstance(c, QKClip))
        return trainer, records, clip

    logged, rec_a, clip_a = run("log", "--model.log_max_attention_logit", "true")
    grouped = np.concatenate([lg.reshape(-1, 2).max(axis=1) for lg in clip_a.layer_logits])
    threshold = float(np.median(grouped))           # some groups clip, some do not
    clipped, rec_b, _ = run("clip", "--model.qk_clip", "true", "--model.qk_clip_threshold",
                            str(threshold), "--model.qk_clip_alpha", "0.3")
    assert rec_a[0]["max_attention_logit"] == pytest.approx(max(grouped), rel=1e-6)
    assert rec_b[0]["max_attention_logit"] == pytest.approx(max(grouped), rel=1e-6)
    layers = iter(clip_a.layer_logits)
    n_clipped = 0
    for (n, a), (_, b) in zip(logged.named_params, clipped.named_params):
        want = a.asnumpy()
        if n.endswith("linear_qkv.weight"):
            want = numpy_clip(want, next(layers), 2, 16, threshold, 0.3)
            n_clipped += 1
        np.testing.assert_allclose(b.asnumpy(), want, rtol=1e-6, atol=0, err_msg=n)
    assert n_clipped == 2


def test_qk_clip_layouts_not_built_are_refused_in_one_line():
    from ms_llm.config import ConfigError, load_config
    for extra, msg in ((["--training.jit", "true"], "training.jit"),
                       (["--model.attention_output_gate", "true"], "attention_output_gate"),
                       (["--model.qk_clip_alpha", "2"], "model.qk_clip_alpha")):
        with pytest.raises(ConfigError) as e:
            load_config(CONFIG, ["--model.qk_clip", "true", "--training.jit", "false"] + extra)
        assert msg in str(e.value) and "\n" not in str(e.value)
