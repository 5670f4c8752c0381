"""Megatron / MindSpeed-LLM argument lists -> ms-llm run-config keys (``flag_table.TABLE``).

``translate(argv)`` gives the dotted keys (``{"training.lr": "1e-5", ...}``) plus one note per
accepted no-op flag; ``load_config(None, to_overrides(keys))`` then validates them like any
command line, and ``to_yaml(keys)`` writes the equivalent YAML. Megatron's argparse rules hold:
``--flag=value`` works, the last occurrence of a flag wins, a switch takes no value.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import yaml

from ms_llm.config.rules import ConfigError
from ms_llm.models.registry import families, get_family
from ms_llm.optim.kinds import megatron_optimizers
from .flag_table import MEGATRON_DEFAULTS, MEGATRON_OPTIMIZER, TABLE, Map, Noop, Refuse

_SPEC = re.compile(r"(?:^|\.)([a-z0-9_]+)_spec$")


@dataclass
class Translation:
    keys: Dict[str, Any] = field(default_factory=dict)     # "section.key" -> value
    notes: List[str] = field(default_factory=list)         # one per accepted no-op flag


def split_flags(argv: Sequence[str]) -> List[tuple]:
    """``[(flag, [values])]`` in order; values run to the next ``--flag``."""
    out: List[tuple] = []
    for a in argv:
        if a.startswith("--") and not _is_number(a):
            name, eq, value = a.partition("=")
            out.append((name, [value] if eq else []))
        elif not out:
            raise ConfigError(f"MindSpeed arguments: {a!r} is not a --flag")
        else:
            out[-1][1].append(a)
    return out


def _is_number(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def translate(argv: Sequence[str], world_size: Optional[int] = None) -> Translation:
    """The run-config keys of a Megatron argument list (one-line ConfigError for a refused or
    unknown flag, naming it). ``world_size`` (default: msrun's ``MS_WORKER_NUM``, else 1) gives
    Megatron's default global batch, micro batch x data-parallel size."""
    # A flag given twice: the last wins, as in Megatron's argparse (MindSpeed scripts build
    # their line from shell variables and rely on it). ``ms-llm train``'s own ``--section.key``
    # line refuses a key given twice (``config.parse.parse_overrides``); this one keeps
    # Megatron's semantics (tests/mindspeed/test_mindspeed_flags.py, --seed given twice).
    tr = Translation(keys=dict(MEGATRON_DEFAULTS))
    post: Dict[str, List[str]] = {}
    for flag, values in split_flags(argv):
        entry = TABLE.get(flag)
        if entry is None:
            raise ConfigError(f"{flag}: unknown Megatron/MindSpeed flag (not mapped to ms-llm)")
        _check_arity(flag, entry.nargs, values)
        if isinstance(entry, Refuse):
            raise ConfigError(f"{flag}: not supported: {entry.reason}")
        if isinstance(entry, Noop):
            if entry.allowed is not None and values[0] not in entry.allowed:
                raise ConfigError(f"{flag} {values[0]}: not supported (accepted: "
                                  f"{', '.join(entry.allowed)})")
            tr.notes.append(f"{flag}: no-op ({entry.reason})")
        elif isinstance(entry, Map):
            value = entry.const if entry.nargs == 0 else \
                (values if entry.nargs == "+" else values[0])
            tr.keys[entry.key] = entry.convert(value) if entry.convert else value
        else:
            post[flag] = values
    _finish(tr, post, world_size)
    return tr


def _optimizer(tr: Translation, post: Dict[str, List[str]]) -> None:
    """Megatron's ``--optimizer``: a word an optimizer's registration claims
    (``OptimizerKind.megatron_names``: adam is AdamW, Megatron's default; the deprecated
    dist_muon is Muon with the distributed optimizer, as Megatron rewrites it), with the note
    the registration gives for it."""
    words = megatron_optimizers()
    word = post.get("--optimizer", [MEGATRON_OPTIMIZER])[0]
    if word not in words:
        *rest, last = words
        built = f"{', '.join(rest)} and {last} are" if rest else f"{last} is"
        raise ConfigError(f"--optimizer {word}: not supported ({built} built)")
    kind, keys = words[word]
    tr.keys["training.optimizer"] = kind.name
    tr.keys.update(keys)
    note = kind.megatron_note(tr.keys) if kind.megatron_note else None
    if note:
        tr.notes.append(note)


def _dataloader(tr: Translation, post: Dict[str, List[str]]) -> None:
    """Megatron's ``--dataloader-type``: ``single`` reads a data set in its own (already
    shuffled) order, as every loader here does for pretraining data; ``cyclic`` redraws a random
    order every epoch, as the loader here does for instruction and preference data (its numpy
    permutation, not Megatron's ``torch.randperm`` one). Pretraining data in a cyclic order is
    not built."""
    kind = post.get("--dataloader-type", ["single"])[0]
    if kind not in ("single", "cyclic"):
        raise ConfigError(f"--dataloader-type {kind}: not supported (single and cyclic are)")
    if kind == "cyclic":
        instruction = "--is-instruction-dataset" in post or post.get("--stage", [""])[0] in (
            "sft", "dpo") or tr.keys.get("data.dataset_type") == "sft"
        if not instruction:
            raise ConfigError("--dataloader-type cyclic: not supported for pretraining data (its "
                              "samples are read in the data set's own shuffled order)")
        tr.notes.append("--dataloader-type cyclic: instruction samples are re-permuted every "
                        "epoch (numpy's permutation, not torch.randperm's)")


def _check_arity(flag: str, nargs, values: List[str]) -> None:
    if nargs == "+" and not values:
        raise ConfigError(f"{flag}: needs at least one value")
    if nargs != "+" and len(values) != nargs:
        want = "no value" if nargs == 0 else f"{nargs} value(s)"
        raise ConfigError(f"{flag}: takes {want}, got {' '.join(values) or 'none'}")


def _finish(tr: Translation, post: Dict[str, List[str]], world_size: Optional[int]) -> None:
    """The flags whose meaning depends on others (Megatron's ``validate_args`` rules)."""
    k = tr.keys
    _architecture(k, post)
    _moe(tr, post)
    _layout(k, post)
    # Megatron: global batch defaults to micro batch x data-parallel size
    world = world_size or int(os.environ.get("MS_WORKER_NUM", "1") or 1)
    if "--global-batch-size" in post:
        k["training.global_batch_size"] = post["--global-batch-size"][0]
    else:
        mp = 1
        for key in ("parallel.tensor_model_parallel_size", "parallel.pipeline_model_parallel_size",
                    "parallel.context_parallel_size"):
            mp *= int(k.get(key, 1))
        k["training.global_batch_size"] = int(k.get("training.micro_batch_size", 1)) * \
            max(world // mp, 1)
    # Megatron evaluates every --eval-interval (default 1000) for --eval-iters (default 100)
    iters = int(post.get("--eval-iters", ["100"])[0])
    if iters > 0:
        k["training.eval_iters"] = iters
        k["training.eval_interval"] = post.get("--eval-interval", ["1000"])[0]
    _optimizer(tr, post)
    _dataloader(tr, post)
    stage = post.get("--stage", [None])[0]
    if stage == "dpo":
        k["training.stage"] = "dpo"
    elif stage == "sft":
        k["data.dataset_type"] = "sft"
    elif stage is not None:
        raise ConfigError(f"--stage {stage}: not supported (sft and dpo are built)")
    fmt = post.get("--ckpt-format", [None])[0]
    if fmt == "torch_dist":
        k["checkpoint.format"] = "torch_dist"
    elif fmt == "torch":
        tr.notes.append("--ckpt-format torch: --save writes ms-llm's sharded format (the legacy "
                        "format is checkpoint.format torch, dense full-parameter runs only; "
                        "`ms-llm convert` writes its weights)")
    elif fmt is not None:
        raise ConfigError(f"--ckpt-format {fmt}: not supported (torch_dist and torch are)")
    if "--no-load-optim" in post:
        tr.notes.append("--no-load-optim: no-op (a --load folder gives the weights only; a "
                        "resume of an ms-llm or Megatron training checkpoint restores the "
                        "optimizer)")
    if "--load" in post:
        _load(tr, post["--load"][0], "--finetune" in post, "--no-load-optim" in post)


def _architecture(k: Dict[str, Any], post: Dict[str, List[str]]) -> None:
    norm = post.get("--normalization", ["LayerNorm"])[0]
    if norm != "RMSNorm":
        raise ConfigError(f"--normalization {norm}: not supported (RMSNorm is built; Megatron's "
                          f"default is LayerNorm)")
    pos = post.get("--position-embedding-type", ["learned_absolute"])[0]
    if pos != "rope":
        raise ConfigError(f"--position-embedding-type {pos}: not supported (rope is built; "
                          f"Megatron's default is learned_absolute)")
    if "--swiglu" not in post:
        raise ConfigError("--swiglu missing: without it Megatron builds a GeLU MLP, which is not "
                          "built here")
    k["model.gated_linear_unit"], k["model.activation_func"] = True, "silu"
    scaling = post.get("--rope-scaling-type", [None])[0]
    if scaling == "yarn":
        k["model.position_embedding_type"] = "yarn"
    elif scaling is not None:
        raise ConfigError(f"--rope-scaling-type {scaling}: not supported (yarn is built)")
    if k.get("model.multi_latent_attention"):   # MindSpeed's --qk-layernorm under MLA: the
        k.pop("model.qk_layernorm", None)        # q/kv compression norms MLA always has
    if "--group-query-attention" in post and "--num-query-groups" in post:
        k["model.num_query_groups"] = post["--num-query-groups"][0]   # else Megatron ignores it
    if "--vocab-size" in post and "model.padded_vocab_size" not in k:
        div = int(k["data.make_vocab_size_divisible_by"]) * \
            int(k.get("parallel.tensor_model_parallel_size", 1))
        k["model.padded_vocab_size"] = -(-int(post["--vocab-size"][0]) // div) * div
    if "--spec" in post:
        k["model.family"] = _family_of_spec(
            post["--spec"][0], "--num-experts" in post,
            k.get("model.moe_router_score_function", "softmax"))
    if "--full-attention-interval" in post:
        _hybrid_layers(k, post["--full-attention-interval"][0])


def _hybrid_layers(k: Dict[str, Any], interval: str) -> None:
    """MindSpeed's transformer block: layer n (1-based) is full attention when n % interval is
    0, linear attention otherwise; HF's ``full_attention_interval`` is the same rule, so the
    family's own reader of it names each layer's mixer kind."""
    every = int(interval)
    if every < 1:
        raise ConfigError(f"--full-attention-interval {every}: must be >= 1")
    spec = get_family(k["model.family"]) if "model.family" in k else None
    if spec is None or spec.hybrid_layer_types is None:
        raise ConfigError(f"--full-attention-interval {every}: the --spec family "
                          f"({spec.name if spec else 'none'}) has one kind of layer")
    layers = int(k.get("model.num_layers", 0))
    kinds = spec.hybrid_layer_types({"num_hidden_layers": layers,
                                     "full_attention_interval": every},
                                    "--full-attention-interval")
    k["model.layer_types"] = ",".join(kinds)


def _family_of_spec(module: str, moe: bool, score_function: str = "softmax") -> str:
    """The family a MindSpeed-LLM ``--spec`` module (``..<name>_spec``) builds: the registered
    family listing ``<name>`` in ``mindspeed_specs``; when several share it, the one whose MLP
    ``--num-experts`` (``moe``) says (a dense and a MoE family), then the one whose router scores
    as ``--moe-router-score-function`` does (DeepSeek-V2's softmax, DeepSeek-V3's sigmoid: both
    ``deepseek_spec``)."""
    m = _SPEC.search(module)
    named = [s for s in families() if m and m.group(1) in s.mindspeed_specs]
    if not named:
        known = dict.fromkeys(n for s in families() for n in s.mindspeed_specs)
        raise ConfigError(f"--spec {module}: unknown layer spec (known: "
                          f"{', '.join(f'{n}_spec' for n in known)})")
    same_mlp = [s for s in named if s.is_moe == moe] or named
    if moe:
        router = [s for s in same_mlp
                  if s.defaults.get("moe_router_score_function", "softmax") == score_function]
        same_mlp = router or same_mlp
    return same_mlp[0].name


def _moe(tr: Translation, post: Dict[str, List[str]]) -> None:
    k = tr.keys
    if "--num-experts" not in post:
        k["model.mlp_type"] = "dense"        # Megatron: no --num-experts, a dense MLP
        return
    k["model.mlp_type"], k["model.num_moe_experts"] = "moe", post["--num-experts"][0]
    # Megatron's router defaults, so a family's own defaults never change what the flags say
    k.setdefault("model.moe_router_score_function", "softmax")
    k.setdefault("model.moe_router_enable_expert_bias", False)
    balancing = post.get("--moe-router-load-balancing-type", ["aux_loss"])[0]
    if balancing == "pai_megatron_aux_loss":
        _pai_megatron_router(tr, post)
        return
    k["model.moe_router_load_balancing_type"] = balancing
    if "--seq-aux" in post:
        k["model.moe_router_load_balancing_type"] = "seq_aux_loss"
    if k.get("model.moe_router_score_function", "softmax") == "softmax":
        # softmax router: MindSpeed's --norm-topk-prob renormalises the top-k (HF norm_topk_prob)
        k["model.moe_router_pre_softmax"] = "--norm-topk-prob" not in post
    else:
        k["model.moe_router_norm_topk_prob"] = "--norm-topk-prob" in post
    _moe_layers(k, post)
    _shared_experts(k, post)


def _moe_layers(k: Dict[str, Any], post: Dict[str, List[str]]) -> None:
    """``--first-k-dense-replace`` dense layers, then every ``--moe-layer-freq``-th one MoE."""
    layers = int(k.get("model.num_layers", 0))
    first_dense = int(post.get("--first-k-dense-replace", ["-1"])[0])
    freq = int(post.get("--moe-layer-freq", ["1"])[0])
    if first_dense > 0 or freq not in (1, -1):   # MindSpeed: -1 means "every layer"
        step = 1 if freq == -1 else freq
        k["model.moe_layer_pattern"] = ",".join(
            str(int(i >= max(first_dense, 0) and (i - max(first_dense, 0)) % step == 0))
            for i in range(layers))


def _shared_experts(k: Dict[str, Any], post: Dict[str, List[str]]) -> None:
    """``--n-shared-experts`` n: one shared MLP n x the expert FFN wide."""
    if "--n-shared-experts" in post and "model.moe_shared_expert_intermediate_size" not in k:
        n = int(post["--n-shared-experts"][0])
        if n:
            k["model.moe_shared_expert_intermediate_size"] = \
                n * int(k.get("model.moe_ffn_hidden_size", k.get("model.ffn_hidden_size", 0)))


def _pai_megatron_router(tr: Translation, post: Dict[str, List[str]]) -> None:
    """MindSpeed-LLM's ``pai_megatron_aux_loss`` router (DeepSeek-V2-Lite's scripts): softmax
    over every expert, top-k, the weights not renormalised nor scaled, no group limit (it calls
    Megatron's ``topk_softmax_with_capacity`` with ``use_pre_softmax`` alone), and Megatron's
    switch aux loss on the softmax scores; ``--seq-aux``, the group and scaling flags are not
    read by it."""
    k = tr.keys
    k["model.moe_router_score_function"] = "softmax"
    k["model.moe_router_pre_softmax"] = True
    k["model.moe_router_load_balancing_type"] = "aux_loss"
    for flag, key in (("--moe-router-num-groups", "model.moe_router_num_groups"),
                      ("--moe-router-group-topk", "model.moe_router_group_topk"),
                      ("--moe-router-topk-scaling-factor", "model.moe_router_topk_scaling_factor"),
                      ("--seq-aux", None), ("--norm-topk-prob", None)):
        if flag in post or (key and key in k):
            k.pop(key, None)
            tr.notes.append(f"{flag}: no-op (MindSpeed's pai_megatron_aux_loss router does not "
                            f"read it)")
    _moe_layers(k, post)
    _shared_experts(k, post)


def _layout(k: Dict[str, Any], post: Dict[str, List[str]]) -> None:
    tp = int(k.get("parallel.tensor_model_parallel_size", 1))
    if "--sequence-parallel" in post and tp > 1:   # Megatron drops it at tp=1
        k["parallel.sequence_parallel"] = True
    if "--num-layers-per-virtual-pipeline-stage" in post:
        per = int(post["--num-layers-per-virtual-pipeline-stage"][0])
        pp = int(k.get("parallel.pipeline_model_parallel_size", 1))
        layers = int(k.get("model.num_layers", 0))
        if per <= 0 or layers % (per * pp):
            raise ConfigError(f"--num-layers-per-virtual-pipeline-stage {per}: --num-layers "
                              f"({layers}) must be a multiple of it x pipeline size ({pp})")
        k["parallel.virtual_pipeline_model_parallel_size"] = layers // (per * pp)
    if "--schedules-method" in post:     # a schedule record that sets its chunks per rank
        _schedules_method(k, post, post["--schedules-method"][0])


def _schedules_method(k: Dict[str, Any], post: Dict[str, List[str]], method: str) -> None:
    """MindSpeed's ``--schedules-method``: the schedule records marked as its values; each runs
    a fixed number of chunks per rank, so it sets the virtual pipeline size too."""
    from ms_llm.parallel.pipeline.schedules import all_schedules
    specs = {s.method: s for s in all_schedules() if s.mindspeed}
    spec = specs.get(method)
    if spec is None:
        raise ConfigError(f"--schedules-method {method}: MindSpeed's schedule methods are "
                          f"{', '.join(sorted(specs))} (built) only")
    if "--num-layers-per-virtual-pipeline-stage" in post:
        raise ConfigError(f"--schedules-method {method} with "
                          f"--num-layers-per-virtual-pipeline-stage: {method} "
                          f"{spec.chunks_rule}, which sets the virtual pipeline size")
    k["parallel.schedules_method"] = method
    k["parallel.virtual_pipeline_model_parallel_size"] = spec.min_chunks


def _load(tr: Translation, folder: str, finetune: bool, no_optim: bool = False) -> None:
    """``--load``: the weights of a Hugging Face or Megatron folder (``checkpoint.load``); the
    same folder as ``--save`` holding an ms-llm checkpoint resumes that run instead
    (``training.resume auto``) unless ``--finetune``; a torch_dist training checkpoint (the
    PyTorch lane's) resumes from it (``checkpoint.resume_from``)."""
    k = tr.keys
    from ms_llm.checkpoint.torch_dist.io import is_torch_dist_dir
    from ms_llm.checkpoint.megatron.train import latest_legacy
    try:   # a truncated or garbage .pt / tracker is one line, not a traceback
        megatron = os.path.isdir(folder) and (
            any(is_torch_dist_dir(os.path.join(folder, d)) for d in os.listdir(folder)
                if d.startswith("iter_"))
            or (not finetune and not no_optim and latest_legacy(folder)))
    except (ValueError, OSError) as e:
        raise ConfigError(f"--load {folder}: {e}") from None
    if megatron:
        if finetune or no_optim:
            raise ConfigError(f"--load {folder}: a torch_dist training checkpoint with "
                              f"{'--finetune' if finetune else '--no-load-optim'}: loading its "
                              f"weights alone is not built (drop the flag to resume the run)")
        k["checkpoint.resume_from"] = folder
        if os.path.abspath(folder) == os.path.abspath(str(k.get("checkpoint.save_dir", ""))):
            k["training.resume"] = "auto"   # a relaunch continues its own newest save
        tr.notes.append(f"--load {folder}: resuming the Megatron training checkpoint there")
        return
    if not finetune and os.path.abspath(folder) == os.path.abspath(
            str(k.get("checkpoint.save_dir", ""))) and _has_ms_llm_checkpoint(folder):
        k["training.resume"] = "auto"
        tr.notes.append(f"--load {folder}: resuming the ms-llm run saved there")
        return
    k["checkpoint.load"] = folder


def _has_ms_llm_checkpoint(folder: str) -> bool:
    from ms_llm.checkpoint.native import dcp
    try:
        return dcp.resolve_resume("auto", folder, report=lambda _m: None) is not None
    except (OSError, ValueError):
        return False


def to_overrides(keys: Dict[str, Any]) -> List[str]:
    """``--section.key value`` pairs for ``load_config`` (lists comma-joined)."""
    out: List[str] = []
    for key, value in keys.items():
        out += [f"--{key}", ",".join(map(str, value)) if isinstance(value, list) else str(value)]
    return out


def to_yaml(keys: Dict[str, Any]) -> str:
    """The same keys as a YAML config (``section: {key: value}``), values typed by the schema
    when ``load_config`` reads it back."""
    nested: Dict[str, Dict[str, Any]] = {}
    for key, value in keys.items():
        section, _, name = key.partition(".")
        nested.setdefault(section, {})[name] = value
    return yaml.safe_dump(nested, sort_keys=True)


# config keys set by flags that ``_finish`` reads (the rest come from the table's ``Map``s)
_POST_KEYS = {"model.num_query_groups": "--num-query-groups",
              "model.padded_vocab_size": "--padded-vocab-size", "model.family": "--spec",
              "model.mlp_type": "--num-experts", "model.num_moe_experts": "--num-experts",
              "model.moe_layer_pattern": "--first-k-dense-replace",
              "model.moe_shared_expert_intermediate_size": "--n-shared-experts",
              "model.position_embedding_type": "--rope-scaling-type",
              "parallel.sequence_parallel": "--sequence-parallel",
              "parallel.virtual_pipeline_model_parallel_size":
                  "--num-layers-per-virtual-pipeline-stage",
              "parallel.schedules_method": "--schedules-method",
              "training.global_batch_size": "--global-batch-size",
              "training.eval_interval": "--eval-interval", "training.eval_iters": "--eval-iters",
              "training.stage": "--stage", "checkpoint.load": "--load",
              "training.resume": "--load", "checkpoint.resume_from": "--load",
              "checkpoint.format": "--ckpt-format"}
FLAG_OF = {**_POST_KEYS, **{e.key: f for f, e in TABLE.items() if isinstance(e, Map)}}


def explain(message: str) -> str:
    """A run-config error in the user's terms: ``command line --section.key`` becomes the
    Megatron flag that set the key (or ``default of <flag>`` for Megatron's defaults)."""
    def flag(m: "re.Match") -> str:
        return FLAG_OF.get(m.group(1), f"--{m.group(1)}")
    return re.sub(r"command line --([a-z_]+\.[a-z_0-9]+)", flag, message)
