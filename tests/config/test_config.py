"""The run-config schema: YAML + dotted overrides, rejection of bad input, published architectures."""
import os
import subprocess
import sys

import pytest
from helpers.cli import ms_llm_exe

from ms_llm.config import ConfigError, load_config, parse_overrides
from ms_llm.models import GPTModel, TransformerConfig
from helpers.paths import ROOT

CONFIGS = os.path.join(ROOT, "configs")


def write(tmp_path, text, name="c.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_defaults_and_overrides(tmp_path):
    path = write(tmp_path, "model:\n  family: qwen3\n  num_layers: 3\ntraining:\n  lr: 1.0e-3\n")
    cfg = load_config(path, ["--training.max_steps", "20", "--model.hidden_size=96",
                             "--training.lr", "2e-4", "--training.jit", "true"])
    assert cfg.training.max_steps == 20 and cfg.training.lr == pytest.approx(2e-4)
    assert cfg.training.jit is True
    assert cfg.model.num_layers == 3 and cfg.model.hidden_size == 96
    assert cfg.model.qk_layernorm is True           # from the qwen3 family
    assert cfg.model.kv_channels == 96 // cfg.model.num_attention_heads


def test_explicit_key_beats_family_default(tmp_path):
    path = write(tmp_path, "model:\n  family: qwen3\n  qk_layernorm: false\n")
    assert load_config(path).model.qk_layernorm is False


@pytest.mark.parametrize("text,override,needle", [
    ("training:\n  max_stepz: 3\n", [], "training.max_stepz"),
    ("bogus:\n  a: 1\n", [], "bogus"),
    ("model:\n  hidden_sise: 3\n", [], "model.hidden_sise"),
    ("training:\n  max_steps: three\n", [], "training.max_steps"),
    ("training:\n  lr: [1]\n", [], "training.lr"),
    ("training:\n  jit: 3\n", [], "training.jit"),
    ("", ["--training.seed", "x"], "training.seed"),
    ("", ["--nope.key", "1"], "nope.key"),
    ("model:\n  hidden_size: 96\n  num_attention_heads: 6\n  num_query_groups: 4\n", [],
     "num_query_groups"),
    ("model:\n  family: gpt5\n", [], "gpt5"),
    ("parallel:\n  context_parallel_size: 3\n", [], "context_parallel_size"),
    ("parallel:\n  sequence_parallel: true\n", [], "sequence_parallel"),
])
def test_bad_config_is_one_line_naming_key_and_source(tmp_path, text, override, needle):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config(path, override)
    msg = str(e.value)
    assert needle in msg and "\n" not in msg
    assert path in msg or "command line" in msg


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(str(tmp_path / "missing.yaml"))
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(write(tmp_path, "model: [unclosed\n"))


def test_parse_overrides_forms():
    assert parse_overrides(["--a.b", "1", "--c.d=x"]) == [("a.b", "1"), ("c.d", "x")]
    with pytest.raises(ConfigError):
        parse_overrides(["--a.b"])
    with pytest.raises(ConfigError):
        parse_overrides(["positional"])


def test_cli_bad_config_exits_nonzero_with_one_line(tmp_path):
    path = write(tmp_path, "training:\n  max_stepz: 3\n")
    r = subprocess.run([sys.executable, "-m", "ms_llm.cli.train", path], capture_output=True,
                       text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2
    err = [line for line in r.stderr.splitlines() if line.strip()]
    assert err == [f"config error: {path}: unknown key 'training.max_stepz'"]


def _env_with_this_python():
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return env


def test_launcher_rejects_bad_config_before_msrun(tmp_path):
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "pretrain.sh"),
                        "--training.max_steps", "many"], capture_output=True, text=True,
                       timeout=120, env=_env_with_this_python())
    assert r.returncode == 2
    assert "training.max_steps" in r.stderr and "msrun" not in r.stdout
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "pretrain.sh"),
                        str(tmp_path / "nope.yaml")], capture_output=True, text=True, timeout=60,
                       env=_env_with_this_python())
    assert r.returncode == 2 and "nope.yaml" in r.stderr


def _expected_params(c: TransformerConfig) -> int:
    """Parameter count written from the architecture (independent of GPTModel)."""
    h, f, d = c.hidden_size, c.ffn_hidden_size, c.kv_channels
    q, kv = c.num_attention_heads * d, c.num_query_groups * d
    attn = h * (q + 2 * kv) + q * h + (q + 2 * kv if c.add_qkv_bias else 0)
    attn += 2 * d if c.qk_layernorm else 0
    mlp = h * 2 * f + f * h
    layer = attn + mlp + 2 * h
    emb = c.padded_vocab_size * h
    out = emb if c.untie_embeddings_and_output_weights else 0
    return c.num_layers * layer + h + emb + out


