"""``ms-llm plan`` on the hybrid models: the Gated DeltaNet activation term against measured
peaks and its linear growth in the sequence, and planning many small experts folded (built with fewer experts, unfolded) equal to
planning them unfolded.

Measured peaks (the trainer's RSS high-water mark above ``rss_before_model_gb``, one fresh forked
child per training: tests/dist_workers/plan_memory_single.py, as
tests/planning/test_memory_plan.py):
two tiny hybrid configs, dense at seq 512 (the one ``models.mixers.gated_delta_net.FIT`` was fitted on) and
MoE at seq 384 with chunk 32 (not fitted: 0.95 of its measured peak when fitted). Acceptance is
test_memory_plan's band, +-20 %. Planning the DeltaNet layers as attention layers gave 0.33 of
the first config's peak."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ms_llm.config import load_config
from helpers.paths import ROOT
from ms_llm.planning.memory_plan import plan_memory

Q3N = os.path.join(ROOT, "configs", "qwen3_next_80b_a3b.yaml")
HYBRID = ["--model.num_layers", "4",
          "--model.layer_types", "gated_delta_net,gated_delta_net,gated_delta_net,attention",
          "--model.hidden_size", "256", "--model.ffn_hidden_size", "512",
          "--model.num_attention_heads", "4", "--model.num_query_groups", "2",
          "--model.kv_channels", "64", "--model.max_position_embeddings", "1024",
          "--model.linear_key_head_dim", "64", "--model.linear_value_head_dim", "64",
          "--model.linear_num_key_heads", "4", "--model.linear_num_value_heads", "8",
          "--model.padded_vocab_size", "512", "--data.corpus", "embedded",
          "--data.tokenizer", "embedded", "--data.embedded_vocab_size", "512",
          "--training.micro_batch_size", "2", "--training.global_batch_size", "2",
          "--training.max_steps", "1", "--training.log_interval", "1",
          "--training.progress_bar", "false", "--training.jit", "false",
          "--training.peak_tflops", "1.0"]
MOE = ["--model.num_moe_experts", "4", "--model.moe_router_topk", "2",
       "--model.moe_ffn_hidden_size", "128", "--model.moe_shared_expert_intermediate_size", "128",
       "--model.moe_aux_loss_coeff", "0.01"]
CONFIGS = {
    "hybrid dense, seq 512": HYBRID + ["--model.mlp_type", "dense", "--data.seq_length", "512"],
    "hybrid moe, seq 384, chunk 32": HYBRID + MOE + ["--data.seq_length", "384",
                                                     "--model.linear_chunk_size", "32"],
}


def test_predicted_peak_within_20_percent_of_measured(tmp_path):
    spec = {name: [Q3N, extra + ["--training.output_dir", str(tmp_path / f"run{i}")]]
            for i, (name, extra) in enumerate(CONFIGS.items())}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "dist_workers",
                                                     "plan_memory_single.py"),
                        str(tmp_path / "out.json"), str(tmp_path / "spec.json")],
                       capture_output=True, text=True, timeout=1200, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    got = json.loads((tmp_path / "out.json").read_text())
    text = "; ".join(f"{n}: measured {v['measured_gb']:.3f} GB, planned "
                     f"{v['planned_gb']:.3f} GB" for n, v in got.items())
    print(text)
    assert set(got) == set(CONFIGS)
    for v in got.values():
        assert abs(v["planned_gb"] - v["measured_gb"]) <= 0.20 * v["measured_gb"], text


def test_deltanet_activations_grow_linearly_in_the_sequence():
    """All-DeltaNet layers keep chunk- and state-sized tensors: doubling the sequence doubles
    their activations; all-attention layers keep [s, s] scores, which more than triple."""
    def acts(types, seq):
        args = HYBRID + ["--model.mlp_type", "dense", "--model.layer_types", types,
                         "--data.seq_length", str(seq)]
        return plan_memory(load_config(Q3N, args), 1).worst.activations
    gdn, attn = "gated_delta_net," * 3 + "gated_delta_net", "attention," * 3 + "attention"
    assert 1.9 < acts(gdn, 4096) / acts(gdn, 2048) < 2.05
    assert acts(attn, 4096) / acts(attn, 2048) > 3


@pytest.mark.parametrize("ep", [1, 2])
def test_folded_experts_plan_equals_the_unfolded_plan(ep, monkeypatch):
    """64 experts top 4: planned folded (4 experts built, factor 16) and unfolded, on the same
    layout: every stage's figures equal, and the parameter totals."""
    from ms_llm.parallel import plan_experts
    args = HYBRID + ["--model.mlp_type", "moe", "--model.num_moe_experts", "64",
                     "--model.moe_router_topk", "4", "--model.moe_ffn_hidden_size", "32",
                     "--model.moe_shared_expert_intermediate_size", "64",
                     "--data.seq_length", "256", "--training.global_batch_size", "16",
                     "--parallel.expert_model_parallel_size", str(ep),
                     "--parallel.use_distributed_optimizer", "true"]
    cfg = load_config(Q3N, args)
    assert plan_experts.fold_experts(cfg.model, ep)[1] == 16
    folded = plan_memory(cfg, 4)
    monkeypatch.setattr(plan_experts, "FOLD_ABOVE", 10 ** 6)
    assert plan_experts.fold_experts(cfg.model, ep)[1] == 1
    plain = plan_memory(cfg, 4)
    assert folded.total_params == plain.total_params
    assert folded.to_dict()["stages"] == plain.to_dict()["stages"]
