"""PEFT ``adapter_config.json`` fields are honoured by the merge or refused (issue #41); the
refusals are cases of tests/cli/test_fault_matrix.py, the honoured fields are checked here."""
import json
import math

import numpy as np
import pytest
from safetensors.numpy import save_file

from ms_llm.checkpoint.adapters.merge import AdapterError, read_peft_adapters
from ms_llm.checkpoint.adapters.peft_fields import NEUTRAL, REFUSED_UNLESS, WHY

KEY = "base_model.model.model.layers.{}.self_attn.{}.lora_{}.weight"


def write_peft(folder, cfg, layers=(0,), module="q_proj", b_value=0.5):
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8, **cfg}))
    tensors = {}
    for i in layers:
        tensors[KEY.format(i, module, "A")] = np.full((4, 16), 0.25, np.float32)
        tensors[KEY.format(i, module, "B")] = np.full((16, 4), b_value, np.float32)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def test_layers_to_transform_names_the_adapted_layers(tmp_path):
    ad = read_peft_adapters(write_peft(tmp_path / "a", {"layers_to_transform": [0, 2],
                                                        "layers_pattern": "layers"},
                                       layers=(0, 2)))
    assert ad.layers() == [0, 2]
    with pytest.raises(AdapterError, match=r"hold layer 1 self_attn.q_proj, but "
                                           r"layers_to_transform is \[0\]"):
        read_peft_adapters(write_peft(tmp_path / "b", {"layers_to_transform": 0},
                                      layers=(0, 1)))
    with pytest.raises(AdapterError, match="layers_to_transform must be a layer index"):
        read_peft_adapters(write_peft(tmp_path / "c", {"layers_to_transform": ["0"]}))


def test_rslora_scale_and_plain_scale(tmp_path):
    plain = read_peft_adapters(write_peft(tmp_path / "p", {"use_rslora": False}))
    rs = read_peft_adapters(write_peft(tmp_path / "r", {"use_rslora": True}))
    assert plain.scale == 8 / 4 and rs.scale == pytest.approx(8 / math.sqrt(4))


def test_target_modules_forms(tmp_path):
    for i, tm in enumerate(["all-linear", r".*\.q_proj", ["q_proj", "v_proj"]]):
        assert read_peft_adapters(write_peft(tmp_path / f"ok{i}", {"target_modules": tm}))
    with pytest.raises(AdapterError, match="which target_modules '.*k_proj' does not name"):
        read_peft_adapters(write_peft(tmp_path / "bad", {"target_modules": r".*\.k_proj"}))


def test_neutral_fields_and_defaults_are_accepted(tmp_path):
    """PEFT's own defaults for every refused field (what ``save_pretrained`` writes) merge."""
    cfg = {k: v[-1] for k, v in REFUSED_UNLESS.items()}
    cfg.update({k: None for k in NEUTRAL if k not in ("r", "lora_alpha", "peft_type")})
    assert read_peft_adapters(write_peft(tmp_path / "d", cfg)).layers() == [0]
    assert set(WHY) == set(REFUSED_UNLESS)


def test_factor_bound(tmp_path):
    assert read_peft_adapters(write_peft(tmp_path / "ok", {}, b_value=1e4))
    with pytest.raises(AdapterError, match=r"lora_B holds 1\.5e\+04, above the bound 10000"):
        read_peft_adapters(write_peft(tmp_path / "big", {}, b_value=1.5e4))
