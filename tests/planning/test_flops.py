"""MFU reporting: model FLOPs per token against a count of the model's own matmul shapes, the
cached CPU peak probe, and the TFLOP/s / MFU columns of metrics.jsonl."""
import json

import numpy as np
import pytest

from ms_llm.config import ConfigError
from ms_llm.models import GPTModel
from ms_llm.models.config import TransformerConfig
from ms_llm.planning import peak
from ms_llm.planning.flops import flops_per_token, matmul_weights_per_token
from ms_llm.training.metrics import MetricsLogger

BASE = dict(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
            num_query_groups=2, padded_vocab_size=100)
MOE = dict(mlp_type="moe", num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=40,
           moe_shared_expert_intermediate_size=48, moe_layer_freq=2)
MLA = dict(multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=16, qk_head_dim=8,
           qk_pos_emb_head_dim=4, v_head_dim=8)


def macs_from_model(c: TransformerConfig) -> float:
    """Independent count: every 2-D weight of the built model is one matmul a token goes through
    (multiply-accumulates = its element count), except the input embedding (a gather); a routed
    expert is visited by topk of num_moe_experts tokens on average."""
    total = 0.0
    for name, p in GPTModel(c).parameters_and_names():
        conv = name.endswith("conv1d.weight")      # depthwise: K MACs per channel and token
        if (len(p.shape) != 2 and not conv) or name.startswith("embedding."):
            continue
        share = c.moe_router_topk / c.num_moe_experts if ".local_experts." in name else 1.0
        total += int(np.prod(p.shape)) * share
    return total


# hybrid layers: Gated DeltaNet, full attention, Gated DeltaNet (its depthwise conv1d weight is
# [channels, 1, K]: K multiply-accumulates per channel and token)
HYBRID = dict(num_layers=3, layer_types=["gated_delta_net", "attention", "gated_delta_net"],
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
              linear_value_head_dim=8, linear_conv_kernel_dim=4)


@pytest.mark.parametrize("extra", [{}, MOE, MLA, HYBRID], ids=["dense", "moe", "mla", "hybrid"])
def test_matmul_weights_match_the_models_matmul_shapes(extra):
    c = TransformerConfig(**{**BASE, **extra})
    assert matmul_weights_per_token(c) == macs_from_model(c)


def test_flops_per_token_by_hand_for_the_benchmark_llama():
    # hidden 512, 8 layers, 8/2 heads of 64, FFN 1408, vocab 32000, seq 512, written out:
    # per layer q 512*512 + k,v 2*512*128 + o 512*512 + SwiGLU 3*512*1408 = 2,818,048 MACs,
    # output layer 512*32000 = 16,384,000; attention 6 * 8 layers * 512 * 8 heads * (64 + 64).
    c = TransformerConfig(num_layers=8, hidden_size=512, ffn_hidden_size=1408,
                          num_attention_heads=8, num_query_groups=2, padded_vocab_size=32000)
    n = 8 * 2_818_048 + 16_384_000
    assert flops_per_token(c, 512) == 6 * n + 6 * 8 * 512 * 8 * 128
    # torchtitan's 6N + 12 * L * heads * head_dim * seq, N without the input embedding
    assert flops_per_token(c, 512) == 6 * n + 12 * 8 * 8 * 64 * 512


def test_peak_probe_is_cached_per_host_and_threads(tmp_path, monkeypatch):
    file = tmp_path / "peak.json"
    monkeypatch.setenv("MS_LLM_PEAK_FILE", str(file))
    first = peak.resolve_peak_tflops(None, "CPU")       # the real probe through ops.linear
    assert first > 0
    (key, value), = json.loads(file.read_text()).items()
    assert value == first and "threads=" in key and "fp32" in key
    file.write_text(json.dumps({key: 123.0}))           # a second run reads, not re-measures
    assert peak.resolve_peak_tflops(None, "CPU") == 123.0
    assert peak.resolve_peak_tflops(0.5, "CPU") == 0.5  # the config key wins
    with pytest.raises(ConfigError, match="training.peak_tflops"):
        peak.resolve_peak_tflops(None, "Ascend")


def test_metrics_rows_carry_tflops_and_mfu(tmp_path, capsys):
    log = MetricsLogger(str(tmp_path), 1, progress_bar=False, flops_per_token=1_000_000,
                        peak_tflops=0.5, num_devices=2)
    row = log.log(1, loss=1.0, grad_norm=1.0, lr=1e-3, tokens=100_000, step_time=0.5,
                  consumed_samples=1, global_batch_size=1)
    # 1e5 tokens * 1e6 FLOPs / 0.5 s / 2 devices = 0.1 TFLOP/s per device, 20 % of 0.5
    assert row["tflops_per_device"] == pytest.approx(0.1) and row["mfu"] == pytest.approx(0.2)
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["mfu"] == pytest.approx(0.2)
    assert "| TFLOP/s/device: 0.100 | MFU: 20.0% |" in capsys.readouterr().out


def test_peak_tflops_key_is_checked():
    from ms_llm.config import load_config
    assert load_config(None, ["--training.peak_tflops", "0.25"]).training.peak_tflops == 0.25
    with pytest.raises(ConfigError, match="training.peak_tflops must be"):
        load_config(None, ["--training.peak_tflops", "-1"])
