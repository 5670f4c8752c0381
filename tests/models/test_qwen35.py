"""Qwen3.5 dense and MoE (HF ``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM``) against
transformers on tiny random checkpoints, with sequences longer than one 64-token chunk: logits,
loss and grad norm, greedy generation with and without the cache, and the published-size YAMLs
against transformers' config classes. (The registry tests add the HF -> Megatron -> HF round
trip at tp 2 / ep 2 for both families.)

Tolerances as tests/models/test_qwen3_next.py (float32 both sides): logits 1e-4 (values ~5; rounding
through four 64-wide layers and an 80-step recurrence ~1e-5; a wrong row permutation of the
split DeltaNet projections or a wrong gate is O(0.1)); loss 1e-5 absolute and grad norm 1e-5
relative (means over many tokens)."""
from __future__ import annotations

import os

import numpy as np
import pytest

import transformers  # noqa: F401  (test extra)

from helpers.hf_parity import loss_and_grad_norm
from ms_llm.models.registry import get_family
from helpers.paths import ROOT

SEQ = 80


def _build_hf(name: str, seed: int = 11):
    import torch
    spec = get_family(name)
    cfg = transformers.AutoConfig.for_model(spec.hf_model_type, **spec.tiny_hf)
    model = getattr(transformers, spec.hf_architecture)(cfg)
    model.config._attn_implementation = "eager"
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return model.float()


@pytest.fixture(scope="module", params=["qwen35", "qwen35-moe"])
def pair(request, tmp_path_factory):
    import mindspore as ms  # noqa: F401
    from ms_llm.checkpoint import from_pretrained
    hf = _build_hf(request.param)
    root = tmp_path_factory.mktemp(request.param.replace("-", "_"))
    hf.save_pretrained(str(root / "hf"))
    return hf, from_pretrained(str(root / "hf"))


def _ids(seed=3, b=2, s=SEQ):
    return np.random.default_rng(seed).integers(0, 96, size=(b, s)).astype(np.int64)


def test_logits_longer_than_a_chunk(pair):
    import mindspore as ms
    import torch
    hf, model = pair
    ids = _ids()
    with torch.no_grad():
        want = hf.eval()(torch.tensor(ids)).logits.double().numpy()
    got = model(ms.Tensor(ids.astype(np.int32))).asnumpy().astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_loss_and_grad_norm(pair):
    hf, model = pair
    got_loss, want_loss, got_norm, want_norm = loss_and_grad_norm(hf, model, _ids(seed=4))
    assert abs(got_loss - want_loss) < 1e-5
    assert abs(got_norm - want_norm) / want_norm < 1e-5, (got_norm, want_norm)
    params = model.trainable_params()
    assert sum(int(np.prod(p.shape)) for p in params) == sum(p.numel() for p in hf.parameters())


def test_greedy_generation_cached_uncached_and_transformers(pair):
    """A 70-token prompt (the prefill crosses a chunk boundary), 6 greedy tokens: cached,
    uncached and transformers' ``generate`` agree token for token."""
    import torch
    from ms_llm.inference import generate
    hf, model = pair
    ids = _ids(seed=9, b=2, s=70)
    with torch.no_grad():
        want = hf.eval().generate(torch.tensor(ids), max_new_tokens=6, do_sample=False,
                                  min_new_tokens=6).numpy()
    cached = generate(model, ids, max_new_tokens=6)
    np.testing.assert_array_equal(cached, generate(model, ids, max_new_tokens=6,
                                                   use_cache=False))
    np.testing.assert_array_equal(cached, want)


@pytest.mark.parametrize("yaml,cls,name", [
    ("qwen35_9b.yaml", "Qwen3_5TextConfig", "qwen35"),
    ("qwen35_35b_a3b.yaml", "Qwen3_5MoeTextConfig", "qwen35-moe")])
def test_published_configs_match_transformers_config_classes(yaml, cls, name):
    """Each YAML written as config.json is accepted by transformers' config class and equals
    its defaults (the sizes its docstring names) except the published 262144 context; reading
    it back gives the same model config."""
    from ms_llm.config import load_config
    from ms_llm.models.families import config_from_hf
    c = load_config(os.path.join(ROOT, "configs", yaml)).model
    hf = get_family(name).to_hf(c)
    klass = getattr(transformers, cls)
    got = klass(**{k: v for k, v in hf.items() if k not in ("architectures", "torch_dtype")})
    default = klass()
    keys = [k for k in got.to_dict() if k not in ("max_position_embeddings", "dtype",
                                                   "transformers_version", "architectures",
                                                   "rope_parameters", "torch_dtype",
                                                   "bos_token_id", "eos_token_id",
                                                   "initializer_range", "mtp_num_hidden_layers",
                                                   "mtp_use_dedicated_embeddings")]
    diff = {k: (getattr(got, k), getattr(default, k)) for k in keys
            if getattr(got, k, None) != getattr(default, k, None)}
    assert not diff
    assert got.max_position_embeddings == 262144 and hf["mtp_num_hidden_layers"] == 0
    assert got.rope_parameters["rope_theta"] == 1e7
    assert got.rope_parameters["partial_rotary_factor"] == 0.25
    assert config_from_hf(got.to_dict()) == c


def test_vision_language_config_is_refused_with_one_line():
    from ms_llm.models.families import config_from_hf
    with pytest.raises(ValueError, match="vision-language config .* is not built"):
        config_from_hf({"model_type": "qwen3_5_moe_text", "text_config": {}})


@pytest.mark.parametrize("yaml,name", [("qwen3_next_80b_a3b.yaml", "qwen3-next"),
                                       ("qwen35_9b.yaml", "qwen35"),
                                       ("qwen35_35b_a3b.yaml", "qwen35-moe")])
def test_a_training_config_exports_as_its_own_family(yaml, name):
    """A training checkpoint records its TransformerConfig without the family, so export guesses
    it (``family_for_config``): each hybrid YAML must come back as its own family (Qwen3-Next's
    has a dense MLP size of its own, which Qwen3.5-MoE has not)."""
    from ms_llm.config import load_config
    from ms_llm.models.registry import family_for_config
    c = load_config(os.path.join(ROOT, "configs", yaml)).model
    assert family_for_config(c).name == name
