"""The PyTorch lane's training loop, as a MindSpeed-LLM / Megatron user runs it, built from the
reference pieces only (no ms_llm import): megatron-core's ``GPTDataset`` (through
``BlendedMegatronDatasetBuilder``) and ``OptimizerParamScheduler``, Megatron's pretraining
sampler order (consecutive global batches, rank r's micro-batch m at ``m * mbs * dp + r * mbs``),
transformers' model for the HF folder, torch AdamW with Megatron's weight-decay groups (no decay
for biases and 1-D tensors, ``wd_mult`` 0) and ``clip_grad_norm_`` (Megatron's coefficient
``max_norm / (norm + 1e-6)``). Loss per micro-batch is the per-token mean divided by the number of
micro-batches (Megatron-Core's ``forward_step``); data-parallel ranks average their gradients.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import numpy as np
import torch


@dataclass
class LaneArgs:
    """Megatron argument names."""
    hf_dir: str
    data_prefix: str
    cache: str
    eod: int
    vocab_size: int
    seq_length: int = 32
    micro_batch_size: int = 2
    global_batch_size: int = 4
    data_parallel_size: int = 1
    train_iters: int = 20
    lr: float = 1e-3
    min_lr: float = 1e-4
    lr_warmup_iters: int = 4
    lr_decay_style: str = "cosine"
    weight_decay: float = 0.1
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    seed: int = 1234


class _Tokenizer:
    """What GPTDataset reads from a tokenizer (no ``pad``: Megatron then pads with -1)."""
    def __init__(self, eod: int, vocab_size: int):
        self.eod, self.vocab_size = eod, vocab_size
        self.unique_identifiers = {"class": "HF tokenizer.json", "eod": eod, "vocab": vocab_size}


def train_dataset(a: LaneArgs):
    from megatron.core.datasets.blended_megatron_dataset_builder import \
        BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    cfg = GPTDatasetConfig(random_seed=a.seed, sequence_length=a.seq_length,
                           blend=([a.data_prefix], None), split="100,0,0",
                           path_to_cache=a.cache, tokenizer=_Tokenizer(a.eod, a.vocab_size),
                           reset_position_ids=False, reset_attention_mask=False,
                           eod_mask_loss=False, create_attention_mask=False)
    sizes = [a.train_iters * a.global_batch_size, 0, 0]
    return BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, cfg).build()[0]


def scheduler(a: LaneArgs, optimizer):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    g = a.global_batch_size
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=a.lr, min_lr=a.min_lr,
        lr_warmup_steps=a.lr_warmup_iters * g, lr_decay_steps=a.train_iters * g,
        lr_decay_style=a.lr_decay_style, start_wd=a.weight_decay, end_wd=a.weight_decay,
        wd_incr_steps=a.train_iters * g, wd_incr_style="constant")


@dataclass
class Lane:
    model: torch.nn.Module
    optimizer: torch.optim.AdamW
    scheduler: object
    dataset: object
    iteration: int = 0


def build(a: LaneArgs) -> Lane:
    from transformers import AutoModelForCausalLM
    torch.manual_seed(a.seed)
    model = AutoModelForCausalLM.from_pretrained(a.hf_dir, dtype=torch.float32,
                                                 attn_implementation="eager")
    model.train()
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim == 1 or name.endswith(".bias") else decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "wd_mult": 1.0},
                             {"params": no_decay, "wd_mult": 0.0}],
                            lr=a.lr, betas=(a.adam_beta1, a.adam_beta2), eps=a.adam_eps,
                            weight_decay=a.weight_decay)
    return Lane(model, opt, scheduler(a, opt), train_dataset(a))


def _micro_batch_loss(model, samples: List[dict]) -> torch.Tensor:
    tokens = torch.stack([torch.as_tensor(np.asarray(s["tokens"])) for s in samples]).long()
    labels = torch.stack([torch.as_tensor(np.asarray(s["labels"])) for s in samples]).long()
    mask = torch.stack([torch.as_tensor(np.asarray(s["loss_mask"])) for s in samples]).float()
    pos = torch.stack([torch.as_tensor(np.asarray(s["position_ids"])) for s in samples]).long()
    logits = model(input_ids=tokens, position_ids=pos).logits.float()
    losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
    return (losses * mask).sum() / mask.sum()


def train(lane: Lane, a: LaneArgs, iters: Optional[int] = None) -> List[dict]:
    """``iters`` more iterations; per iteration the loss (averaged over dp), the grad norm before
    clipping, and the lr Megatron prints (after the scheduler step)."""
    out = []
    dp, mbs, g = a.data_parallel_size, a.micro_batch_size, a.global_batch_size
    accum = g // (mbs * dp)
    for _ in range(iters or a.train_iters):
        start = lane.iteration * g
        lane.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for r in range(dp):           # each rank's gradient, averaged over ranks (DDP)
            for m in range(accum):
                first = start + m * mbs * dp + r * mbs
                loss = _micro_batch_loss(lane.model, [lane.dataset[i] for i in
                                                      range(first, first + mbs)]) / accum
                (loss / dp).backward()
                total += float(loss) / dp
        params = [p for grp in lane.optimizer.param_groups for p in grp["params"]]
        norm = float(torch.nn.utils.clip_grad_norm_(params, a.clip_grad))
        lane.optimizer.step()
        lane.scheduler.step(increment=g)
        lane.iteration += 1
        out.append({"loss": total, "grad_norm": norm,
                    "lr": lane.optimizer.param_groups[0]["lr"]})
    return out


def dump(lane: Lane, a: LaneArgs, path: str, heads: int, groups: int, head_dim: int) -> None:
    """The lane's training state at its iteration for ``mcore_dist_ckpt.py save_lane`` (which
    saves it through megatron-core's dist_checkpointing, as Megatron-LM would)."""
    names = {id(p): n for n, p in lane.model.named_parameters()}
    moments = {"exp_avg": {}, "exp_avg_sq": {}}
    step = 0
    for p, st in lane.optimizer.state.items():
        for k in moments:
            moments[k][names[id(p)]] = st[k].detach().clone()
        step = int(st["step"])
    groups_sd = [{k: v for k, v in g.items() if k != "params"}
                 for g in lane.optimizer.state_dict()["param_groups"]]
    torch.save({"model": {n: p.detach().clone() for n, p in lane.model.named_parameters()},
                **moments, "step": step, "iteration": lane.iteration,
                "consumed": lane.iteration * a.global_batch_size,
                "scheduler": lane.scheduler.state_dict(), "groups_sd": groups_sd,
                "heads": heads, "groups": groups, "head_dim": head_dim}, path)