def test_param_formula_matches_built_model():
    for kw in (dict(qk_layernorm=True), dict(add_qkv_bias=True, num_query_groups=1),
               dict(untie_embeddings_and_output_weights=False, kv_channels=24)):
        c = TransformerConfig(num_layers=2, hidden_size=64, ffn_hidden_size=96,
                              num_attention_heads=4, num_query_groups=kw.pop("num_query_groups", 2),
                              padded_vocab_size=100, **kw)
        assert GPTModel(c).num_parameters() == _expected_params(c)


# Published totals (model cards / config.json arithmetic), in parameters.
@pytest.mark.parametrize("name,total,tol", [
    ("qwen3_0p6b.yaml", 0.596e9, 0.005e9),   # Qwen3-0.6B: 0.6B (0.44B non-embedding), tied
    ("qwen3_8b.yaml", 8.19e9, 0.01e9),       # Qwen3-8B: 8.2B
    ("llama3_8b.yaml", 8.03e9, 0.01e9),      # Llama-3-8B: 8.03B
    ("qwen25_7b.yaml", 7.62e9, 0.01e9),      # Qwen2.5-7B: 7.61B
])
def test_real_model_configs(name, total, tol):
    cfg = load_config(os.path.join(CONFIGS, name))
    assert abs(_expected_params(cfg.model) - total) < tol


def test_default_config_loads():
    cfg = load_config(os.path.join(CONFIGS, "tiny.yaml"))
    assert cfg.model.qk_layernorm and cfg.data.corpus == "embedded"


def test_moe_and_expert_parallel_config_checks():
    cfg = load_config(os.path.join(CONFIGS, "tiny_moe.yaml"))
    assert cfg.model.mlp_type == "moe" and cfg.model.num_moe_experts == 8
    assert cfg.moe.dispatcher == "alltoall" and not cfg.training.jit
    moe_yaml = os.path.join(CONFIGS, "tiny_moe.yaml")
    bad = [
        (os.path.join(CONFIGS, "tiny.yaml"), ["--parallel.expert_model_parallel_size", "2"],
         "needs model.mlp_type moe"),
        (moe_yaml, ["--parallel.expert_model_parallel_size", "3"], "not divisible"),
        (moe_yaml, ["--parallel.tensor_model_parallel_size", "2"], "expert tensor parallel"),
        (moe_yaml, ["--moe.dispatcher", "deepep"], "moe.dispatcher"),
        (moe_yaml, ["--moe.token_chunks", "0"], "moe.token_chunks"),
        (moe_yaml, ["--moe.groups", "2"], "unknown key 'moe.groups'"),
        (moe_yaml, ["--parallel.fsdp_reduce_dtype", "int8"], "parallel.fsdp_reduce_dtype"),
        (os.path.join(CONFIGS, "tiny.yaml"), ["--parallel.tensor_model_parallel_size", "2",
                                              "--parallel.tp_comm_overlap", "true"],
         "parallel.tp_comm_overlap .* needs parallel.sequence_parallel true"),
    ]
    for path, overrides, needle in bad:
        with pytest.raises(ConfigError, match=needle) as e:
            load_config(path, overrides)
        assert "\n" not in str(e.value)


