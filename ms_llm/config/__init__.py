"""The run config: one schema (``schema``) of sections, loaded from YAML and dotted command-line
overrides (``parse``), each value checked by its rule (``values``), combinations and launch
checked by ``rules``, an HF/Megatron folder's architecture adopted by ``pretrained``, and the
``--help`` text rendered by ``help``. Importers take the public names below from
``ms_llm.config``; the modules are the parts."""
from ms_llm.config.parse import merge_overrides, parse_overrides
from ms_llm.config.rules import ConfigError, check_launch
from ms_llm.config.schema import (CheckpointConfig, DataConfig, DPOConfig, FrozenConfigError,
                                  LoRAConfig, MoEConfig, ParallelConfig, QuantConfig,
                                  RunConfig, RuntimeConfig, TrainingConfig, load_config)

__all__ = ["CheckpointConfig", "ConfigError", "DataConfig", "DPOConfig", "FrozenConfigError",
           "LoRAConfig", "MoEConfig", "ParallelConfig", "QuantConfig", "RunConfig",
           "RuntimeConfig", "TrainingConfig", "check_launch", "load_config", "merge_overrides",
           "parse_overrides"]
