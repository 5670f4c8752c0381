"""``checkpoint.load``: the loaded folder (HF or Megatron) defines the run's architecture.

A run that starts from a folder takes ``cfg.model`` from it (data setup, the pipeline / expert
checks, the saved ``model_config`` and ``ms-llm export`` see the weights' real shapes); model
keys the user asked for (command line, or a YAML file they named; not the default
``configs/tiny.yaml``) must agree with the folder, else one line names the key, both values, the
source and the folder; the tokenizer must fit the embedding. What the run saves exports back to
the same architecture with the trained weights.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
from mindspore import Tensor

from helpers.finetune_fixtures import write_tokenizer
from helpers.hf_fixtures import make_hf_checkpoint
from helpers.cli import run_ms_llm
from ms_llm.checkpoint.hf.pretrained import pretrained_architecture
from ms_llm.config.pretrained import DEFAULT_CONFIG
from ms_llm.config import ConfigError, load_config
from ms_llm.checkpoint import from_pretrained
from ms_llm.training.data_setup import build_data
from ms_llm.training.trainer import Trainer
from helpers.paths import ROOT

CONFIG = os.path.join(ROOT, "configs", "tiny.yaml")   # its model: 4 layers, hidden 256
RUN = ["--data.seq_length", "16", "--training.micro_batch_size", "2",
       "--training.global_batch_size", "2", "--training.progress_bar", "false",
       "--training.lr_warmup_steps", "1", "--training.log_interval", "1",
       "--training.jit", "false"]


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """A 2-layer Qwen3 folder with its own 32-token tokenizer, and a corpus in its words."""
    root = tmp_path_factory.mktemp("pretrained_run")
    make_hf_checkpoint(root / "hf", "qwen3", hidden=64, layers=2, heads=4, kv_heads=2,
                       head_dim=16, ffn=96, vocab=64, tied=False, seed=5)
    write_tokenizer(root / "hf")
    corpus = root / "corpus.txt"
    corpus.write_text("\n\n".join(" ".join(f"w{(i * j + j) % 30}" for j in range(60))
                                  for i in range(40)))
    return root


def data_args(root) -> list:
    return ["--data.tokenizer", str(root / "hf"), "--data.corpus", str(root / "corpus.txt")]


def run_cfg(root, tmp_path, *extra, config=CONFIG):
    return load_config(config, ["--checkpoint.load", str(root / "hf"), *data_args(root), *RUN,
                                "--training.output_dir", str(tmp_path / "out"), *extra])


def config_error(root, tmp_path, *extra, config=CONFIG) -> str:
    """The one-line error of a run (raised by load_config or by the Trainer)."""
    with pytest.raises(ConfigError) as e:
        Trainer(run_cfg(root, tmp_path, *extra, config=config))
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def test_default_config_path_is_the_trainers():
    from ms_llm.cli.train import DEFAULT_CONFIG as TRAIN_DEFAULT
    assert os.path.realpath(DEFAULT_CONFIG) == os.path.realpath(TRAIN_DEFAULT)


def test_the_folder_defines_the_model_and_the_default_configs_keys_do_not_count(hf, tmp_path):
    cfg = run_cfg(hf, tmp_path)          # configs/tiny.yaml: 4 layers, hidden 256, untied false
    trainer = Trainer(cfg)
    want, family = pretrained_architecture(str(hf / "hf"))
    assert cfg.model == want and cfg.model_family == family == "qwen3"
    assert trainer.model.config == want
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.padded_vocab_size) == \
        (2, 64, 64)


def test_requested_keys_that_agree_are_fine_and_training_keys_apply(hf, tmp_path):
    yaml = tmp_path / "mine.yaml"
    yaml.write_text("model:\n  family: qwen3\n  num_layers: 2\n  hidden_size: 64\n"
                    "  rotary_base: 10000\n  untie_embeddings_and_output_weights: true\n"
                    "  hidden_dropout: 0.1\n")
    cfg = run_cfg(hf, tmp_path, "--model.kv_channels", "16", config=str(yaml))
    Trainer(cfg)
    want, _ = pretrained_architecture(str(hf / "hf"))
    assert cfg.model == want.replace(hidden_dropout=0.1)


def test_command_line_key_that_disagrees_is_one_line(hf, tmp_path):
    msg = config_error(hf, tmp_path, "--model.num_layers", "4")
    assert msg.startswith("command line --model.num_layers: model.num_layers=4 disagrees with "
                          f"checkpoint.load {hf / 'hf'} (num_layers=2)"), msg


def test_named_yaml_key_that_disagrees_is_one_line(hf, tmp_path):
    yaml = tmp_path / "mine.yaml"
    yaml.write_text("model:\n  family: qwen3\n  hidden_size: 128\n  num_attention_heads: 8\n"
                    "  kv_channels: 16\n")
    msg = config_error(hf, tmp_path, config=str(yaml))
    assert msg.startswith(f"{yaml}: model.hidden_size=128 disagrees with checkpoint.load "
                          f"{hf / 'hf'} (hidden_size=64)"), msg


def test_family_that_disagrees_is_one_line(hf, tmp_path):
    msg = config_error(hf, tmp_path, "--model.family", "llama3")
    assert msg.startswith("command line --model.family: model.family='llama3' disagrees with "
                          f"checkpoint.load {hf / 'hf'} (family='qwen3')"), msg


def test_tokenizer_larger_than_the_embedding_is_one_line(hf, tmp_path):
    # the embedded tokenizer has 4096 tokens, the folder 64 embedding rows
    msg = config_error(hf, tmp_path, "--data.tokenizer", "embedded", "--data.corpus", "embedded")
    assert msg.startswith("command line --data.tokenizer: data.tokenizer ") and \
        f"has 4096 tokens but checkpoint.load {hf / 'hf'} has 64 embedding rows" in msg, msg


def test_cross_key_checks_run_on_the_loaded_architecture(hf, tmp_path):
    # tiny.yaml's 4 layers split over 4 stages; the folder's 2 layers do not
    with pytest.raises(ConfigError, match="num_layers"):
        build_data(run_cfg(hf, tmp_path, "--parallel.pipeline_model_parallel_size", "4"))


def test_cli_train_disagreement_is_one_stderr_line(hf, tmp_path):
    r = run_ms_llm("train", "--checkpoint.load", str(hf / "hf"), *data_args(hf),
                   "--model.num_query_groups", "4", "--training.max_steps", "1",
                   "--training.output_dir", str(tmp_path / "out"),
                   cwd=tmp_path, timeout=300)   # GLOG_v=3: not MindSpore's deprecation notes
    assert r.returncode != 0
    err = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(err) == 1, r.stderr
    assert err[0].startswith("config error: command line --model.num_query_groups: "
                             "model.num_query_groups=4 disagrees with checkpoint.load"), err[0]


def test_train_export_reload_round_trip(hf, tmp_path):
    from ms_llm import cli
    cfg = run_cfg(hf, tmp_path, "--training.max_steps", "2", "--checkpoint.save_dir",
                  str(tmp_path / "ck"))
    trainer = Trainer(cfg)
    trainer.fit()
    assert cli.main(["export", str(tmp_path / "ck"), str(tmp_path / "exported")]) == 0
    reloaded = from_pretrained(str(tmp_path / "exported"))
    assert reloaded.config == cfg.model
    with open(tmp_path / "exported" / "config.json") as f:
        assert json.load(f)["num_hidden_layers"] == 2
    ids = Tensor(np.arange(24, dtype=np.int32).reshape(2, 12) % 32)
    trained = trainer.model(ids).asnumpy()
    np.testing.assert_array_equal(reloaded(ids).asnumpy(), trained)
    base = from_pretrained(str(hf / "hf"))(ids).asnumpy()
    assert not np.allclose(base, trained)          # the export holds the trained weights


def test_megatron_folder_defines_the_model_with_its_padded_vocabulary(hf, tmp_path):
    from ms_llm.checkpoint.convert import main as convert_main
    mg = tmp_path / "mg"
    assert convert_main(["--load-model-type", "hf", "--save-model-type", "mg", "--load-dir",
                         str(hf / "hf"), "--save-dir", str(mg), "--target-tensor-parallel-size",
                         "2", "--make-vocab-size-divisible-by", "48"]) == 0
    cfg = load_config(CONFIG, ["--checkpoint.load", str(mg), *data_args(hf), *RUN,
                               "--training.output_dir", str(tmp_path / "out")])
    trainer = Trainer(cfg)
    assert cfg.model.padded_vocab_size == 96 and cfg.model.num_layers == 2
    assert trainer.model.config == cfg.model
    with pytest.raises(ConfigError, match=r"model.padded_vocab_size=64 disagrees .*"
                                          r"\(padded_vocab_size=96\)"):
        Trainer(load_config(CONFIG, ["--checkpoint.load", str(mg), *data_args(hf), *RUN,
                                     "--model.padded_vocab_size", "64"]))


def test_moe_settings_follow_the_loaded_model(hf, tmp_path):
    from helpers.convert_moe_fixture import make_qwen3_moe   # 3 layers, 4 experts top-2, 1 dense
    make_qwen3_moe(tmp_path / "moe")
    write_tokenizer(tmp_path / "moe")
    args = ["--checkpoint.load", str(tmp_path / "moe"), "--data.tokenizer", str(tmp_path / "moe"),
            "--data.corpus", str(hf / "corpus.txt"), *RUN, "--training.max_steps", "1",
            "--training.output_dir", str(tmp_path / "out")]
    cfg = load_config(CONFIG, args + ["--model.moe_aux_loss_coeff", "0.01"])
    Trainer(cfg).fit()
    m = cfg.model
    assert (m.mlp_type, m.num_moe_experts, m.moe_router_topk, m.moe_ffn_hidden_size) == \
        ("moe", 4, 2, 16)
    assert m.moe_layer_pattern == [1, 0, 1] and m.moe_aux_loss_coeff == 0.01
    assert cfg.model_family == "qwen3-moe"
    with pytest.raises(ConfigError, match=r"model.num_moe_experts=8 disagrees .*"
                                          r"\(num_moe_experts=4\)"):
        Trainer(load_config(CONFIG, args + ["--model.num_moe_experts", "8"]))


def test_shipped_architecture_config_agrees_with_the_published_folder(tmp_path):
    """configs/qwen3_0p6b.yaml names Qwen3-0.6B's architecture: with checkpoint.load of that
    folder (only its config.json is read here) every key it sets agrees."""
    from ms_llm.config.pretrained import adopt_pretrained_architecture
    folder = tmp_path / "Qwen3-0.6B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
        "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-06, "rope_theta": 1000000,
        "rope_scaling": None, "tie_word_embeddings": True, "hidden_act": "silu",
        "attention_bias": False, "torch_dtype": "bfloat16"}))
    cfg = load_config(os.path.join(ROOT, "configs", "qwen3_0p6b.yaml"),
                      ["--checkpoint.load", str(folder)])
    adopt_pretrained_architecture(cfg)
    assert cfg.model == pretrained_architecture(str(folder))[0]
    with pytest.raises(ConfigError, match=r"qwen3_8b.yaml: model.num_layers=36 disagrees"):
        adopt_pretrained_architecture(load_config(os.path.join(ROOT, "configs", "qwen3_8b.yaml"),
                                                  ["--checkpoint.load", str(folder)]))