# ----------------------------------------------------------------------- values and their sources
@pytest.mark.parametrize("key,value,needle", [
    ("training.lr", "-1", "must be >= 0"),
    ("training.min_lr", "-0.5", "must be >= 0"),
    ("training.max_steps", "0", "must be > 0"),
    ("training.micro_batch_size", "-2", "must be > 0"),
    ("training.global_batch_size", "0", "must be > 0"),
    ("training.lr_warmup_steps", "-1", "must be >= 0"),
    ("training.lr_decay_steps", "0", "must be > 0"),
    ("training.adam_beta2", "1.0", "must be in [0, 1)"),
    ("training.adam_eps", "0", "must be > 0"),
    ("training.weight_decay", "-0.1", "must be >= 0"),
    ("training.lr_decay_style", "exponential", "must be one of cosine, linear, constant"),
    ("data.seq_length", "0", "must be > 0"),
    ("model.num_layers", "0", "must be > 0"),
    ("model.hidden_size", "-64", "must be > 0"),
    ("model.num_attention_heads", "0", "must be > 0"),
    ("model.padded_vocab_size", "0", "must be > 0"),
    ("model.hidden_dropout", "1.5", "must be in [0, 1]"),
    ("model.attention_dropout", "-0.1", "must be in [0, 1]"),
    ("parallel.fsdp_size", "0", "must be >= 1"),
    ("parallel.ddp_bucket_mb", "0", "must be > 0"),
    ("checkpoint.save_interval", "-5", "must be >= 0"),
    ("checkpoint.keep_last", "0", "must be >= 1"),
    ("moe.expert_groups", "0", "must be >= 1"),
])
def test_bad_values_name_key_and_source(tmp_path, key, value, needle):
    """The same bad value, once from the YAML file and once from the command line: each error
    is one line naming the key and exactly the source that set it."""
    section, name = key.split(".")
    path = write(tmp_path, f"{section}:\n  {name}: {value}\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value).startswith(f"{path}: {key} {needle}"), str(e.value)
    assert "\n" not in str(e.value)
    good = write(tmp_path, "training:\n  lr: 1.0e-3\n", name="good.yaml")
    with pytest.raises(ConfigError) as e:
        load_config(good, [f"--{key}", value])
    msg = str(e.value)
    assert msg.startswith(f"command line --{key}: {key} {needle}"), msg
    assert good not in msg and "\n" not in msg


def test_cross_key_errors_name_the_source_of_their_key(tmp_path):
    path = write(tmp_path, "training:\n  lr: 1.0e-3\n  jit: true\n")
    with pytest.raises(ConfigError) as e:
        load_config(path, ["--parallel.sequence_parallel", "true"])
    assert str(e.value).startswith("command line --parallel.sequence_parallel: ")
    with pytest.raises(ConfigError) as e:
        load_config(path, ["--parallel.virtual_pipeline_model_parallel_size", "2"])
    assert str(e.value).startswith("command line --parallel.virtual_pipeline_model_parallel_size: ")
    with pytest.raises(ConfigError) as e:   # min_lr above lr, lr set on the command line
        load_config(path, ["--training.lr", "1e-5"])
    assert str(e.value).startswith("command line --training.lr: training.min_lr (0.0001) must "
                                   "be <= training.lr")
    with pytest.raises(ConfigError) as e:   # TransformerConfig's own check, key from the CLI
        load_config(os.path.join(CONFIGS, "tiny.yaml"), ["--model.num_query_groups", "3"])
    assert str(e.value).startswith("command line --model.num_query_groups: ")
    bad = write(tmp_path, "parallel:\n  expert_model_parallel_size: 2\n", name="b.yaml")
    with pytest.raises(ConfigError) as e:
        load_config(bad)
    assert str(e.value).startswith(f"{bad}: parallel.expert_model_parallel_size=2 needs "
                                   f"model.mlp_type moe")
    with pytest.raises(ConfigError) as e:   # the same check, the key now from the command line
        load_config(bad, ["--parallel.expert_model_parallel_size", "4"])
    assert str(e.value).startswith("command line --parallel.expert_model_parallel_size: ")


def test_missing_checkpoint_load_folder_is_one_line(tmp_path):
    missing = str(tmp_path / "no_such_hf_folder")
    path = write(tmp_path, f"checkpoint:\n  load: {missing}\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value) == f"{path}: checkpoint.load must be an existing folder, got {missing!r}"
    # An existing folder is read at load time (it defines the architecture): one line too.
    (tmp_path / "hf").mkdir()
    with pytest.raises(ConfigError) as e:
        load_config(None, ["--checkpoint.load", str(tmp_path / "hf")])
    assert "config.json" in str(e.value) and "\n" not in str(e.value)


def test_model_section_is_the_transformer_config():
    import ms_llm.config as config
    assert not hasattr(config, "ModelSection")   # model: is TransformerConfig + family, only


def ms_llm_command():
    return ms_llm_exe()


@pytest.mark.parametrize("override,key", [(["--training.lr", "-1"], "training.lr"),
                                          (["--checkpoint.load", "/no/such/dir"],
                                           "checkpoint.load")])
def test_cli_bad_override_is_one_line_naming_key_and_command_line(tmp_path, override, key):
    r = subprocess.run([ms_llm_command(), "train", os.path.join(CONFIGS, "tiny.yaml"),
                        *override], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert r.returncode != 0
    err = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(err) == 1, r.stderr
    assert err[0].startswith(f"config error: command line --{key}: {key} must be "), err[0]
    assert "tiny.yaml" not in err[0]


def test_yarn_is_selectable_from_the_config():
    cfg = load_config(None, ["--model.position_embedding_type", "yarn",
                             "--model.yarn_rotary_scaling_factor", "4",
                             "--model.yarn_original_max_position_embeddings", "64"])
    assert cfg.model.position_embedding_type == "yarn" and cfg.model.yarn_rotary_scaling_factor == 4
    with pytest.raises(ConfigError, match="yarn_rotary_scaling_factor must be > 0"):
        load_config(None, ["--model.yarn_rotary_scaling_factor", "0"])


def test_merge_overrides_keeps_each_key_once_with_its_last_value():
    """Launch lines composed in code (benchmarks, tests) merge before the command line, which
    refuses a key given twice."""
    from ms_llm.config import ConfigError, merge_overrides, parse_overrides
    base = ["--training.max_steps", "5", "--model.hidden_size=64", "--training.lr", "1e-3"]
    merged = merge_overrides(base, ["--training.max_steps", "9"], ["--data.seq_length", "32"])
    assert parse_overrides(merged) == [("model.hidden_size", "64"), ("training.lr", "1e-3"),
                                       ("training.max_steps", "9"), ("data.seq_length", "32")]
    with pytest.raises(ConfigError, match="given twice"):
        parse_overrides(base + ["--training.max_steps", "9"])
