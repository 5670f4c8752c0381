"""The published scripts of the families added to the tested set (qwen3_next, qwen3_coder_next,
gated_deltanet: ``qwen3_next_spec``; deepseek2_lite: ``deepseek_spec`` with a softmax router)
resolve to the model their Hugging Face release describes: the run config of each script's
flags equals, field by field, ``from_hf`` of the released ``config.json`` values (written out
below from the model cards: Qwen3-Next-80B-A3B, DeepSeek-V2-Lite)."""
import pytest

from helpers.mindspeed_examples import load
from ms_llm.config import load_config
from ms_llm.mindspeed.flags import to_overrides, translate
from ms_llm.models.registry import get_family

SCRIPTS = load()

DEEPSEEK_V2_LITE = dict(   # deepseek-ai/DeepSeek-V2-Lite config.json (the fields read)
    model_type="deepseek_v2", hidden_size=2048, intermediate_size=10944, num_hidden_layers=27,
    num_attention_heads=16, num_key_value_heads=16, vocab_size=102400, q_lora_rank=None,
    kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, moe_intermediate_size=1408,
    first_k_dense_replace=1, moe_layer_freq=1, topk_method="greedy", n_group=1, topk_group=1,
    norm_topk_prob=False, routed_scaling_factor=1.0, rms_norm_eps=1e-6, rope_theta=10000,
    max_position_embeddings=163840, tie_word_embeddings=False,
    rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                  "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707})

QWEN3_NEXT_80B = dict(     # Qwen/Qwen3-Next-80B-A3B-Instruct config.json (the fields read)
    model_type="qwen3_next", hidden_size=2048, intermediate_size=5120, num_hidden_layers=48,
    num_attention_heads=16, num_key_value_heads=2, head_dim=256, vocab_size=151936,
    linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_num_key_heads=16, linear_num_value_heads=32, full_attention_interval=4,
    num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
    shared_expert_intermediate_size=512, norm_topk_prob=True, decoder_sparse_step=1,
    mlp_only_layers=[], rms_norm_eps=1e-6, rope_theta=10000000, partial_rotary_factor=0.25,
    max_position_embeddings=262144, tie_word_embeddings=False)

ARCH = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
        "padded_vocab_size", "layernorm_epsilon", "rotary_base",
        "untie_embeddings_and_output_weights", "mlp_type", "num_moe_experts", "moe_router_topk",
        "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "moe_shared_expert_gate",
        "moe_router_score_function", "moe_router_pre_softmax", "moe_router_enable_expert_bias",
        "moe_router_num_groups")
MLA = ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
       "qk_pos_emb_head_dim", "v_head_dim", "position_embedding_type",
       "yarn_rotary_scaling_factor", "yarn_original_max_position_embeddings", "yarn_beta_fast",
       "yarn_beta_slow", "yarn_mscale", "yarn_mscale_all_dim")
HYBRID = ("layer_types", "num_query_groups", "kv_channels", "linear_conv_kernel_dim",
          "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
          "linear_num_value_heads", "attention_output_gate", "layernorm_zero_centered_gamma",
          "rotary_percent", "qk_layernorm")


def resolve(name):
    keys = translate(SCRIPTS[name]["argv"], world_size=64).keys
    keys.pop("checkpoint.load", None)
    return load_config(None, to_overrides(keys))


def moe_pattern(c):
    return [c.is_moe_layer(i) for i in range(c.num_layers)]


def differing(got, want, fields):
    return {f: (getattr(got, f), getattr(want, f)) for f in fields
            if getattr(got, f) != getattr(want, f)}


@pytest.mark.parametrize("name", [n for n in SCRIPTS if n.startswith("deepseek2_lite/")])
def test_deepseek2_lite_scripts_build_the_released_model(name):
    cfg = resolve(name)
    want = get_family("deepseek-v2").from_hf(DEEPSEEK_V2_LITE, "DeepSeek-V2-Lite")
    assert cfg.model_family == "deepseek-v2"
    assert not differing(cfg.model, want, ARCH + MLA)
    assert moe_pattern(cfg.model) == moe_pattern(want) == [False] + [True] * 26
    # pai_megatron_aux_loss: Megatron's switch aux loss on the softmax scores, coefficient 0.01
    assert (cfg.model.moe_router_load_balancing_type, cfg.model.moe_aux_loss_coeff) == \
        ("aux_loss", 0.01)


