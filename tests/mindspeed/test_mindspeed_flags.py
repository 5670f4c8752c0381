"""MindSpeed-LLM's published Mcore example scripts resolve to ms-llm run configs.

Over every pretrain_/tune_ script of the families ms-llm has (the argument lists bash hands to
``pretrain_gpt.py`` / ``posttrain_gpt.py``, ``tests/fixtures/mindspeed_examples.json``): no flag is
unknown, each script resolves to a run config or is refused with one line naming the flag (the
expected refusals are listed below, each for a feature not built), and the YAML written from the
same flags resolves to the same config.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import paths
from helpers.mindspeed_examples import load
from ms_llm.config import ConfigError, load_config
from ms_llm.mindspeed.flag_table import TABLE
from ms_llm.mindspeed.flags import explain, split_flags, to_overrides, to_yaml, translate

ROOT = Path(paths.ROOT)   # pretrain_gpt.py / posttrain_gpt.py live here

SCRIPTS = load()
MOE_TP = "--tensor-model-parallel-size"   # MoE under tensor parallel: expert TP is not built
REFUSED = {
    "qwen3_moe/pretrain_qwen3_480b_4k_A3_ptd.sh": MOE_TP,
    "qwen3_moe/tune_qwen3_235b_a22b_128K_full_pack_A3_ptd.sh": MOE_TP,
    "qwen3_moe/tune_qwen3_235b_a22b_256K_full_pack_A3_ptd.sh": MOE_TP,
    "qwen3_moe/tune_qwen3_235b_a22b_32K_lora_pack_A2_ptd.sh": "--expert-tensor-parallel-size 4",
    "qwen3_moe/tune_qwen3_235b_a22b_4K_full_pack_A3_ptd.sh": MOE_TP,
    "qwen3_moe/tune_qwen3_235b_a22b_64K_full_pack_A3_ptd.sh": MOE_TP,
    "qwen3_moe/tune_qwen3_30b_a3b_256K_full_pack_A3_ptd.sh": MOE_TP,
    "qwen3_moe/tune_qwen3_30b_a3b_32K_full_pack_A+X_ptd.sh": MOE_TP,
    "qwen3_moe/tune_qwen3_30b_a3b_32K_full_pack_A3_ptd.sh": MOE_TP,
    "qwen3_moe/tune_qwen3_30b_a3b_4K_full_ptd.sh": MOE_TP,
    "qwen3_moe/tune_qwen3_30b_a3b_4K_lora_ptd.sh": MOE_TP,
    "qwen3_moe/tune_qwen3_480b_4k_A3_ptd.sh": MOE_TP,
    "glm45/tune_glm45_4k_lora_ptd.sh": MOE_TP,
    "deepseek3/pretrain_deepseek3_671b_4k_A3_ptd.sh": MOE_TP,
    "deepseek3/pretrain_deepseek3_671b_4k_ptd.sh": MOE_TP,
    "deepseek3/tune_deepseek3_671b_4k_full_A3_ptd.sh": "--moe-tp-extend-ep",
    "glm45-air/tune_glm45_air_4k_full_ptd.sh": "--moe-tp-extend-ep",
    "kimi2/pretrain_kimi2_18b_4k_8p_ptd.sh": MOE_TP,
}


def resolve(argv, extra=()):
    """The run config of a script's flags (``--load`` dropped: the folders are placeholders;
    the LoRA rank checked, then dropped, since it needs a real base folder)."""
    keys = translate(list(argv) + list(extra), world_size=64).keys
    keys.pop("checkpoint.load", None)
    keys.pop("lora.r", None)
    return keys, load_config(None, to_overrides(keys))


def test_every_flag_of_every_published_script_is_known():
    assert len(SCRIPTS) >= 50
    unknown = {f for s in SCRIPTS.values() for f, _ in split_flags(s["argv"]) if f not in TABLE}
    assert not unknown


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_published_script_resolves_or_is_refused_naming_the_flag(name, tmp_path):
    argv = SCRIPTS[name]["argv"]
    if name in REFUSED:
        with pytest.raises(ConfigError) as e:
            resolve(argv)
        line = explain(str(e.value))
        assert "\n" not in line and REFUSED[name] in line, line
        return
    keys, cfg = resolve(argv)
    # the same keys as YAML resolve to the same run config
    path = tmp_path / "run.yaml"
    path.write_text(to_yaml(keys))
    assert load_config(str(path)).to_dict() == cfg.to_dict()
    if SCRIPTS[name]["entry"] == "posttrain_gpt.py":
        assert cfg.data.dataset_type == "sft" or cfg.training.stage == "dpo"


def test_qwen3_0point6b_pretrain_maps_every_value():
    keys, cfg = resolve(SCRIPTS["qwen3/pretrain_qwen3_0point6b_4K_ptd.sh"]["argv"])
    m, t, p, d = cfg.model, cfg.training, cfg.parallel, cfg.data
    assert cfg.model_family == "qwen3" and m.qk_layernorm and not m.add_bias_linear
    assert (m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads,
            m.num_query_groups, m.kv_channels, m.padded_vocab_size) == \
        (28, 1024, 3072, 16, 8, 128, 151936)
    assert m.rotary_base == 1e6 and m.layernorm_epsilon == 1e-6
    assert not m.untie_embeddings_and_output_weights     # Megatron ties unless told otherwise
    assert (t.lr, t.min_lr, t.weight_decay, t.adam_beta2, t.seed, t.bf16) == \
        (1.25e-6, 1.25e-7, 0.1, 0.95, 42, True)
    assert (t.max_steps, t.micro_batch_size, t.global_batch_size) == (2000, 1, 32)
    assert t.lr_decay_style == "linear" and t.lr_warmup_steps == 0   # Megatron's defaults
    assert t.eval_interval is None                                   # --eval-iters 0
    assert p.use_distributed_optimizer and not p.sequence_parallel   # SP dropped at tp=1
    assert d.data_path == ["@DATA@"] and d.tokenizer == "@TOKENIZER@" and d.split == "100,0,0"
    assert d.seq_length == 4096 and d.make_vocab_size_divisible_by == 1
    assert cfg.checkpoint.save_dir == "@SAVE@" and cfg.checkpoint.save_interval == 1000


def test_lora_tune_maps_the_adapter_and_the_stage():
    keys = translate(SCRIPTS["qwen3/tune_qwen3_0point6b_4K_lora_ptd.sh"]["argv"]).keys
    assert keys["data.dataset_type"] == "sft" and keys["checkpoint.load"] == "@LOAD@"
    assert (keys["lora.r"], keys["lora.alpha"]) == ("16", "32")
    assert keys["lora.target_modules"] == "linear_qkv,linear_proj,linear_fc1,linear_fc2"


def test_schedule_flags_and_megatron_argparse_rules():
    base = SCRIPTS["qwen3/pretrain_qwen3_0point6b_4K_ptd.sh"]["argv"]
    _, cfg = resolve(base, ["--lr-warmup-fraction=0.01", "--lr-decay-style", "cosine",
                            "--lr-warmup-init", "1e-8", "--lr-decay-iters", "1500",
                            "--seed", "7"])      # last occurrence wins, --flag=value parses
    t = cfg.training
    assert (t.lr_warmup_fraction, t.lr_decay_style, t.lr_warmup_init, t.lr_decay_steps,
            t.seed) == (0.01, "cosine", 1e-8, 1500, 7)
    no_iters = [a for a in base if a not in ("--train-iters", "2000")]
    _, cfg = resolve(no_iters, ["--train-samples", "640", "--lr-warmup-samples", "64"])
    assert (cfg.training.train_samples, cfg.training.max_steps) == (640, 20)
    _, cfg = resolve(base, ["--stage", "dpo"])
    assert cfg.training.stage == "dpo"


def test_muon_flags_take_megatron_core_names_and_defaults():
    base = SCRIPTS["qwen3/pretrain_qwen3_0point6b_4K_ptd.sh"]["argv"]
    _, cfg = resolve(base, [])
    assert cfg.training.optimizer == "adamw"
    tr = translate(list(base) + ["--optimizer", "muon"])
    assert tr.keys["training.muon_momentum"] == 0.9          # Megatron's default, not ms-llm's
    assert any("--muon-fp32-matmul-prec" in n for n in tr.notes)
    _, cfg = resolve(base, ["--optimizer", "dist_muon", "--muon-momentum", "0.8",
                            "--muon-use-nesterov", "--muon-no-split-qkv", "--muon-num-ns-steps",
                            "6", "--muon-scale-mode", "unit_rms_norm", "--muon-tp-mode",
                            "distributed", "--muon-extra-scale-factor", "0.2",
                            "--muon-coefficient-type", "polar_express",
                            "--muon-fp32-matmul-prec", "medium", "--muon-scalar-optimizer", "adam",
                            "--qk-clip", "--qk-clip-alpha", "0.4", "--qk-clip-threshold", "50"])
    t, m = cfg.training, cfg.model
    assert (t.optimizer, cfg.parallel.use_distributed_optimizer) == ("muon", True)
    assert (t.muon_momentum, t.muon_nesterov, t.muon_split_qkv, t.muon_num_ns_steps,
            t.muon_scale_mode, t.muon_tp_mode, t.muon_extra_scale_factor,
            t.muon_coefficient_type, t.muon_fp32_matmul_prec) == \
        (0.8, True, False, 6, "unit_rms_norm", "distributed", 0.2, "polar_express", "medium")
    assert (m.qk_clip, m.qk_clip_alpha, m.qk_clip_threshold) == (True, 0.4, 50.0)


@pytest.mark.parametrize("extra, message", [
    (["--optimizer", "lion"], "--optimizer lion: not supported (adam, muon and dist_muon"),
    (["--optimizer", "muon", "--muon-scalar-optimizer", "lion"],
     "--muon-scalar-optimizer lion: not supported (accepted: adam)"),
    (["--frobnicate"], "--frobnicate: unknown Megatron/MindSpeed flag"),
    (["--fp16"], "--fp16: not supported: fp16 training is not built"),
    (["--lr"], "--lr: takes 1 value(s), got none"),
    (["--bf16", "yes"], "--bf16: takes no value, got yes"),
    (["--transformer-impl", "transformer_engine"], "--transformer-impl transformer_engine: "
                                                   "not supported (accepted: local)"),
    (["--stage", "ppo"], "--stage ppo: not supported"),
    (["--num-layers", "0"], "--num-layers: model.num_layers must be > 0, got 0"),
])
def test_bad_flags_are_one_line_naming_the_flag(extra, message):
    with pytest.raises(ConfigError) as e:
        resolve(SCRIPTS["qwen3/pretrain_qwen3_0point6b_4K_ptd.sh"]["argv"], extra)
    line = explain(str(e.value))
    assert message in line and "\n" not in line, line


def test_entry_prints_the_config_and_refuses_in_one_line(tmp_path):
    argv = SCRIPTS["qwen3/pretrain_qwen3_0point6b_4K_ptd.sh"]["argv"]
    ok = subprocess.run([sys.executable, "pretrain_gpt.py", *argv, "--print-config"],
                        capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert ok.returncode == 0 and "tensor_model_parallel_size: '1'" in ok.stdout, ok.stderr
    bad = subprocess.run([sys.executable, "posttrain_gpt.py", *argv, "--fp16"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "posttrain_gpt.py: --fp16: not supported: fp16 training is not built (use --bf16)"]


def test_load_of_a_torch_dist_training_checkpoint_resumes_from_it(tmp_path):
    """``--load`` of the PyTorch lane's torch_dist checkpoint resumes from it
    (``checkpoint.resume_from``) and ``--ckpt-format torch_dist`` saves in that format; with
    ``--finetune`` (weights only) it is refused in one line."""
    from ms_llm.checkpoint.torch_dist.io import TorchDistWriter
    import numpy as np
    w = TorchDistWriter(str(tmp_path / "ck" / "iter_0000010"))
    w.add("output_layer.weight", (2, 2), (0, 0), np.zeros((2, 2), np.float32))
    w.close({"iteration": 10})
    argv = SCRIPTS["qwen3/pretrain_qwen3_0point6b_4K_ptd.sh"]["argv"] + \
        ["--load", str(tmp_path / "ck")]
    argv = [a for a in argv if a not in ("--no-load-optim", "--no-load-rng", "--finetune")]
    keys = translate(argv + ["--ckpt-format", "torch_dist"]).keys
    assert keys["checkpoint.resume_from"] == str(tmp_path / "ck")
    assert keys["checkpoint.format"] == "torch_dist" and "checkpoint.load" not in keys
    with pytest.raises(ConfigError, match=r"--load .*ck: a torch_dist training checkpoint with "
                                          r"--finetune: loading its weights alone is not built"):
        translate(argv + ["--finetune"])
    with pytest.raises(ConfigError, match=r"--ckpt-format zarr: not supported"):
        translate(argv + ["--ckpt-format", "zarr"])


def test_load_of_a_legacy_training_checkpoint_resumes_unless_weights_only(tmp_path):
    """A legacy ``--ckpt-format torch`` folder whose file holds an optimizer entry resumes
    (``checkpoint.resume_from``); with ``--no-load-optim`` (the published scripts' converted
    weights) it stays ``checkpoint.load``, the weights only, as before."""
    from ms_llm.checkpoint import torch_pickle
    d = tmp_path / "ck" / "iter_0000003" / "mp_rank_00"
    d.mkdir(parents=True)
    torch_pickle.save({"iteration": 3, "model": {}, "optimizer": {"state": {}}},
                      str(d / "model_optim_rng.pt"))
    (tmp_path / "ck" / "latest_checkpointed_iteration.txt").write_text("3")
    argv = SCRIPTS["qwen3/pretrain_qwen3_0point6b_4K_ptd.sh"]["argv"] + \
        ["--load", str(tmp_path / "ck")]
    resume = [a for a in argv if a not in ("--no-load-optim", "--no-load-rng")]
    assert translate(resume).keys["checkpoint.resume_from"] == str(tmp_path / "ck")
    keys = translate(argv).keys
    assert keys["checkpoint.load"] == str(tmp_path / "ck") and "checkpoint.resume_from" not in keys


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
@pytest.mark.parametrize("weights_only", [False, True])
def test_load_of_a_damaged_pt_is_one_line(tmp_path, capsys, damage, weights_only):
    """``pretrain_gpt.py --load`` of a legacy folder whose ``model_optim_rng.pt`` is garbage or
    truncated: one line naming the file, exit code 2, no traceback (resume and weights-only)."""
    import numpy as np
    from ms_llm.checkpoint import torch_pickle
    from ms_llm.mindspeed.entry import main
    d = tmp_path / "ck" / "iter_0000003" / "mp_rank_00"
    d.mkdir(parents=True)
    pt = d / "model_optim_rng.pt"
    torch_pickle.save({"iteration": 3, "model": {"w": np.ones((64, 64), np.float32)},
                       "optimizer": {"state": {}}}, str(pt))
    if damage == "garbage":
        pt.write_bytes(b"not a torch checkpoint" * 8)
    else:
        os.truncate(pt, os.path.getsize(pt) // 2)
    (tmp_path / "ck" / "latest_checkpointed_iteration.txt").write_text("3")
    argv = SCRIPTS["qwen3/pretrain_qwen3_0point6b_4K_ptd.sh"]["argv"] + \
        ["--load", str(tmp_path / "ck")]
    if not weights_only:
        argv = [a for a in argv if a not in ("--no-load-optim", "--no-load-rng")]
    capsys.readouterr()
    assert main(argv) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("pretrain_gpt.py: --load"), err
    assert f"{pt}: not a torch zip checkpoint or truncated" in err[0]


def test_o2_packed_and_unshuffled_scripts_map_their_flags():
    """MindSpeed's O2 (bf16 moments, bf16 gradient accumulation), --padded-samples, --no-shuffle
    and evaluation under pipeline parallel (the llama2 13B pack scripts evaluate at pp 4)."""
    _, cfg = resolve(SCRIPTS["llama2/pretrain_llama2_13b_pack_ptd_o2.sh"]["argv"])
    assert cfg.training.adam_moments_dtype == "bfloat16"
    assert cfg.parallel.grad_reduce_in_fp32 is False and cfg.training.bf16
    _, cfg = resolve(SCRIPTS["llama2/pretrain_llama2_13b_pack_ptd.sh"]["argv"])
    assert cfg.parallel.pipeline_model_parallel_size > 1
    assert (cfg.training.eval_interval, cfg.training.eval_iters) == (1000, 10)
    assert cfg.training.adam_moments_dtype == "float32" and cfg.parallel.grad_reduce_in_fp32
    _, cfg = resolve(SCRIPTS["qwen25/tune_qwen25_72b_4k_lora_ptd.sh"]["argv"])
    assert cfg.data.padded_samples and not cfg.data.shuffle
    _, cfg = resolve(SCRIPTS["qwen25/tune_qwen25_72b_4k_full_ptd.sh"]["argv"])
    assert cfg.data.padded_samples and cfg.data.shuffle
