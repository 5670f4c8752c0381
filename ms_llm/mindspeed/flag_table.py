"""Every Megatron / MindSpeed-LLM training flag ms-llm knows, and what it becomes.

Each entry is one of: ``Map`` (sets a run-config key from the flag's value, or to a constant for
a switch), ``Noop`` (accepted, with the reason it changes nothing here), ``Refuse`` (one line:
what is not built), or ``Post`` (read by ``flags._finish`` because it depends on other flags;
its ``means`` says what it sets). A flag not in the table is refused naming it.
``MEGATRON_DEFAULTS`` are Megatron's values for keys whose flag a script may leave out, so a
script means here what it means to Megatron. ``scripts/gen_reference.py`` renders the table as
docs/reference/mindspeed_flags.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Union

from ms_llm.optim.kinds import megatron_optimizers

Nargs = Union[int, str]   # 0 (switch), 1, or "+" (values up to the next --flag)


MEGATRON_OPTIMIZER = "adam"     # Megatron's --optimizer default


def optimizer_words() -> str:
    """``--optimizer``'s words and what each selects, from the optimizer registrations
    (``OptimizerKind.megatron_names``): "adam -> adamw, ..., dist_muon -> muon with ..."."""
    return ", ".join(f"{word} -> {kind.name}" + (f" with {', '.join(keys)}" if keys else "")
                     for word, (kind, keys) in megatron_optimizers().items())


@dataclass(frozen=True)
class Map:
    key: str
    nargs: Nargs = 1
    const: Any = None                       # a switch's value
    convert: Optional[Callable[[Any], Any]] = None


@dataclass(frozen=True)
class Noop:
    reason: str
    nargs: Nargs = 0
    allowed: Optional[tuple] = None         # values accepted as a no-op (others: refused)


@dataclass(frozen=True)
class Refuse:
    reason: str
    nargs: Nargs = 0


@dataclass(frozen=True)
class Post:
    means: str                              # what the flag sets, for the flag glossary
    nargs: Nargs = 1


KERNEL = "a fused-kernel switch: ms-llm uses its fused kernel wherever the device has one"
OVERLAP = "a communication-overlap switch: same numbers, ms-llm schedules its own overlap"
MEMORY = "a memory/host-side switch that changes no numbers; not built here (nothing is swapped)"
PREPROCESS = "a preprocessing option: it was applied when the data was made (ms-llm preprocess)"
LAUNCH = "set by the launcher: msrun chooses the backend and the collective library"


def _join(values):
    """the values, comma-separated"""
    return ",".join(values)


def _minutes(v):
    """minutes, as seconds"""
    return float(v) * 60.0


TABLE: Dict[str, object] = {
    # ------------------------------------------------------------------ model architecture
    "--num-layers": Map("model.num_layers"),
    "--hidden-size": Map("model.hidden_size"),
    "--ffn-hidden-size": Map("model.ffn_hidden_size"),
    "--num-attention-heads": Map("model.num_attention_heads"),
    "--num-query-groups": Post("model.num_query_groups, only with --group-query-attention "
                               "(Megatron ignores it without)"),
    "--group-query-attention": Post("makes --num-query-groups count (grouped-query attention)", 0),
    "--kv-channels": Map("model.kv_channels"),
    "--max-position-embeddings": Map("model.max_position_embeddings"),
    "--padded-vocab-size": Map("model.padded_vocab_size"),
    "--vocab-size": Post("model.padded_vocab_size: the value rounded up to a multiple of "
                         "--make-vocab-size-divisible-by x tensor-parallel size (unless "
                         "--padded-vocab-size is given)"),
    "--make-vocab-size-divisible-by": Map("data.make_vocab_size_divisible_by"),
    "--rotary-base": Map("model.rotary_base"),
    "--rotary-percent": Map("model.rotary_percent"),
    "--disable-bias-linear": Map("model.add_bias_linear", 0, False),
    "--add-qkv-bias": Map("model.add_qkv_bias", 0, True),
    "--swiglu": Post("required: model.gated_linear_unit true and model.activation_func silu "
                     "(without it Megatron builds a GeLU MLP, which is not built)", 0),
    "--normalization": Post("must be RMSNorm (Megatron's default, LayerNorm, is not built)"),
    "--norm-epsilon": Map("model.layernorm_epsilon"),
    "--position-embedding-type": Post("must be rope (Megatron's default, learned_absolute, is not "
                                      "built)"),
    "--use-rotary-position-embeddings": Noop("--position-embedding-type rope says the same"),
    "--qk-layernorm": Map("model.qk_layernorm", 0, True),
    "--untie-embeddings-and-output-weights": Map("model.untie_embeddings_and_output_weights",
                                                 0, True),
    "--init-method-std": Map("model.init_method_std"),
    "--attention-dropout": Map("model.attention_dropout"),
    "--hidden-dropout": Map("model.hidden_dropout"),
    "--spec": Post("model.family, from the layer spec's module name (qwen3 with --num-experts: "
                   "qwen3-moe)", 2),
    "--use-mcore-models": Noop("ms-llm's models are the Megatron-Core ones"),
    "--transformer-impl": Noop("the local spec is the layout ms-llm builds and reads", 1,
                               ("local",)),
    "--attention-mask-type": Noop("how the causal mask is handed to the attention kernel", 1,
                                  ("causal", "general")),
    "--shape-order": Noop("the attention kernel's memory layout", 1),
    "--cross-entropy-loss-fusion": Map("model.cross_entropy_loss_fusion", 0, True),
    # MLA, YaRN, MTP (DeepSeek-V3)
    "--multi-latent-attention": Map("model.multi_latent_attention", 0, True),
    "--q-lora-rank": Map("model.q_lora_rank"),
    "--kv-lora-rank": Map("model.kv_lora_rank"),
    "--qk-head-dim": Map("model.qk_head_dim"),
    "--qk-pos-emb-head-dim": Map("model.qk_pos_emb_head_dim"),
    "--v-head-dim": Map("model.v_head_dim"),
    "--rope-scaling-type": Post("yarn: model.position_embedding_type yarn (other types are "
                                "refused)"),
    "--rope-scaling-factor": Map("model.yarn_rotary_scaling_factor"),
    "--rope-scaling-original-max-position-embeddings":
        Map("model.yarn_original_max_position_embeddings"),
    "--rope-scaling-mscale": Map("model.yarn_mscale"),
    "--rope-scaling-mscale-all-dim": Map("model.yarn_mscale_all_dim"),
    "--beta-fast": Map("model.yarn_beta_fast"),
    "--beta-slow": Map("model.yarn_beta_slow"),
    "--mtp-num-layers": Map("model.mtp_num_layers"),
    "--mtp-loss-scaling-factor": Map("model.mtp_loss_scaling_factor"),
    "--mla-fa-without-pad": Noop(KERNEL),
    "--mla-mm-split": Noop(KERNEL),
    "--mtp-mem-efficient-logits": Noop(MEMORY),
    # Qwen3-Next / Gated DeltaNet (MindSpeed-LLM's qwen3_next_spec)
    "--full-attention-interval": Post("model.layer_types: every n-th layer (1-based) full "
                                      "attention, the others Gated DeltaNet"),
    "--linear-key-head-dim": Map("model.linear_key_head_dim"),
    "--linear-value-head-dim": Map("model.linear_value_head_dim"),
    "--linear-num-key-heads": Map("model.linear_num_key_heads"),
    "--linear-num-value-heads": Map("model.linear_num_value_heads"),
    "--mamba-d-conv": Map("model.linear_conv_kernel_dim"),
    "--mamba-chunk-size": Map("model.linear_chunk_size"),
    "--mamba-expand": Noop("read by Mamba layers only; Gated DeltaNet's widths are the "
                           "--linear-* sizes", 1),
    "--partial-rotary-factor": Map("model.rotary_percent"),
    "--add-rmsnorm-offset": Map("model.layernorm_zero_centered_gamma", 0, True),
    "--rmsnorm-weight-in-fp32": Noop("norm weights are fp32 parameters here (bf16 is the compute "
                                     "dtype)"),
    "--no-enable-linear-qkv": Noop("separate q/k/v projections compute what the fused "
                                   "linear_qkv does; Megatron files keep MindSpeed's "
                                   "q_proj/k_proj/v_proj names"),
    "--use-triton-gdn": Noop(KERNEL),
    "--loss-compute-mode": Noop("chunked cross entropy saves memory and gives the same loss", 1,
                                ("default", "chunk")),
    "--loss-chunk-size": Noop("chunked cross entropy saves memory and gives the same loss", 1),
    # MoE
    "--num-experts": Post("model.num_moe_experts, and model.mlp_type moe"),
    "--moe-router-topk": Map("model.moe_router_topk"),
    "--moe-ffn-hidden-size": Map("model.moe_ffn_hidden_size"),
    "--moe-router-load-balancing-type": Post("model.moe_router_load_balancing_type; MindSpeed's "
                                             "pai_megatron_aux_loss: aux_loss with a pre-top-k "
                                             "softmax router (no renormalisation, groups or "
                                             "scaling)"),
    "--seq-aux": Post("model.moe_router_load_balancing_type seq_aux_loss (with --num-experts)", 0),
    "--moe-aux-loss-coeff": Map("model.moe_aux_loss_coeff"),
    "--moe-z-loss-coeff": Map("model.moe_z_loss_coeff"),
    "--moe-layer-freq": Post("model.moe_layer_pattern: every n-th layer after the dense ones is "
                             "MoE (-1: every layer)"),
    "--first-k-dense-replace": Post("model.moe_layer_pattern: the first k layers are dense"),
    "--norm-topk-prob": Post("renormalise the top-k routing weights (softmax router: "
                             "model.moe_router_pre_softmax false; sigmoid router: "
                             "model.moe_router_norm_topk_prob true)", 0),
    "--moe-grouped-gemm": Map("model.moe_grouped_gemm", 0, True),
    "--moe-router-score-function": Map("model.moe_router_score_function"),
    "--moe-router-num-groups": Map("model.moe_router_num_groups"),
    "--moe-router-group-topk": Map("model.moe_router_group_topk"),
    "--moe-router-enable-expert-bias": Map("model.moe_router_enable_expert_bias", 0, True),
    "--moe-router-bias-update-rate": Map("model.moe_router_bias_update_rate"),
    "--moe-router-topk-scaling-factor": Map("model.moe_router_topk_scaling_factor"),
    "--moe-router-pre-softmax": Map("model.moe_router_pre_softmax", 0, True),
    "--n-shared-experts": Post("model.moe_shared_expert_intermediate_size = n x the expert FFN "
                               "size (unless that key's flag is given)"),
    "--moe-shared-expert-intermediate-size": Map("model.moe_shared_expert_intermediate_size"),
    "--moe-token-dispatcher-type": Noop("alltoall, alltoall_seq and allgather route the same "
                                        "tokens; ms-llm dispatches with all-to-all", 1,
                                        ("alltoall", "alltoall_seq", "allgather")),
    "--moe-router-dtype": Noop("the router already computes in fp32", 1, ("fp32",)),
    "--moe-permutation-async-comm": Noop(OVERLAP),
    "--moe-alltoall-overlap-comm": Noop(OVERLAP),
    "--moe-fb-overlap": Noop(OVERLAP),
    "--moe-permute-fusion": Noop(KERNEL),
    "--moe-zero-memory": Noop(MEMORY, 1),
    "--moe-tp-extend-ep": Map("parallel.moe_tp_extend_ep", 0, True),
    "--shared-expert-gate": Map("model.moe_shared_expert_gate", 0, True),
    "--topk-softmax-in-fp32": Noop("the router's softmax and top-k already run in fp32"),
    "--use-fused-moe-token-permute-and-unpermute": Noop(KERNEL),
    # ------------------------------------------------------------------ parallel layout
    "--tensor-model-parallel-size": Map("parallel.tensor_model_parallel_size"),
    "--pipeline-model-parallel-size": Map("parallel.pipeline_model_parallel_size"),
    "--context-parallel-size": Map("parallel.context_parallel_size"),
    "--context-parallel-algo": Map("parallel.context_parallel_algo"),
    "--ulysses-degree-in-cp": Map("parallel.ulysses_degree_in_cp"),
    "--expert-model-parallel-size": Map("parallel.expert_model_parallel_size"),
    "--expert-tensor-parallel-size": Map("parallel.expert_tensor_parallel_size"),
    "--sequence-parallel": Post("parallel.sequence_parallel when tensor parallel > 1 (Megatron "
                                "drops it at tp 1)", 0),
    "--num-layers-per-virtual-pipeline-stage": Post("parallel.virtual_pipeline_model_parallel_size "
                                                    "= layers / (this x pipeline size)"),
    "--num-layer-list": Map("parallel.num_layer_list"),
    "--noop-layers": Map("parallel.noop_layers"),
    "--schedules-method": Post("dualpipev only: parallel.schedules_method dualpipev with 2 virtual "
                               "stages per rank"),
    "--use-distributed-optimizer": Map("parallel.use_distributed_optimizer", 0, True),
    "--overlap-grad-reduce": Map("parallel.ddp_overlap", 0, True),
    "--overlap-param-gather": Noop(OVERLAP),
    "--use-cp-send-recv-overlap": Noop(OVERLAP),
    "--use-ascend-mc2": Noop(KERNEL),
    "--tp-comm-overlap": Map("parallel.tp_comm_overlap", 0, True),
    "--use-ascend-coc": Noop(KERNEL),
    "--coc-fused-kernel": Noop(KERNEL),
    "--accumulate-allreduce-grads-in-fp32": Map("parallel.grad_reduce_in_fp32", 0, True),
    "--distributed-timeout-minutes": Map("parallel.collective_timeout_s", 1, None, _minutes),
    "--distributed-backend": Noop(LAUNCH, 1),
    "--disable-gloo-group": Noop(LAUNCH),
    "--no-shared-storage": Noop("every rank reads the data set itself"),
    "--num-workers": Noop("host-side loader processes: the same samples", 1),
    "--dataloader-type": Post("single: the sampler of every data set here; cyclic (an order "
                              "redrawn each epoch): instruction data only, whose loader "
                              "re-permutes every epoch"),
    # ------------------------------------------------------------------ precision and kernels
    "--bf16": Map("training.bf16", 0, True),
    "--fp16": Refuse("fp16 training is not built (use --bf16)"),
    "--loss-scale": Refuse("a static loss scale is fp16 training's, which is not built", 1),
    "--initial-loss-scale": Noop("dynamic loss scaling is fp16's; Megatron ignores it under "
                                 "--bf16", 1),
    "--o2-optimizer": Map("training.adam_moments_dtype", 0, "bfloat16"),
    "--o2-gradient": Map("parallel.grad_reduce_in_fp32", 0, False),
    "--attention-softmax-in-fp32": Noop("the attention softmax already runs in fp32"),
    "--use-flash-attn": Noop(KERNEL),
    "--use-fused-rotary-pos-emb": Noop(KERNEL),
    "--use-fused-swiglu": Noop(KERNEL),
    "--use-fused-rmsnorm": Noop(KERNEL),
    "--no-masked-softmax-fusion": Noop(KERNEL),
    "--no-rope-fusion": Noop(KERNEL),
    "--no-bias-swiglu-fusion": Noop(KERNEL),
    "--no-gradient-accumulation-fusion": Noop(KERNEL),
    "--gemm-gradient-accumulation-fusion": Noop(KERNEL),
    # ------------------------------------------------------------------ memory
    "--recompute-granularity": Map("training.recompute_granularity"),
    "--recompute-method": Map("training.recompute_method"),
    "--recompute-num-layers": Map("training.recompute_num_layers"),
    "--recompute-norm": Map("training.recompute_norm", 0, True),
    "--recompute-activation-function": Noop(MEMORY),
    "--swap-attention": Noop(MEMORY),
    "--swap-optimizer": Noop(MEMORY),
    "--swap-optimizer-times": Noop(MEMORY, 1),
    "--reuse-fp32-param": Noop(MEMORY),
    "--manual-gc": Noop(MEMORY),
    "--manual-gc-interval": Noop(MEMORY, 1),
    # ------------------------------------------------------------------ optimizer and schedule
    "--lr": Map("training.lr"),
    "--min-lr": Map("training.min_lr"),
    "--lr-decay-style": Map("training.lr_decay_style"),
    "--lr-warmup-iters": Map("training.lr_warmup_steps"),
    "--lr-warmup-fraction": Map("training.lr_warmup_fraction"),
    "--lr-warmup-init": Map("training.lr_warmup_init"),
    "--lr-decay-iters": Map("training.lr_decay_steps"),
    "--lr-wsd-decay-iters": Map("training.lr_wsd_decay_steps"),
    "--lr-wsd-decay-style": Map("training.lr_wsd_decay_style"),
    "--train-iters": Map("training.max_steps"),
    "--train-samples": Map("training.train_samples"),
    "--lr-warmup-samples": Map("training.lr_warmup_samples"),
    "--lr-decay-samples": Map("training.lr_decay_samples"),
    "--lr-wsd-decay-samples": Map("training.lr_wsd_decay_samples"),
    "--use-checkpoint-opt_param-scheduler": Map("training.use_checkpoint_opt_param_scheduler",
                                                0, True),
    "--override-opt_param-scheduler": Noop("the config's schedule is used on resume unless "
                                           "--use-checkpoint-opt_param-scheduler"),
    "--weight-decay": Map("training.weight_decay"),
    "--weight-decay-incr-style": Noop("only a constant weight decay is built", 1, ("constant",)),
    "--clip-grad": Map("training.clip_grad"),
    "--adam-beta1": Map("training.adam_beta1"),
    "--adam-beta2": Map("training.adam_beta2"),
    "--adam-eps": Map("training.adam_eps"),
    "--optimizer": Post(f"training.optimizer: {optimizer_words()} (Megatron's default: "
                        f"{MEGATRON_OPTIMIZER})"),
    # Megatron-Core's Muon's options (ms_llm.optim.muon) and QK-clip
    "--muon-momentum": Map("training.muon_momentum"),
    "--muon-no-split-qkv": Map("training.muon_split_qkv", 0, False),
    "--muon-nesterov": Map("training.muon_nesterov", 0, True),
    "--muon-use-nesterov": Map("training.muon_nesterov", 0, True),   # its earlier name
    "--muon-scale-mode": Map("training.muon_scale_mode"),
    "--muon-fp32-matmul-prec": Map("training.muon_fp32_matmul_prec"),
    "--muon-coefficient-type": Map("training.muon_coefficient_type"),
    "--muon-num-ns-steps": Map("training.muon_num_ns_steps"),
    "--muon-tp-mode": Map("training.muon_tp_mode"),
    "--muon-extra-scale-factor": Map("training.muon_extra_scale_factor"),
    "--muon-use-syrk": Noop("the CPU Newton-Schulz kernel always takes the Gram products by SYRK"),
    "--muon-scalar-optimizer": Noop("AdamW trains the parameters Muon does not", 1, ("adam",)),
    "--qk-clip": Map("model.qk_clip", 0, True),
    "--qk-clip-alpha": Map("model.qk_clip_alpha"),
    "--qk-clip-threshold": Map("model.qk_clip_threshold"),
    "--log-max-attention-logit": Map("model.log_max_attention_logit", 0, True),
    "--micro-batch-size": Map("training.micro_batch_size"),
    "--global-batch-size": Post("training.global_batch_size (left out: micro batch x data-parallel "
                                "size, as Megatron)"),
    "--seed": Map("training.seed"),
    # ------------------------------------------------------------------ data
    "--data-path": Map("data.data_path", "+", None, _join),
    "--split": Map("data.split"),
    "--seq-length": Map("data.seq_length"),
    "--data-cache-path": Map("data.data_cache_path"),
    "--tokenizer-type": Noop("Hugging Face tokenizers are read by --tokenizer-name-or-path", 1,
                             ("PretrainedFromHF",)),
    "--tokenizer-name-or-path": Map("data.tokenizer"),
    "--tokenizer-not-use-fast": Noop("ms-llm reads tokenizer.json (the same ids as the slow "
                                     "tokenizer for these models)"),
    "--handler-name": Noop(PREPROCESS, 1),
    "--prompt-type": Noop(PREPROCESS, 1),
    "--enable-thinking": Noop(PREPROCESS, 1),
    "--pack": Noop(PREPROCESS),
    "--workers": Noop(PREPROCESS, 1),
    "--is-instruction-dataset": Map("data.dataset_type", 0, "sft"),
    "--neat-pack": Noop("packed instruction rows always get per-sample causal masks and "
                        "restarting positions here"),
    "--no-pad-to-seq-lengths": Noop("padding positions carry no loss: padding every row to "
                                    "--seq-length gives the same loss"),
    "--padded-samples": Map("data.padded_samples", 0, True),
    "--no-shuffle": Map("data.shuffle", 0, False),
    "--reset-attention-mask": Map("data.reset_attention_mask", 0, True),
    "--reset-position-ids": Map("data.reset_position_ids", 0, True),
    "--eod-mask-loss": Map("data.eod_mask_loss", 0, True),
    # ------------------------------------------------------------------ stages
    "--stage": Post("sft -> data.dataset_type sft, dpo -> training.stage dpo"),
    "--finetune": Post("--load gives the weights only: never resumes a run saved there", 0),
    "--dpo-beta": Map("dpo.beta"),
    "--dpo-loss-type": Map("dpo.loss_type"),
    "--dpo-label-smoothing": Map("dpo.label_smoothing"),
    "--lora-r": Map("lora.r"),
    "--lora-alpha": Map("lora.alpha"),
    "--lora-dropout": Map("lora.dropout"),
    "--lora-target-modules": Map("lora.target_modules", "+", None, _join),
    "--lora-fusion": Noop(KERNEL),
    "--lora-ckpt-filter": Noop("checkpoints of a LoRA run already hold only the adapters"),
    "--lora-load": Refuse("resuming adapters from a separate folder is not built (resume the "
                          "run from --save)", 1),
    # ------------------------------------------------------------------ checkpoints and logs
    "--load": Post("checkpoint.load (Hugging Face or Megatron weights); the --save folder of an "
                   "ms-llm run or a Megatron training checkpoint resumes instead (training.resume "
                   "auto, checkpoint.resume_from)"),
    "--save": Map("checkpoint.save_dir"),
    "--save-interval": Map("checkpoint.save_interval"),
    "--no-load-optim": Post("a no-op for weights; with a Megatron training checkpoint as --load, "
                            "loading its weights alone is refused", 0),
    "--no-load-rng": Noop("a --load folder gives the weights only; a resume of an ms-llm run "
                          "restores the RNG"),
    "--no-save-optim": Noop("ms-llm checkpoints always hold the optimizer state (resumable)"),
    "--no-save-rng": Noop("ms-llm checkpoints always hold the RNG state (resumable)"),
    "--ckpt-format": Post("torch_dist -> checkpoint.format torch_dist; torch: --save writes "
                          "ms-llm's format (noted)"),
    "--exit-on-missing-checkpoint": Noop("a missing --load folder is always an error here"),
    "--enable-hf2mg-convert": Noop("ms-llm reads a Hugging Face --load folder directly"),
    "--enable-mg2hf-convert": Noop("--save writes ms-llm's checkpoint; `ms-llm convert` "
                                   "writes Hugging Face weights from it"),
    "--hf-cfg-dir": Noop("--save writes ms-llm's checkpoint; `ms-llm convert` writes Hugging "
                         "Face weights from it (the published scripts leave an unquoted "
                         "placeholder of several words)", "+"),
    "--model-type-hf": Noop("the folder's config.json names the architecture", 1),
    "--log-interval": Map("training.log_interval"),
    "--log-throughput": Noop("tokens/s and TFLOP/s are always logged"),
    # seeing a run (ms_llm.training.observability)
    "--tensorboard-dir": Map("training.tensorboard_dir"),
    "--log-timers-to-tensorboard": Map("training.log_timers_to_tensorboard", 0, True),
    "--timing-log-level": Map("training.timing_log_level"),
    "--profile": Map("training.profile", 0, True),
    "--profile-step-start": Map("training.profile_step_start"),
    "--profile-step-end": Map("training.profile_step_end"),
    "--profile-ranks": Map("training.profile_ranks", "+", None, _join),
    "--profile-save-path": Map("training.profile_dir"),
    "--use-deter-comp": Map("training.deterministic", 0, True),
    **{f: Noop("always written to TensorBoard when --tensorboard-dir is set") for f in (
        "--log-validation-ppl-to-tensorboard", "--log-memory-to-tensorboard",
        "--log-learning-rate-to-tensorboard", "--log-loss-scale-to-tensorboard",
        "--log-batch-size-to-tensorboard", "--log-world-size-to-tensorboard")},
    "--tensorboard-log-interval": Noop("TensorBoard gets every logged step (--log-interval)", 1),
    "--tensorboard-queue-size": Noop("the writer flushes every logged step", 1),
    "--eval-interval": Post("training.eval_interval (Megatron's default 1000 while "
                            "--eval-iters > 0)"),
    "--eval-iters": Post("training.eval_iters (Megatron's default 100; 0 turns evaluation off)"),
}

# Megatron's defaults where a script may leave the flag out and ms-llm's default differs.
MEGATRON_DEFAULTS: Dict[str, Any] = {
    "training.lr_decay_style": "linear", "training.lr_warmup_steps": 0,
    "training.min_lr": 0.0, "training.weight_decay": 0.01, "training.adam_beta2": 0.999,
    "training.seed": 1234, "training.log_interval": 100, "training.clip_grad": 1.0,
    "model.attention_dropout": 0.1, "model.hidden_dropout": 0.1,
    "model.layernorm_epsilon": 1e-5, "model.rotary_base": 10000,
    "model.untie_embeddings_and_output_weights": False, "model.add_bias_linear": True,
    "data.make_vocab_size_divisible_by": 128, "data.split": "969,30,1",
    "training.muon_momentum": 0.9,
}
