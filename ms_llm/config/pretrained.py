"""A run config that loads a folder (``checkpoint.load``) takes the folder's architecture: the
one config rule that reads a checkpoint. It belongs to the config layer (which may ask
``checkpoint`` what a folder holds), not to ``checkpoint`` (which knows no run config)."""
from __future__ import annotations

import math
import os

from ms_llm.checkpoint.hf.pretrained import pretrained_architecture
from ms_llm.config.rules import ConfigError
from ms_llm.models.config import TransformerConfig
from ms_llm.models.registry import get_family

# Model keys that change neither the weights' shapes nor what they compute: how a run trains
# (dropout, loss coefficients, storage dtype, expert weight layout). A user's value for them is
# applied on top of a loaded folder, as MindSpeed applies its training flags.
TRAINING_MODEL_KEYS = frozenset({
    "attention_dropout", "hidden_dropout", "init_method_std", "params_dtype",
    "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_z_loss_coeff",
    "moe_router_bias_update_rate", "moe_grouped_gemm",
    # fewer MTP depths than the folder has: the rest are skipped (said) on load
    "mtp_num_layers", "mtp_loss_scaling_factor",
    "cross_entropy_loss_fusion",
    # the Gated DeltaNet's chunk of its parallel form: the same function, another work split
    "linear_chunk_size"})
# The config ms-llm train uses when no file is named: its model section describes the default
# small model, not a request about a loaded folder (same path as ms_llm.cli.train.DEFAULT_CONFIG).
DEFAULT_CONFIG = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    "configs", "tiny.yaml")


def adopt_pretrained_architecture(cfg) -> None:
    """Make a run config's ``model`` (and ``model_family``) the architecture of its
    ``checkpoint.load`` folder, so everything downstream (data, pipeline / expert checks, the
    saved ``model_config``, export) sees the weights' real shapes.

    Model keys the user asked for (from the command line or a named YAML file; the default
    config's are not requests) must agree with the folder: a disagreement is a one-line
    ``ConfigError`` naming the key, both values, the key's source and the folder. Training-only
    keys (``TRAINING_MODEL_KEYS``) are applied instead. Idempotent."""
    folder = cfg.checkpoint.load
    try:
        loaded, family = pretrained_architecture(folder)
    except (OSError, ValueError, KeyError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        raise ConfigError(f"{cfg.source_of('checkpoint.load')}: checkpoint.load {folder}: "
                          f"{msg}") from None
    requested = _requested_model_keys(cfg)
    if "family" in requested:
        value, src = requested.pop("family")
        if _family_name(value) != family:
            raise ConfigError(_disagreement(src, "family", value, family, folder))
    knobs = {}
    for key, (value, src) in requested.items():
        if key in TRAINING_MODEL_KEYS:
            knobs[key] = value
        elif not _agrees(key, value, loaded):
            raise ConfigError(_disagreement(src, key, value, getattr(loaded, key), folder))
    model = loaded.replace(**knobs) if knobs else loaded
    if (cfg.model, cfg.model_family) != (model, family):   # a loaded config is frozen
        cfg.model, cfg.model_family = model, family


def _family_name(value: str) -> str:
    try:
        return get_family(value).name
    except ValueError:
        return value


def _requested_model_keys(cfg) -> dict:
    """``{model key: (value, source)}`` for the model keys the user set explicitly, the
    default config's excluded; a key set to null (derive it) asks for nothing."""
    out = {}
    family_src = cfg.sources.get("model.family")
    if family_src and not _is_default_config(family_src) and cfg.model_family is not None:
        out["family"] = (cfg.model_family, family_src)
    for key, value in cfg.model_overrides.items():
        src = cfg.source_of(f"model.{key}")
        if value is not None and not _is_default_config(src):
            out[key] = (value, src)
    return out


def _is_default_config(source: str) -> bool:
    return os.path.isfile(source) and os.path.realpath(source) == os.path.realpath(DEFAULT_CONFIG)


def _agrees(key: str, value, loaded: TransformerConfig) -> bool:
    """Whether the requested ``value`` of ``key`` describes the loaded model (numbers compared
    as numbers: YAML's 10000 is config.json's 10000.0; MoE layer placement compared per layer,
    since Megatron's ``moe_layer_freq`` and HF's sparse step spell the same pattern
    differently)."""
    if key in ("moe_layer_freq", "moe_layer_pattern"):
        if key == "moe_layer_pattern" and len(value) != loaded.num_layers:
            return False
        try:
            asked = loaded.replace(**{"moe_layer_pattern": None, key: value})
        except ValueError:
            return False
        n = range(loaded.num_layers)
        return [asked.is_moe_layer(i) for i in n] == [loaded.is_moe_layer(i) for i in n]
    have = getattr(loaded, key)
    if isinstance(value, (int, float)) and isinstance(have, (int, float)) \
            and not isinstance(value, bool) and not isinstance(have, bool):
        return math.isclose(value, have, rel_tol=1e-9, abs_tol=0.0)
    return value == have


def _disagreement(src: str, key: str, value, have, folder: str) -> str:
    return (f"{src}: model.{key}={value!r} disagrees with checkpoint.load {folder} "
            f"({key}={have!r}); the loaded folder defines the architecture, so drop the key or "
            f"make it agree (configs/tiny.yaml's model keys do not count)")
