"""Every field of PEFT's ``adapter_config.json`` is honoured by the merge or refused.

Why: a field the merge ignores silently gives another model than PEFT's own ``merge_and_unload``
(``layers_to_transform: [0]`` used to merge into every layer). Each known field is in one of
three groups: it cannot change the merged weights (``NEUTRAL``: bookkeeping, dropout,
initialisation), the merge honours it (``target_modules``, ``layers_to_transform``,
``layers_pattern``, ``use_rslora``), or any value but its default is refused in one line
(``REFUSED_UNLESS``). A field PEFT adds later is refused when set to anything but
null / false / empty, so a new feature is never merged as if it were plain LoRA.
"""
from __future__ import annotations

import math
import re
from typing import Any, List, Optional

# Fields that do not change W + scale * B A: bookkeeping, dropout and how the factors were
# initialised (LoftQ / EVA / CorDA / PiSSA only choose the starting A and B; the file holds the
# trained ones, and PEFT's merge does not read these fields either).
NEUTRAL = {"peft_type", "task_type", "auto_mapping", "base_model_name_or_path", "revision",
           "inference_mode", "r", "lora_alpha", "lora_dropout", "init_lora_weights",
           "loftq_config", "eva_config", "corda_config", "runtime_config", "peft_version",
           "exclude_modules", "megatron_core", "qalora_group_size"}
# Field -> the values the merge accepts (anything else changes the merge and is not built).
REFUSED_UNLESS = {
    "use_dora": (None, False), "rank_pattern": (None, {}), "alpha_pattern": (None, {}),
    "modules_to_save": (None, []), "fan_in_fan_out": (None, False),
    "bias": (None, "none"), "layer_replication": (None, []), "lora_bias": (None, False),
    "trainable_token_indices": (None, [], {}), "use_qalora": (None, False),
    "megatron_config": (None, {}), "target_parameters": (None, []),
}
WHY = {
    "use_dora": "DoRA rescales each merged column by a learned magnitude",
    "rank_pattern": "per-module ranks change each module's scale",
    "alpha_pattern": "per-module alphas change each module's scale",
    "modules_to_save": "whole modules (e.g. lm_head) are replaced, not merged",
    "fan_in_fan_out": "Conv1D weights are stored transposed",
    "bias": "trained biases are not merged",
    "layer_replication": "layers are duplicated before the adapters apply",
    "lora_bias": "lora_B carries a bias",
    "trainable_token_indices": "embedding rows are replaced",
    "use_qalora": "QALoRA pools the input before lora_A",
    "megatron_config": "the adapters wrap Megatron parallel layers",
    "target_parameters": "adapters on raw parameters (e.g. MoE experts) are not built",
}
# HF's decoder-layer container (``model.layers.{i}``) for Llama / Qwen / Mistral families
LAYERS_PATTERNS = (None, "layers", ["layers"])


class PeftFields:
    """The parts of an ``adapter_config.json`` the merge uses, after every field is checked."""

    def __init__(self, cfg: dict, path: str):
        self.path = path
        for key, value in cfg.items():
            if key in NEUTRAL or key in ("target_modules", "layers_to_transform",
                                         "layers_pattern", "use_rslora"):
                continue
            if key in REFUSED_UNLESS:
                if not any(value == ok and type(value) is type(ok)
                           for ok in REFUSED_UNLESS[key]):
                    raise ValueError(f"{path}: {key} = {value!r} is not supported "
                                     f"({WHY[key]}); merge with PEFT's merge_and_unload")
            elif value not in (None, False, [], {}, ""):
                raise ValueError(f"{path}: {key} = {value!r} is not a field ms-llm knows (it "
                                 f"may change the merge); merge with PEFT's merge_and_unload")
        self.rslora = cfg.get("use_rslora") in (True,)
        if cfg.get("use_rslora") not in (None, False, True):
            raise ValueError(f"{path}: use_rslora must be true or false, got "
                             f"{cfg['use_rslora']!r}")
        self.layers = _layers(cfg.get("layers_to_transform"), path)
        if cfg.get("layers_pattern") not in LAYERS_PATTERNS:
            raise ValueError(f"{path}: layers_pattern = {cfg['layers_pattern']!r} is not "
                             f"supported (the decoder layers are model.layers.N: 'layers')")
        self.targets = cfg.get("target_modules")

    def scale(self, r: int, alpha: float) -> float:
        """PEFT's scaling: ``alpha / r``, or ``alpha / sqrt(r)`` under rsLoRA."""
        return alpha / math.sqrt(r) if self.rslora else alpha / r

    def check_module(self, layer: int, module: str) -> None:
        """A tensor of ``model.layers.{layer}.{module}`` must be one the config adapts."""
        if self.layers is not None and layer not in self.layers:
            raise ValueError(f"{self.path}: the adapters hold layer {layer} {module}, but "
                             f"layers_to_transform is {self.layers}")
        name = f"model.layers.{layer}.{module}"
        t = self.targets
        if t is None or t == "all-linear":
            return
        ok = re.fullmatch(t, name) is not None if isinstance(t, str) else \
            module.rsplit(".", 1)[-1] in t or module in t
        if not ok:
            raise ValueError(f"{self.path}: the adapters hold {name}, which target_modules "
                             f"{t!r} does not name")


def _layers(value: Any, path: str) -> Optional[List[int]]:
    if value is None:
        return None
    items = [value] if isinstance(value, int) else value
    if not isinstance(items, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                              and i >= 0 for i in items):
        raise ValueError(f"{path}: layers_to_transform must be a layer index or a list of "
                         f"them, got {value!r}")
    return sorted(set(items))
