"""The validation layer for external inputs (``ms_llm.validation``): duplicate keys in YAML and
JSON, JSON that is not an object, architecture types and size bounds, PEFT adapter configs,
generation flag ranges. The commands' one-line reporting is ``test_fault_matrix``."""
import json
import math

import pytest
import yaml

from ms_llm.validation import (InputError, check_generation_flags, read_json_object,
                               size_bound_problem, validate_adapter_config, validate_hf_config,
                               yaml_load_unique)


def test_yaml_duplicate_keys_refused_at_any_depth():
    assert yaml_load_unique("a: {x: 1}\nb: [1, 1]\n") == {"a": {"x": 1}, "b": [1, 1]}
    with pytest.raises(yaml.YAMLError, match=r"key 'x' given twice \(lines 1 and 1\)"):
        yaml_load_unique("a: {x: 1, x: 2}\n")
    with pytest.raises(yaml.YAMLError, match=r"key 'a' given twice \(lines 1 and 3\)"):
        yaml_load_unique("a:\n  x: 1\na: {}\n")
    with pytest.raises(yaml.YAMLError):   # still a safe loader: no Python objects
        yaml_load_unique("!!python/object/apply:os.system ['true']\n")


def test_json_objects(tmp_path):
    p = tmp_path / "c.json"
    for text, why in [("[1]", "expected a JSON object"), ('{"a": 1, "a": 2}', "given twice"),
                      ('{"a": Infinity}', "Infinity is not valid JSON"), ("{", "invalid JSON")]:
        p.write_text(text)
        with pytest.raises(InputError, match=why):
            read_json_object(str(p))
    p.write_bytes(b'{"a": "\xff"}')
    with pytest.raises(InputError, match="not UTF-8"):
        read_json_object(str(p))
    p.write_text('{"a": [1, {"b": 2}]}')
    assert read_json_object(str(p)) == {"a": [1, {"b": 2}]}


GOOD = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 96,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "head_dim": None}


@pytest.mark.parametrize("key,value,why", [
    ("num_hidden_layers", "4", "must be an integer, got '4'"),
    ("hidden_size", 64.5, "must be an integer, got 64.5"),
    ("num_hidden_layers", 1e9, "must be an integer"),
    ("num_hidden_layers", True, "must be an integer"),
    ("vocab_size", 10 ** 12, r"outside \[1, 8388608\]"),
    ("num_attention_heads", 0, r"outside \[1, 4096\]"),
    ("rms_norm_eps", math.inf, "rms_norm_eps = inf is outside"),
    ("rope_theta", 0, r"rope_theta = 0 is outside \(0.0"),
    ("rope_theta", "1e4", "must be a number"),
    ("tie_word_embeddings", "yes", "must be true or false"),
    ("mlp_only_layers", [0, "1"], "list of layer indices"),
])
def test_hf_config_types_and_bounds(key, value, why):
    assert validate_hf_config(dict(GOOD), "c.json") == GOOD
    with pytest.raises(InputError, match=f"^c.json: {key}.*{why}|^c.json: {why}"):
        validate_hf_config(dict(GOOD, **{key: value}), "c.json")
    with pytest.raises(InputError, match="expected a JSON object, got list"):
        validate_hf_config([GOOD], "c.json")


def test_adapter_config():
    ok = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}
    assert validate_adapter_config(ok, "a.json") is ok
    for bad, why in [({"r": 0, "lora_alpha": 1}, r"r = 0 is outside"),
                     ({"r": 8.0, "lora_alpha": 1}, "r must be an integer"),
                     ({"r": 8, "lora_alpha": math.nan}, "lora_alpha = nan"),
                     ({"r": 8}, "missing key 'lora_alpha'"),
                     ({"r": 8, "lora_alpha": 1, "target_modules": 3}, "target_modules must be")]:
        with pytest.raises(InputError, match=why):
            validate_adapter_config(bad, "a.json")


def test_generation_flags_and_run_size_bounds():
    check_generation_flags(1, 0.0, 0, 1.0, 1, 0)
    for kw, why in [({"top_p": 5.0}, r"--top-p = 5.0 is outside \(0.0, 1.0\]"),
                    ({"top_p": 0.0}, "--top-p = 0.0 is outside"),
                    ({"temperature": -1.0}, "--temperature = -1.0"),
                    ({"temperature": math.nan}, "--temperature = nan"),
                    ({"max_context": -3}, r"--max-context = -3 is outside \[1,"),
                    ({"max_new_tokens": 0}, "--max-new-tokens = 0"),
                    ({"top_k": -1}, "--top-k = -1"), ({"seed": -1}, "--seed = -1")]:
        with pytest.raises(InputError, match=why):
            check_generation_flags(**kw)
    assert size_bound_problem("model.num_layers", 4096) is None
    assert "above the bound 4096" in size_bound_problem("model.num_layers", 4097)
    assert size_bound_problem("training.lr", 10 ** 9) is None
    assert json.dumps(size_bound_problem("data.seq_length", 1 << 28))