def test_pai_megatron_router_notes_the_flags_it_does_not_read():
    tr = translate(SCRIPTS["deepseek2_lite/pretrain_deepseek2_lite_16b_ptd_8p.sh"]["argv"])
    for flag in ("--moe-router-num-groups", "--moe-router-group-topk",
                 "--moe-router-topk-scaling-factor", "--seq-aux"):
        assert any(n.startswith(f"{flag}: no-op (MindSpeed's pai_megatron_aux_loss") for n in
                   tr.notes), flag
    assert "model.moe_router_topk_scaling_factor" not in tr.keys


@pytest.mark.parametrize("name", [n for n in SCRIPTS
                                  if n.startswith(("qwen3_next/", "qwen3_coder_next/"))])
def test_qwen3_next_scripts_build_the_released_model(name):
    cfg = resolve(name)
    want = get_family("qwen3-next").from_hf(QWEN3_NEXT_80B, "Qwen3-Next-80B-A3B")
    assert cfg.model_family == "qwen3-next"
    assert not differing(cfg.model, want, ARCH + HYBRID)
    assert cfg.model.layer_types == (["gated_delta_net"] * 3 + ["attention"]) * 12


def test_gated_deltanet_script_is_a_dense_hybrid_with_its_own_interval():
    cfg = resolve("gated_deltanet/pretrain_gated_deltanet_340M_4K_A2_ptd.sh")
    m = cfg.model
    assert cfg.model_family == "qwen3-next" and m.mlp_type == "dense"
    assert m.layer_types == (["gated_delta_net"] * 2 + ["attention"]) * 8
    assert (m.linear_num_key_heads, m.linear_num_value_heads, m.linear_key_head_dim,
            m.linear_value_head_dim, m.linear_chunk_size) == (4, 4, 256, 256, 64)
    assert m.kv_channels == 64 and m.num_query_groups == 2   # Megatron: hidden / heads
    assert m.attention_output_gate and m.layernorm_zero_centered_gamma
    assert (cfg.training.micro_batch_size, cfg.training.global_batch_size) == (6, 48)


def test_kimi2_script_builds_deepseek_v3_shapes_until_moe_runs_under_tensor_parallel():
    """Kimi-K2 is DeepSeek-V3's architecture (HF DeepseekV3ForCausalLM); its script is refused
    only for MoE under tp 2 (tests/mindspeed/test_mindspeed_flags.py REFUSED): at tp 1 it
    resolves to deepseek-v3 with its sigmoid router."""
    argv = SCRIPTS["kimi2/pretrain_kimi2_18b_4k_8p_ptd.sh"]["argv"] + \
        ["--tensor-model-parallel-size", "1"]
    keys = translate(argv, world_size=64).keys
    keys.pop("checkpoint.load", None)
    m = load_config(None, to_overrides(keys))
    assert m.model_family == "deepseek-v3"
    c = m.model
    assert (c.q_lora_rank, c.kv_lora_rank, c.num_moe_experts, c.moe_router_topk) == \
        (1536, 512, 384, 8)
    assert (c.moe_router_score_function, c.moe_router_enable_expert_bias,
            c.moe_router_norm_topk_prob, c.moe_router_topk_scaling_factor) == \
        ("sigmoid", True, True, 2.827)
    assert c.moe_router_load_balancing_type == "seq_aux_loss"


@pytest.mark.parametrize("extra, message", [
    (["--full-attention-interval", "0"], "--full-attention-interval 0: must be >= 1"),
    (["--dataloader-type", "external"], "--dataloader-type external: not supported"),
])
def test_bad_new_flags_are_one_line(extra, message):
    from ms_llm.config import ConfigError
    with pytest.raises(ConfigError, match=message):
        translate(SCRIPTS["gated_deltanet/pretrain_gated_deltanet_340M_4K_A2_ptd.sh"]["argv"] +
                  extra)


def test_full_attention_interval_needs_a_hybrid_spec():
    from ms_llm.config import ConfigError
    with pytest.raises(ConfigError, match=r"--full-attention-interval 4: the --spec family "
                                          r"\(qwen3\) has one kind of layer"):
        translate(SCRIPTS["qwen3/pretrain_qwen3_0point6b_4K_ptd.sh"]["argv"] +
                  ["--full-attention-interval", "4"])


def test_cyclic_loader_is_refused_for_pretraining_data():
    from ms_llm.config import ConfigError
    with pytest.raises(ConfigError, match="--dataloader-type cyclic: not supported for "
                                          "pretraining data"):
        translate(SCRIPTS["gated_deltanet/pretrain_gated_deltanet_340M_4K_A2_ptd.sh"]["argv"] +
                  ["--dataloader-type", "cyclic"])
    tr = translate(SCRIPTS["deepseek2_lite/tune_deepseek2_lite_16b_full_ptd.sh"]["argv"])
    assert any(n.startswith("--dataloader-type cyclic: instruction samples") for n in tr.notes)
