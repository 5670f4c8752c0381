"""The one run-config schema. YAML files and dotted command-line overrides both go through
``load_config``; unknown keys, wrong types and out-of-range values (``RULES``) are rejected with
one line naming the key and the source that set it (the YAML path, or
``command line --section.key``). ``config_help.schema_help()`` renders the same schema for ``--help``."""
from __future__ import annotations

import dataclasses
import os
import re
import typing
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Optional, Sequence

import yaml

from ms_llm.models.config import TransformerConfig
from ms_llm.models.families import family_defaults
from ms_llm.config_rules import RULES, ConfigError, check_value  # noqa: F401 (re-exported)




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
    optimizer: str = "adamw"          # adamw | muon (ms_llm.optim; Megatron-Core's muon_* names)
    muon_momentum: float = 0.95
    muon_nesterov: bool = False
    muon_split_qkv: bool = True       # orthogonalise Q, K and V apart (across query groups)
    muon_coefficient_type: str = "quintic"   # simple | quintic | polar_express | cans | aol
    muon_num_ns_steps: int = 5
    muon_scale_mode: str = "spectral"  # spectral | shape_scaling | unit_rms_norm
    muon_extra_scale_factor: float = 1.0
    muon_tp_mode: str = "duplicated"  # blockwise | duplicated | distributed (tp > 1: blockwise)
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    log_interval: int = 1
    jit: bool = False                 # compile forward+backward with mindspore.jit
    bf16: bool = False                # bf16 params/activations, fp32 main params + AdamW state
    device: str = "auto"              # auto | CPU | Ascend
    progress_bar: bool = True
    peak_tflops: Optional[float] = None  # MFU divisor per device; null: CPU GEMM probe (cached)
    resume: str = "none"              # none | auto (needs checkpoint.save_dir)
    recompute_granularity: Optional[str] = None   # null | full (whole layers) | selective
    recompute_method: Optional[str] = None        # null | uniform (every layer) | block
    recompute_num_layers: Optional[int] = None    # block: first N layers of each stage
    recompute_norm: bool = False                  # recompute the RMSNorms (MindSpeed)
    stage: Optional[str] = None       # null (pretrain / sft, per data.dataset_type) | dpo
    eval_interval: Optional[int] = None  # evaluate the data.split validation part every N steps
    eval_iters: int = 10              # global batches per evaluation
    max_restarts: int = 0             # scripts/pretrain.sh relaunches a failed job this often
    nan_policy: str = "stop"          # stop | skip: a step whose gradient is not finite
    max_skipped_steps: int = 10       # nan_policy skip: stop once more steps were skipped


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int = 1   # model chunks per pipeline rank (interleaved)
    num_layer_list: List[int] = field(default_factory=list)  # layers per stage, e.g. 3,5
    noop_layers: List[int] = field(default_factory=list)     # global indices passed through
    context_parallel_size: int = 1
    context_parallel_algo: str = "megatron_cp_algo"   # megatron_cp_algo (ring) | ulysses_cp_algo | hybrid_cp_algo
    ulysses_degree_in_cp: Optional[int] = None        # hybrid_cp_algo: Ulysses group size inside cp
    expert_model_parallel_size: int = 1
    fsdp_size: int = 1                # FSDP group = data x context parallel (Megatron's dp-cp)
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
    # Megatron's --use-distributed-optimizer: AdamW moments and fp32 main params sharded over dp
    # (x cp under context parallel)
    use_distributed_optimizer: bool = False
    grad_reduce_in_fp32: bool = True  # training.bf16: sum and reduce gradients in fp32 (false: bf16)


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
class DPOConfig:
    """``training.stage: dpo`` (TRL / MindSpeed names)."""
    beta: float = 0.1
    loss_type: str = "sigmoid"        # sigmoid | hinge | ipo
    label_smoothing: float = 0.0      # sigmoid only (conservative DPO)


