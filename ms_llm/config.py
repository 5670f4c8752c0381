"""The one run-config schema. YAML files and dotted command-line overrides both go through
``load_config``; unknown keys and wrong types are rejected with one line naming key and source."""
from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Optional, Sequence

import yaml

from ms_llm.models.config import TransformerConfig
from ms_llm.models.families import family_defaults


class ConfigError(ValueError):
    """A bad config: the message is one line naming the file/argument and the key."""


@dataclass
class ModelSection:
    """``family`` picks the architecture switches (llama, qwen25, qwen3); every other key is a
    ``TransformerConfig`` field and overrides the family's default."""
    family: Optional[str] = None
    overrides: Dict[str, Any] = field(default_factory=dict)


@dataclass
class DataConfig:
    corpus: str = "embedded"          # "embedded" (built locally at first use), a .jsonl or .txt
    tokenizer: str = "embedded"       # "embedded", a sentencepiece .model, tokenizer.json or folder
    json_key: str = "text"
    seq_length: int = 256
    embedded_vocab_size: int = 4096
    make_vocab_size_divisible_by: int = 128
    cache_dir: Optional[str] = None
    # Megatron indexed datasets written by `ms-llm preprocess` (instead of `corpus`):
    # "prefix" or "w1,prefix1,w2,prefix2" (Megatron's --data-path), blended by weight.
    data_path: Optional[List[str]] = None
    split: str = "100,0,0"
    data_cache_path: Optional[str] = None
    reset_position_ids: bool = False
    reset_attention_mask: bool = False    # packed documents do not attend to each other
    eod_mask_loss: bool = False
    dataset_type: str = "pretrain"        # pretrain | sft (instruction data with prompt masking)


@dataclass
class TrainingConfig:
    max_steps: int = 100
    seed: int = 1234
    output_dir: str = "outputs/default"
    micro_batch_size: int = 4
    global_batch_size: int = 8
    lr: float = 1e-3
    min_lr: float = 1e-4
    lr_warmup_steps: int = 10
    lr_decay_style: str = "cosine"    # cosine | linear | constant
    lr_decay_steps: Optional[int] = None  # default: max_steps
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    log_interval: int = 1
    jit: bool = False                 # compile forward+backward with mindspore.jit
    device: str = "auto"              # auto | CPU | Ascend
    progress_bar: bool = True
    resume: str = "none"              # none | auto (needs checkpoint.save_dir)


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    fsdp_size: int = 1
    sequence_parallel: bool = False
    ddp_bucket_mb: float = 25.0       # data-parallel gradient bucket size
    ddp_overlap: bool = True          # start bucket all-reduces during backward (PyNative)
    collective_timeout_s: float = 600.0  # abort a worker stuck this long in one collective
    fsdp_modules: List[str] = field(
        default_factory=lambda: ["decoder.layers.*", "embedding", "output_layer"])
    reshard_after_forward: bool = True
    fsdp_prefetch: int = 1            # how many next units' all-gathers to start early
    fsdp_param_dtype: Optional[str] = None   # MixedPrecisionPolicy: dtype of gathered weights
    fsdp_reduce_dtype: Optional[str] = None  # and of the gradient reduce-scatter (None = fp32)


@dataclass
class CheckpointConfig:
    save_dir: Optional[str] = None
    save_interval: int = 0            # 0 = only at the end when save_dir is set
    keep_last: Optional[int] = None   # prune older complete checkpoints
    load: Optional[str] = None        # Hugging Face or Megatron folder to initialise the model


@dataclass
class QuantConfig:
    recipe: Optional[str] = None      # null | mxfp8
    scale_mode: str = "floor"         # floor (OCP MX spec) | rceil (cuBLAS/TransformerEngine)
    elem_dtype: str = "float8_e4m3fn"  # float8_e4m3fn | float8_e5m2
    apply_modules: List[str] = field(default_factory=list)
    ignored_modules: List[str] = field(default_factory=list)


@dataclass
class MoEConfig:
    """How MoE layers run (their architecture is in ``model``)."""
    dispatcher: str = "alltoall"      # alltoall | megamoe (pipelined all-to-all + expert GEMMs)
    expert_groups: int = 2            # megamoe: local experts are split into this many groups
    token_chunks: int = 1             # megamoe: and the tokens into this many chunks


