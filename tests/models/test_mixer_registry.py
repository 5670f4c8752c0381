"""The token-mixer registry (ms_llm.models.mixers) and the parallel plans that go with it
(ms_llm.parallel.mixer_plans): every kind has a plan, generic code never names a kind, and a
new kind is one registration on each side -- the model builds, validates, counts its FLOPs,
plans its memory and splits over tensor parallel without any other edit."""
import numpy as np
import pytest
from helpers.name_scan import names_written

from ms_llm.models.config import TransformerConfig
from ms_llm.models.mixers import (ActivationBytes, MixerKind, get_mixer, layer_mixer,
                                  mixer_names, register_mixer)
from ms_llm.models.mixers.registry import FULL_ATTENTION, unregister_mixer
from ms_llm.parallel.mixer_plans import MixerPlan, plan_for, register_plan, unregister_plan

# Where a kind's name may be written: its registrations, and the families and checkpoint
# layouts that map their own names (HF's "linear_attention", layout kinds) onto kinds.
OWNERS = ("models/mixers/", "parallel/mixer_plans/", "models/families/", "models/layouts/",
          "checkpoint/layouts")


def test_every_kind_has_a_parallel_plan():
    assert {"attention", "mla", "gated_delta_net"} <= set(mixer_names())
    for name in mixer_names():
        assert isinstance(plan_for(name), MixerPlan)


def test_generic_code_never_names_a_mixer_kind():
    # FULL_ATTENTION ("attention") is also an op and a word; the other names are kinds only
    found = names_written(set(mixer_names()) - {FULL_ATTENTION}, OWNERS)
    assert not found, found


def test_layer_kinds_resolve_full_attention_per_config():
    mla = TransformerConfig(multi_latent_attention=True, q_lora_rank=8, kv_lora_rank=8,
                            qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8)
    assert layer_mixer(mla, 0).name == "mla" and layer_mixer(mla, mla.num_layers).name == "mla"
    hybrid = TransformerConfig(num_layers=2, layer_types=["gated_delta_net", "attention"],
                               linear_num_key_heads=2, linear_num_value_heads=4)
    assert [layer_mixer(hybrid, i).name for i in range(3)] == \
        ["gated_delta_net", "attention", "attention"]     # index 2: an MTP layer
    with pytest.raises(ValueError, match="model.layer_types .* must name one of"):
        TransformerConfig(num_layers=2, layer_types=["attention", "nope"])
    with pytest.raises(ValueError, match="linear_num_value_heads"):
        TransformerConfig(num_layers=1, layer_types=["gated_delta_net"],
                          linear_num_key_heads=3, linear_num_value_heads=4)


@pytest.fixture
def doubled_attention():
    """A new kind registered from outside the package: attention whose projections count
    twice in the FLOP count (so a test can see the kind's own terms are used)."""
    base = get_mixer("attention")
    kind = register_mixer(MixerKind(
        name="test_mixer", title="doubled attention", build=base.build,
        activation_bytes=lambda c, b, s, tp: ActivationBytes(0, 123, 0, 0),
        weights_per_token=lambda c: 2 * base.weights_per_token(c),
        mixing_flops_per_token=base.mixing_flops_per_token,
        validate=lambda c: None if c.hidden_size % 8 == 0 else
        (_ for _ in ()).throw(ValueError("model.hidden_size must be a multiple of 8"))))
    register_plan("test_mixer", plan_for("attention"))
    yield kind
    unregister_mixer("test_mixer")
    unregister_plan("test_mixer")


def test_a_new_kind_is_one_registration(doubled_attention):
    from ms_llm.models import GPTModel
    from ms_llm.models.mixers import mixer_of
    from ms_llm.parallel.tensor_parallel import validate_tp
    from ms_llm.planning.flops import matmul_weights_per_token
    base = dict(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                num_query_groups=2, padded_vocab_size=64)
    plain = TransformerConfig(**base)
    mixed = TransformerConfig(**base, layer_types=["test_mixer", "attention"])
    attn = get_mixer("attention").weights_per_token(plain)
    assert matmul_weights_per_token(mixed) == matmul_weights_per_token(plain) + attn
    with pytest.raises(ValueError, match="multiple of 8"):
        TransformerConfig(**{**base, "hidden_size": 36, "num_attention_heads": 4},
                          layer_types=["test_mixer", "attention"])
    model = GPTModel(mixed)
    assert [mixer_of(layer.self_attention).name for layer in model.decoder.layers] == \
        ["test_mixer", "attention"]
    validate_tp(mixed, 2)
    from mindspore import Tensor
    logits = model(Tensor(np.arange(8, dtype=np.int32).reshape(1, 8)))
    assert logits.shape == (1, 8, 64) and np.isfinite(logits.asnumpy()).all()


def test_memory_plan_adds_the_kinds_own_term(doubled_attention):
    from types import SimpleNamespace
    from ms_llm.planning.memory_plan import _layer_activation_bytes
    c = TransformerConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64,
                          num_attention_heads=4, num_query_groups=2, padded_vocab_size=64)
    t = SimpleNamespace(recompute_norm=False, recompute_granularity=None)
    args = (c, 2, 16, 1, False, t, False)
    kept_test, _ = _layer_activation_bytes(*args, get_mixer("test_mixer"))
    zero = MixerKind(name="zero", title="zero", build=None, weights_per_token=None,
                     mixing_flops_per_token=None,
                     activation_bytes=lambda c, b, s, tp: ActivationBytes(0, 0, 0, 0))
    kept_zero, _ = _layer_activation_bytes(*args, zero)
    assert kept_test - kept_zero == 123