@dataclass
class LoRAConfig:
    """LoRA adapters on the base weights of ``checkpoint.load`` (off while ``r`` is 0)."""
    r: int = 0                        # adapter rank; 0 = no LoRA
    alpha: float = 16.0               # output scale alpha / r
    dropout: float = 0.0              # dropout on the adapter's input
    # Megatron names (linear_qkv, linear_proj, linear_fc1, linear_fc2) or globs over module
    # names, e.g. "decoder.layers.*.self_attention.linear_qkv"
    target_modules: List[str] = field(default_factory=lambda: ["linear_qkv", "linear_proj",
                                                               "linear_fc1", "linear_fc2"])


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
    dpo: DPOConfig = field(default_factory=DPOConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    model_overrides: Dict[str, Any] = field(default_factory=dict)
    # "section.key" -> where its value came from (YAML path or "command line --section.key"),
    # so a check that fails later can still name the source that set the key.
    sources: Dict[str, str] = field(default_factory=dict, repr=False, compare=False)
    base_source: str = field(default="defaults", repr=False, compare=False)

    def to_dict(self) -> dict:
        d = {s: dataclasses.asdict(getattr(self, s))
             for s in ("data", "training", "parallel", "checkpoint", "quant", "moe", "dpo",
                       "lora")}
        d["model"] = {"family": self.model_family, **dataclasses.asdict(self.model)}
        return d

    def source_of(self, *keys: str) -> str:
        """The source that set the first of ``keys`` set explicitly, else the config file."""
        for key in keys:
            if key in self.sources:
                return self.sources[key]
        return self.base_source


_SECTIONS = {"data": DataConfig, "training": TrainingConfig, "parallel": ParallelConfig,
             "checkpoint": CheckpointConfig, "quant": QuantConfig, "moe": MoEConfig,
             "dpo": DPOConfig, "lora": LoRAConfig}
_MODEL_FIELDS = {f.name: f for f in fields(TransformerConfig)}
COMMAND_LINE = "command line"


# ------------------------------------------------------------------------------ parsing
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
    elif tp in (int, float):      # a YAML int is a fine float; a float is not an int
        if isinstance(value, str):
            try:
                return tp(value)
            except ValueError:
                pass
        elif isinstance(value, (int, float) if tp is float else int) \
                and not isinstance(value, bool):
            return tp(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    else:
        return value
    raise ConfigError(f"{source}: key '{key}' must be {getattr(tp, '__name__', tp)}, "
                      f"got {value!r}")


def _checked(value: Any, tp: Any, key: str, source: str) -> Any:
    """Type, then value: the one gate every explicitly set key passes through."""
    value = _coerce(value, tp, key, source)
    check_value(key, value, source)
    return value


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
            raise ConfigError(f"{COMMAND_LINE}: expected --section.key VALUE, got {a!r}")
        if "=" in a:
            k, v = a[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"{COMMAND_LINE}: {a} needs a value")
            k, v = a[2:], args[i + 1]
            i += 2
        out.append((k, v))
    return out


def _layer(path: Optional[str], overrides: Sequence[str]) -> Dict[str, Dict[str, tuple]]:
    """section -> key -> (raw value, source); command-line overrides replace YAML values."""
    source = path or "defaults"
    raw = _read_yaml(path) if path else {}
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
        src = f"{COMMAND_LINE} --{dotted}"
        if section not in layered or not k:
            raise ConfigError(f"{src}: unknown key '{dotted}'")
        layered[section][k] = (v, src)
    return layered


def _build_section(section: str, cls, values: Dict[str, tuple]):
    hints = _hints(cls)
    kwargs = {}
    for k, (v, src) in values.items():
        if k not in hints:
            raise ConfigError(f"{src}: unknown key '{section}.{k}'")
        kwargs[k] = _checked(v, hints[k], f"{section}.{k}", src)
    return cls(**kwargs)


def _build_model(values: Dict[str, tuple], base: str):
    """(TransformerConfig, family, explicitly set fields): family defaults, then explicit keys."""
    values = dict(values)
    family, family_src = None, base
    if "family" in values:
        v, family_src = values.pop("family")
        family = _checked(v, Optional[str], "model.family", family_src)
    model_kwargs = {}
    if family:
        try:
            model_kwargs.update(family_defaults(family))
        except ValueError as e:
            raise ConfigError(f"{family_src}: {e}") from None
    hints = _hints(TransformerConfig)
    explicit = {}
    for k, (v, src) in values.items():
        if k not in _MODEL_FIELDS:
            raise ConfigError(f"{src}: unknown key 'model.{k}'")
        explicit[k] = model_kwargs[k] = _checked(v, hints[k], f"model.{k}", src)
    try:
        model = TransformerConfig(**model_kwargs)
    except ValueError as e:
        named = _model_keys_named(str(e), values)
        src = next((values[k][1] for k in named if values[k][1].startswith(COMMAND_LINE)),
                   values[named[0]][1] if named else family_src)
        raise ConfigError(f"{src}: {e}") from None
    return model, family, explicit


def _model_keys_named(message: str, values: Dict[str, tuple]) -> List[str]:
    """The explicitly set model keys a TransformerConfig error mentions (to name their source)."""
    return [k for k in values if re.search(rf"\b{re.escape(k)}\b", message)]


def load_config(path: Optional[str] = None, overrides: Sequence[str] = ()) -> RunConfig:
    """Load ``path`` (YAML) and apply dotted overrides; validate everything."""
    base = path or "defaults"
    layered = _layer(path, overrides)
    built = {section: _build_section(section, cls, layered[section])
             for section, cls in _SECTIONS.items()}
    model, family, explicit = _build_model(layered["model"], base)
    sources = {f"{section}.{k}": src for section, values in layered.items()
               for k, (_, src) in values.items()}
    cfg = RunConfig(model=model, model_family=family, model_overrides=explicit, sources=sources,
                    base_source=base, **built)
    if cfg.checkpoint.load:   # the folder's architecture, before the cross-key checks see it
        from ms_llm.checkpoint.pretrained import adopt_pretrained_architecture
        adopt_pretrained_architecture(cfg)
    validate(cfg)
    return cfg


# ------------------------------------------------------------------------------ cross-key checks
def validate(cfg: RunConfig) -> None:
    """Checks that involve more than one key (single values were checked while parsing). Each
    error names the source of the key it is about."""
    for check in (_check_schedule, _check_parallel, _check_moe, _check_misc, _check_lora,
                  _check_stage, _check_bf16, _check_fusion, _check_optimizer):
        check(cfg)


def _fail(cfg: RunConfig, keys: Sequence[str], message: str) -> None:
    raise ConfigError(f"{cfg.source_of(*keys)}: {message}")


def _check_schedule(cfg: RunConfig) -> None:
    t = cfg.training
    if t.min_lr > t.lr:
        _fail(cfg, ("training.min_lr", "training.lr"),
              f"training.min_lr ({t.min_lr}) must be <= training.lr ({t.lr})")


def _check_parallel(cfg: RunConfig) -> None:
    p = cfg.parallel
    if p.context_parallel_size != 1:
        from ms_llm.parallel.context_parallel.config_check import check_context_parallel
        check_context_parallel(cfg, _fail)
    _check_pipeline(cfg)
    if p.use_distributed_optimizer and p.fsdp_size > 1:
        _fail(cfg, ("parallel.use_distributed_optimizer", "parallel.fsdp_size"),
              "parallel.use_distributed_optimizer with parallel.fsdp_size > 1: FSDP already "
              "shards the optimizer state; use one of them")
    if p.sequence_parallel and p.tensor_model_parallel_size == 1:
        _fail(cfg, ("parallel.sequence_parallel",),
              "parallel.sequence_parallel needs parallel.tensor_model_parallel_size > 1")


def _check_moe(cfg: RunConfig) -> None:
    p, m = cfg.parallel, cfg.model
    ep, moe = p.expert_model_parallel_size, m.mlp_type == "moe"
    ep_key = "parallel.expert_model_parallel_size"
    if ep > 1 and not moe:
        _fail(cfg, (ep_key, "model.mlp_type"),
              f"parallel.expert_model_parallel_size={ep} needs model.mlp_type moe")
    if not moe:
        return
    if m.num_moe_experts % ep:
        _fail(cfg, (ep_key, "model.num_moe_experts"),
              f"model.num_moe_experts ({m.num_moe_experts}) is not divisible by "
              f"parallel.expert_model_parallel_size ({ep})")
    if p.tensor_model_parallel_size > 1:
        _fail(cfg, ("parallel.tensor_model_parallel_size", "model.mlp_type"),
              "model.mlp_type moe with parallel.tensor_model_parallel_size > 1 is not "
              "supported (expert tensor parallel is not built); use expert and data parallel")


def _check_pipeline(cfg: RunConfig) -> None:
    """Megatron's and MindSpeed's stage rules, checked before any process starts."""
    from ms_llm.parallel.pipeline.stages import check_noop_layers, layer_ranges
    p, n = cfg.parallel, cfg.model.num_layers
    pp, vpp = p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size
    keys = ("parallel.pipeline_model_parallel_size", "parallel.virtual_pipeline_model_parallel_size",
            "parallel.num_layer_list", "parallel.noop_layers", "model.num_layers")
    if vpp > 1 and pp == 1:
        _fail(cfg, keys[1:2], "parallel.virtual_pipeline_model_parallel_size > 1 needs "
                              "parallel.pipeline_model_parallel_size > 1")
    if p.num_layer_list and pp == 1:
        _fail(cfg, keys[2:3], "parallel.num_layer_list needs pipeline_model_parallel_size > 1")
    try:
        layer_ranges(n, pp, vpp, p.num_layer_list or None)
        check_noop_layers(p.noop_layers, n)
    except ValueError as e:
        _fail(cfg, keys, str(e))


def _check_misc(cfg: RunConfig) -> None:
    if cfg.training.resume == "auto" and not cfg.checkpoint.save_dir:
        _fail(cfg, ("training.resume", "checkpoint.save_dir"),
              "training.resume=auto needs checkpoint.save_dir")
    if cfg.training.max_restarts and not cfg.checkpoint.save_dir:
        _fail(cfg, ("training.max_restarts", "checkpoint.save_dir"),
              "training.max_restarts needs checkpoint.save_dir (a restart resumes from it)")


def _check_stage(cfg: RunConfig) -> None:
    """DPO and evaluation: what they need from the data and the layout."""
    from ms_llm.training.stage_rules import stage_problem
    problem = stage_problem(cfg)
    if problem is not None:
        _fail(cfg, problem[0], problem[1])


def _check_bf16(cfg: RunConfig) -> None:
    from ms_llm.training.mixed_precision import bf16_problem
    problem = bf16_problem(cfg)
    if problem is not None:
        _fail(cfg, problem[0], problem[1])


def _check_optimizer(cfg: RunConfig) -> None:
    from ms_llm.optim.build import optimizer_problem
    problem = optimizer_problem(cfg)
    if problem is not None:
        _fail(cfg, problem[0], problem[1])


def _check_fusion(cfg: RunConfig) -> None:
    from ms_llm.training.fusion_rules import cross_entropy_fusion_problem
    problem = cross_entropy_fusion_problem(cfg)
    if problem is not None:
        _fail(cfg, problem[0], problem[1])


def _check_lora(cfg: RunConfig) -> None:
    if cfg.lora.r and not cfg.checkpoint.load:
        _fail(cfg, ("lora.r", "checkpoint.load"),
              "lora.r > 0 needs checkpoint.load (the base weights the adapters train on)")
