"""The one run-config schema (its sections below). YAML files and dotted command-line
overrides both go through ``load_config`` (parsing in ``parse``); unknown keys, wrong
types, out-of-range values and bad combinations (every rule lives in ``rules``) are
rejected with one line naming the key and the source that set it (the YAML path, or
``command line --section.key``). The loaded config is frozen: setting a key afterwards raises
``FrozenConfigError``; code that needs a variant derives a copy (``RunConfig.replace``,
``RunConfig.with_values``). ``help.schema_help()`` renders the schema for ``--help``."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence

from ms_llm.models.config import TransformerConfig
from ms_llm.optim.kinds.adamw import ADAMW
from ms_llm.config.rules import ConfigError, check_launch, validate
from ms_llm.config.parse import build_model, build_section, layer, type_hints as _hints


class FrozenConfigError(dataclasses.FrozenInstanceError):
    """A key of a loaded (validated, frozen) run config was set."""


class _Section:
    """A config section: assignable while it is built, frozen with its run config."""

    def __setattr__(self, name: str, value: Any) -> None:
        section = self.__dict__.get("_frozen_section")
        if section is not None:
            raise FrozenConfigError(
                f"the run config is frozen after validation: {section}.{name} cannot be set; "
                f"pass --{section}.{name} when loading it, or derive a copy with "
                f"RunConfig.with_values")
        object.__setattr__(self, name, value)

    def _freeze(self, section: str) -> None:
        object.__setattr__(self, "_frozen_section", section)


@dataclass
class DataConfig(_Section):
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
    # Instruction / pairwise data only, in MindSpeed-LLM's order (ms_llm.data.sample_order):
    shuffle: bool = True                  # false: samples in file order (--no-shuffle)
    padded_samples: bool = False          # each epoch padded to a whole global batch with the first samples


@dataclass
class TrainingConfig(_Section):
    max_steps: int = 100
    seed: int = 1234
    output_dir: str = "outputs/default"
    micro_batch_size: int = 4
    global_batch_size: int = 8
    lr: float = 1e-3
    min_lr: float = 1e-4
    lr_warmup_steps: int = 10
    lr_decay_style: str = "cosine"    # cosine | linear | constant | inverse-square-root | WSD
    lr_decay_steps: Optional[int] = None  # default: max_steps
    # Megatron's OptimizerParamScheduler (training/lr_schedule.py): iteration i applies the lr
    # of (i - 1) x global_batch_size samples, starting from lr_warmup_init
    lr_warmup_init: float = 0.0
    lr_warmup_fraction: Optional[float] = None    # warmup = this fraction of the decay
    lr_wsd_decay_steps: Optional[int] = None      # WSD: anneal over the last N iterations
    lr_wsd_decay_style: str = "exponential"       # linear | cosine | exponential | minus_sqrt
    train_samples: Optional[int] = None   # sample-based run: max_steps = this // global batch
    lr_warmup_samples: int = 0            # (sample-based) warmup / decay / WSD in samples
    lr_decay_samples: Optional[int] = None
    lr_wsd_decay_samples: Optional[int] = None
    use_checkpoint_opt_param_scheduler: bool = False  # resume takes the checkpoint's schedule
    # a registered optimizer (ms_llm.optim.kinds: its keys below use Megatron-Core's names)
    optimizer: str = ADAMW.name
    muon_momentum: float = 0.95
    muon_nesterov: bool = False
    muon_split_qkv: bool = True       # orthogonalise Q, K and V apart (across query groups)
    muon_coefficient_type: str = "quintic"   # simple | quintic | polar_express | cans | aol
    muon_num_ns_steps: int = 5
    muon_scale_mode: str = "spectral"  # spectral | shape_scaling | unit_rms_norm
    muon_extra_scale_factor: float = 1.0
    muon_tp_mode: str = "duplicated"  # blockwise | duplicated | distributed (ms_llm.optim.muon_tp)
    muon_fp32_matmul_prec: str = "highest"   # highest (fp32) | medium (bf16 GEMM operands, CPU)
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    # AdamW moments stored in float32 | bfloat16 (MindSpeed-LLM's O2 --o2-optimizer: 4 bytes per
    # parameter instead of 8; each update upcasts them to fp32 and rounds back)
    adam_moments_dtype: str = "float32"
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
    # Seeing a run (ms_llm.training.observability; Megatron's flag names)
    tensorboard_dir: Optional[str] = None   # event files (Megatron's tags); null: none
    log_timers_to_tensorboard: bool = False
    timing_log_level: int = 0         # 0: iteration time only | 1: + forward-backward, optimizer.. | 2: all
    profile: bool = False             # MindSpore Profiler over steps [profile_step_start, profile_step_end)
    profile_step_start: int = 10
    profile_step_end: int = 12
    profile_ranks: List[int] = field(default_factory=lambda: [0])
    profile_dir: Optional[str] = None  # null: <output_dir>/profile
    deterministic: bool = False       # MindSpeed's --use-deter-comp: bit-identical reruns


@dataclass
class ParallelConfig(_Section):
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int = 1   # model chunks per pipeline rank (interleaved)
    schedules_method: Optional[str] = None   # null: 1F1B / interleaved; others: parallel/pipeline/schedules/
    num_layer_list: List[int] = field(default_factory=list)  # layers per stage, e.g. 3,5
    noop_layers: List[int] = field(default_factory=list)     # global indices passed through
    context_parallel_size: int = 1
    context_parallel_algo: str = "megatron_cp_algo"   # megatron_cp_algo (ring) | ulysses_cp_algo | hybrid_cp_algo
    ulysses_degree_in_cp: Optional[int] = None        # hybrid_cp_algo: Ulysses group size inside cp
    expert_model_parallel_size: int = 1
    fsdp_size: int = 1                # FSDP group = data x context parallel (Megatron's dp-cp)
    sequence_parallel: bool = False
    # Megatron's --tp-comm-overlap: sequence-parallel exchanges overlapped with the GEMMs
    tp_comm_overlap: bool = False
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
class CheckpointConfig(_Section):
    save_dir: Optional[str] = None
    save_interval: int = 0            # 0 = only at the end when save_dir is set
    keep_last: Optional[int] = None   # prune older complete checkpoints
    load: Optional[str] = None        # Hugging Face or Megatron folder to initialise the model
    format: str = "ms_llm"            # save_dir holds: ms_llm | torch_dist | torch (Megatron's)
    resume_from: Optional[str] = None  # a Megatron torch_dist / torch training checkpoint


@dataclass
class QuantConfig(_Section):
    recipe: Optional[str] = None      # null | mxfp8
    scale_mode: str = "floor"         # floor (OCP MX spec) | rceil (cuBLAS/TransformerEngine)
    elem_dtype: str = "float8_e4m3fn"  # float8_e4m3fn | float8_e5m2
    apply_modules: List[str] = field(default_factory=list)
    ignored_modules: List[str] = field(default_factory=list)
    mx_path: str = "auto"             # auto | native | emulated MX matmuls (MS_LLM_MX_PATH)
    # a selected module with a dim (or tensor-parallel shard dim) not a multiple of MXFP8's
    # 32-element block: keep it in the model's precision and list it (torchao's recipe) | error
    mx_unaligned: str = "keep"


@dataclass
class MoEConfig(_Section):
    """How MoE layers run (their architecture is in ``model``)."""
    dispatcher: str = "alltoall"      # alltoall | megamoe (pipelined all-to-all + expert GEMMs)
    expert_groups: int = 2            # megamoe: local experts are split into this many groups
    token_chunks: int = 1             # megamoe: and the tokens into this many chunks


@dataclass
class DPOConfig(_Section):
    """``training.stage: dpo`` (TRL / MindSpeed names)."""
    beta: float = 0.1
    loss_type: str = "sigmoid"        # sigmoid | hinge | ipo
    label_smoothing: float = 0.0      # sigmoid only (conservative DPO)


@dataclass
class LoRAConfig(_Section):
    """LoRA adapters on the base weights of ``checkpoint.load`` (off while ``r`` is 0)."""
    r: int = 0                        # adapter rank; 0 = no LoRA
    alpha: float = 16.0               # output scale alpha / r
    dropout: float = 0.0              # dropout on the adapter's input
    # Megatron names (linear_qkv, linear_proj, linear_fc1, linear_fc2) or globs over module
    # names, e.g. "decoder.layers.*.self_attention.linear_qkv"
    target_modules: List[str] = field(default_factory=lambda: ["linear_qkv", "linear_proj",
                                                               "linear_fc1", "linear_fc2"])


@dataclass
class RuntimeConfig(_Section):
    """How this process runs, not what it computes (these were ``MS_LLM_*`` variables, still
    read as deprecated aliases: ``ms_llm.compat.environment``)."""
    log_level: str = "WARNING"        # Python log level of ms-llm train (MS_LLM_LOG_LEVEL)
    sync_ops: Optional[bool] = None   # PyNative ops run synchronously; null: on CPU, not Ascend
    cpu_threads: int = 1              # MindSpore's CPU kernel threads (MS_LLM_CPU_THREADS)
    comm_thread: bool = True          # collectives on a communication thread (MS_LLM_COMM_THREAD)
    shm_collectives: bool = True      # one host's ranks communicate through shared memory on CPU
    blas_threads: Optional[int] = None   # OpenBLAS threads; null: CPUs / local workers
    bf16_gemm: str = "auto"           # auto | dnnl | mkl | openblas (MS_LLM_BF16_GEMM)
    aot_kernels: bool = True          # the compiled C++ CPU kernels (MS_LLM_DISABLE_AOT)
    blas_kernels: bool = True         # the OpenBLAS matmul kernels (MS_LLM_DISABLE_BLAS)


@dataclass
class RunConfig(_Section):
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
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    model_overrides: Dict[str, Any] = field(default_factory=dict)
    # "section.key" -> where its value came from (YAML path or "command line --section.key"),
    # so a check that fails later can still name the source that set the key.
    sources: Dict[str, str] = field(default_factory=dict, repr=False, compare=False)
    base_source: str = field(default="defaults", repr=False, compare=False)

    def to_dict(self) -> dict:
        d = {s: dataclasses.asdict(getattr(self, s))
             for s in ("data", "training", "parallel", "checkpoint", "quant", "moe", "dpo",
                       "lora", "runtime")}
        d["model"] = {"family": self.model_family, **dataclasses.asdict(self.model)}
        return d

    def freeze(self) -> "RunConfig":
        """Refuse every later assignment to this config and its sections (the model config is
        replaced only through ``replace``). Returns self."""
        for s in _SECTIONS:
            getattr(self, s)._freeze(s)
        self._freeze("run config")
        return self

    @property
    def frozen(self) -> bool:
        return self.__dict__.get("_frozen_section") is not None

    def replace(self, **changes: Any) -> "RunConfig":
        """A frozen copy with whole fields replaced (e.g. ``model=`` a derived model config);
        the copy is not validated again: derive only what the rules already allowed."""
        return dataclasses.replace(self, **changes).freeze()

    def with_values(self, values: Mapping[str, Any]) -> "RunConfig":
        """A frozen copy with ``{"section.key": value}`` set (not validated again)."""
        by_section: Dict[str, Dict[str, Any]] = {}
        for key, value in values.items():
            section, _, name = key.partition(".")
            if section not in _SECTIONS or name not in _hints(_SECTIONS[section]):
                raise ConfigError(f"unknown key '{key}'")
            by_section.setdefault(section, {})[name] = value
        return self.replace(**{s: dataclasses.replace(getattr(self, s), **kw)
                               for s, kw in by_section.items()})

    def explicit_settings(self) -> Dict[str, Any]:
        """The run settings (``compat.environment.SETTINGS``) this config sets explicitly, for
        ``environment.configure``; unset ones keep their deprecated variable or default."""
        from ms_llm.compat.environment import SETTINGS
        return {k: getattr(getattr(self, k.split(".")[0]), k.split(".")[1])
                for k in SETTINGS if k in self.sources}

    def source_of(self, *keys: str) -> str:
        """The source that set the first of ``keys`` set explicitly, else the config file."""
        for key in keys:
            if key in self.sources:
                return self.sources[key]
        return self.base_source


_SECTIONS = {"data": DataConfig, "training": TrainingConfig, "parallel": ParallelConfig,
             "checkpoint": CheckpointConfig, "quant": QuantConfig, "moe": MoEConfig,
             "dpo": DPOConfig, "lora": LoRAConfig, "runtime": RuntimeConfig}


def load_config(path: Optional[str] = None, overrides: Sequence[str] = (),
                world_size: Optional[int] = None, command_line: bool = False) -> RunConfig:
    """Load ``path`` (YAML) and apply dotted overrides; check every rule (with ``world_size``,
    the launch rules too); return the config frozen. ``command_line``: the overrides are a
    user's command line (``ms-llm train / plan / schedule``), where a key given twice is
    refused as in YAML; a list composed in code (a base and its changes) lets the last win."""
    base = path or "defaults"
    layered = layer(path, overrides, tuple(_SECTIONS), refuse_repeats=command_line)
    built = {section: build_section(section, cls, layered[section])
             for section, cls in _SECTIONS.items()}
    model, family, explicit = build_model(layered["model"], base)
    sources = {f"{section}.{k}": src for section, values in layered.items()
               for k, (_, src) in values.items()}
    cfg = RunConfig(model=model, model_family=family, model_overrides=explicit, sources=sources,
                    base_source=base, **built)
    if cfg.checkpoint.load:   # the folder's architecture, before the cross-key checks see it
        from ms_llm.config.pretrained import adopt_pretrained_architecture
        adopt_pretrained_architecture(cfg)
    t = cfg.training
    if t.train_samples and "training.max_steps" not in cfg.sources:   # a sample-based run
        t.max_steps = t.train_samples // t.global_batch_size
    cfg.freeze()        # before the rules: they only read it
    validate(cfg)
    if world_size is not None:
        check_launch(cfg, world_size)
    return cfg
