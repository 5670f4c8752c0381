"""Context-parallel config rules: one line naming the key, before any process starts."""
import pytest

from ms_llm.config import ConfigError, load_config


def bad(*overrides):
    with pytest.raises(ConfigError) as e:
        load_config(None, list(overrides))
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_context_parallel_config_errors():
    cp2 = ["--parallel.context_parallel_size", "2"]
    assert "2*cp chunks" in bad(*cp2, "--data.seq_length", "250")
    assert "ulysses_degree_in_cp" in bad("--parallel.context_parallel_size", "4",
                                         "--parallel.context_parallel_algo", "hybrid_cp_algo")
    assert "ulysses_degree_in_cp" in bad(*cp2, "--parallel.ulysses_degree_in_cp", "2")
    assert "one of" in bad(*cp2, "--parallel.context_parallel_algo", "ring")
    # 6 heads, 3 query groups: Ulysses degree 2 divides neither the groups nor is a multiple
    msg = bad(*cp2, "--parallel.context_parallel_algo", "ulysses_cp_algo",
              "--model.num_attention_heads", "6", "--model.num_query_groups", "3",
              "--model.kv_channels", "16")
    assert "Ulysses degree 2" in msg and "query groups" in msg
    assert "max_position_embeddings" in bad(*cp2, "--data.seq_length", "8192",
                                            "--model.max_position_embeddings", "4096")


def test_context_parallel_configs_accepted():
    for algo, extra in (("megatron_cp_algo", []), ("ulysses_cp_algo", []),
                        ("hybrid_cp_algo", ["--parallel.ulysses_degree_in_cp", "2"])):
        cfg = load_config(None, ["--parallel.context_parallel_size", "4",
                                 "--parallel.context_parallel_algo", algo, *extra])
        assert cfg.parallel.context_parallel_algo == algo


def test_context_parallel_composes_with_pipeline_and_recompute():
    """cp x pipeline (1F1B, interleaved) and cp x activation recompute are accepted (trained
    and compared to one process in test_context_parallel_training.py)."""
    cp2 = ["--parallel.context_parallel_size", "2"]
    cfg = load_config(None, cp2 + ["--parallel.pipeline_model_parallel_size", "2",
                                   "--parallel.virtual_pipeline_model_parallel_size", "2",
                                   "--model.num_layers", "4"])
    assert cfg.parallel.pipeline_model_parallel_size == 2
    for extra in (["--training.recompute_granularity", "full"],
                  ["--training.recompute_granularity", "selective",
                   "--training.recompute_norm", "true"]):
        cfg = load_config(None, cp2 + extra)
        assert cfg.parallel.context_parallel_size == 2