@dataclass
class RunConfig:
    model: TransformerConfig
    model_family: Optional[str]
    data: DataConfig
    training: TrainingConfig
    parallel: ParallelConfig
    checkpoint: CheckpointConfig
    quant: QuantConfig
    moe: MoEConfig = field(default_factory=MoEConfig)
    model_overrides: Dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = {s: dataclasses.asdict(getattr(self, s))
             for s in ("data", "training", "parallel", "checkpoint", "quant", "moe")}
        d["model"] = {"family": self.model_family, **dataclasses.asdict(self.model)}
        return d


_SECTIONS = {"data": DataConfig, "training": TrainingConfig, "parallel": ParallelConfig,
             "checkpoint": CheckpointConfig, "quant": QuantConfig, "moe": MoEConfig}
_MODEL_FIELDS = {f.name: f for f in fields(TransformerConfig)}


def _coerce(value: Any, tp: Any, key: str, source: str) -> Any:
    """Check ``value`` against the annotation ``tp``; strings from the command line are parsed."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union:  # Optional[X]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        return _coerce(value, next(a for a in args if a is not type(None)), key, source)
    if origin in (list, List):
        if isinstance(value, str):
            value = [v for v in value.split(",") if v]
        if not isinstance(value, list):
            raise ConfigError(f"{source}: key '{key}' must be a list, got {value!r}")
        return [_coerce(v, args[0], key, source) for v in value]
    if tp is bool:
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        elif isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    else:
        return value
    raise ConfigError(f"{source}: key '{key}' must be {getattr(tp, '__name__', tp)}, "
                      f"got {value!r}")


def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _read_yaml(path: str) -> dict:
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: config file not found")
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    return data


def parse_overrides(args: Sequence[str]) -> List[tuple]:
    """``--training.max_steps 20`` or ``--training.max_steps=20`` -> [("training.max_steps", "20")]."""
    out, i = [], 0
    args = list(args)
    while i < len(args):
        a = args[i]
        if not a.startswith("--") or "." not in a.split("=")[0]:
            raise ConfigError(f"command line: expected --section.key VALUE, got {a!r}")
        if "=" in a:
            k, v = a[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"command line: {a} needs a value")
            k, v = a[2:], args[i + 1]
            i += 2
        out.append((k, v))
    return out


def load_config(path: Optional[str] = None, overrides: Sequence[str] = ()) -> RunConfig:
    """Load ``path`` (YAML) and apply dotted overrides; validate everything."""
    raw = _read_yaml(path) if path else {}
    source = path or "defaults"
    layered: Dict[str, Dict[str, tuple]] = {s: {} for s in ("model", *_SECTIONS)}
    for section, values in raw.items():
        if section not in layered:
            raise ConfigError(f"{source}: unknown section '{section}' "
                              f"(expected one of {sorted(layered)})")
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: section '{section}' must be a mapping")
        for k, v in values.items():
            layered[section][k] = (v, source)
    for dotted, v in parse_overrides(overrides):
        section, _, k = dotted.partition(".")
        if section not in layered or not k:
            raise ConfigError(f"command line: unknown key '{dotted}'")
        layered[section][k] = (v, "command line")

    built = {}
    for section, cls in _SECTIONS.items():
        hints = _hints(cls)
        kwargs = {}
        for k, (v, src) in layered[section].items():
            if k not in hints:
                raise ConfigError(f"{src}: unknown key '{section}.{k}'")
            kwargs[k] = _coerce(v, hints[k], f"{section}.{k}", src)
        built[section] = cls(**kwargs)

    model_raw = dict(layered["model"])
    family = None
    if "family" in model_raw:
        v, src = model_raw.pop("family")
        family = _coerce(v, Optional[str], "model.family", src)
    model_kwargs = {}
    if family:
        try:
            model_kwargs.update(family_defaults(family))
        except ValueError as e:
            raise ConfigError(f"{source}: {e}") from None
    hints = _hints(TransformerConfig)
    explicit = {}
    for k, (v, src) in model_raw.items():
        if k not in _MODEL_FIELDS:
            raise ConfigError(f"{src}: unknown key 'model.{k}'")
        explicit[k] = model_kwargs[k] = _coerce(v, hints[k], f"model.{k}", src)
    try:
        model = TransformerConfig(**model_kwargs)
    except ValueError as e:
        raise ConfigError(f"{source}: {e}") from None
    cfg = RunConfig(model=model, model_family=family, model_overrides=explicit, **built)
    validate(cfg, source)
    return cfg


def validate(cfg: RunConfig, source: str) -> None:
    t, p = cfg.training, cfg.parallel
    for key in ("max_steps", "micro_batch_size", "global_batch_size", "log_interval"):
        if getattr(t, key) <= 0:
            raise ConfigError(f"{source}: training.{key} must be > 0")
    if t.lr_decay_style not in ("cosine", "linear", "constant"):
        raise ConfigError(f"{source}: training.lr_decay_style must be cosine, linear or constant")
    if t.resume not in ("none", "auto"):
        raise ConfigError(f"{source}: training.resume must be 'none' or 'auto'")
    if t.device not in ("auto", "CPU", "Ascend", "cpu", "ascend"):
        raise ConfigError(f"{source}: training.device must be auto, CPU or Ascend")
    if cfg.data.seq_length <= 0:
        raise ConfigError(f"{source}: data.seq_length must be > 0")
    if cfg.data.dataset_type not in ("pretrain", "sft"):
        raise ConfigError(f"{source}: data.dataset_type must be 'pretrain' or 'sft'")
    if p.tensor_model_parallel_size < 1:
        raise ConfigError(f"{source}: parallel.tensor_model_parallel_size must be >= 1")
    for key in ("pipeline_model_parallel_size", "context_parallel_size"):
        if getattr(p, key) != 1:
            raise ConfigError(f"{source}: parallel.{key}={getattr(p, key)} is not available yet "
                              f"(data, tensor, expert and fully-sharded data parallel are)")
    ep = p.expert_model_parallel_size
    if ep < 1:
        raise ConfigError(f"{source}: parallel.expert_model_parallel_size must be >= 1")
    moe = cfg.model.mlp_type == "moe"
    if ep > 1 and not moe:
        raise ConfigError(f"{source}: parallel.expert_model_parallel_size={ep} needs "
                          f"model.mlp_type moe")
    if moe and cfg.model.num_moe_experts % ep:
        raise ConfigError(f"{source}: model.num_moe_experts ({cfg.model.num_moe_experts}) is not "
                          f"divisible by parallel.expert_model_parallel_size ({ep})")
    if moe and p.tensor_model_parallel_size > 1:
        raise ConfigError(f"{source}: model.mlp_type moe with parallel.tensor_model_parallel_size"
                          f" > 1 is not supported (expert tensor parallel is not built); use "
                          f"expert and data parallel")
    if cfg.moe.dispatcher not in ("alltoall", "megamoe"):
        raise ConfigError(f"{source}: moe.dispatcher must be 'alltoall' or 'megamoe', got "
                          f"{cfg.moe.dispatcher!r}")
    if cfg.moe.expert_groups < 1 or cfg.moe.token_chunks < 1:
        raise ConfigError(f"{source}: moe.expert_groups and moe.token_chunks must be >= 1")
    if p.fsdp_size < 1:
        raise ConfigError(f"{source}: parallel.fsdp_size must be >= 1")
    for key in ("fsdp_param_dtype", "fsdp_reduce_dtype"):
        value = getattr(p, key)
        if value is not None and value.lower() not in ("float32", "fp32", "bfloat16", "bf16",
                                                       "float16", "fp16"):
            raise ConfigError(f"{source}: parallel.{key} must be null, float32, bfloat16 or "
                              f"float16, got {value!r}")
    if p.fsdp_size > 1 and t.jit:
        raise ConfigError(f"{source}: parallel.fsdp_size > 1 needs training.jit false (FSDP "
                          f"gathers use PyNative custom backward)")
    if p.sequence_parallel and p.tensor_model_parallel_size == 1:
        raise ConfigError(f"{source}: parallel.sequence_parallel needs "
                          f"parallel.tensor_model_parallel_size > 1")
    if cfg.model.mlp_type == "moe" and t.jit:
        raise ConfigError(f"{source}: model.mlp_type 'moe' needs training.jit false (expert "
                          f"block sizes depend on the routing)")
    q = cfg.quant
    if q.recipe not in (None, "mxfp8"):
        raise ConfigError(f"{source}: quant.recipe must be null or 'mxfp8', got {q.recipe!r}")
    if q.scale_mode not in ("floor", "rceil"):
        raise ConfigError(f"{source}: quant.scale_mode must be 'floor' or 'rceil'")
    if q.elem_dtype not in ("float8_e4m3fn", "float8_e5m2"):
        raise ConfigError(f"{source}: quant.elem_dtype must be float8_e4m3fn or float8_e5m2")
    if t.resume == "auto" and not cfg.checkpoint.save_dir:
        raise ConfigError(f"{source}: training.resume=auto needs checkpoint.save_dir")
