"""The tiny run shared by the parallel-training tests and their msrun workers."""
import os

from .paths import CONFIGS

# Per pytest-xdist worker (msrun workers inherit the variable from the test that launched them),
# so two test processes never write the same output folder.
_SUFFIX = os.environ.get("PYTEST_XDIST_WORKER", "main")
CONFIG = os.path.join(CONFIGS, "tiny.yaml")
# The tiny model (and sequence) most training tests run.
TINY_MODEL = ["--model.num_layers", "2", "--model.hidden_size", "64", "--model.ffn_hidden_size",
              "128", "--model.num_attention_heads", "4", "--model.num_query_groups", "2",
              "--model.kv_channels", "16", "--data.seq_length", "32"]
# The one-process training tests' run (test_training, test_observability, torch_dist resume).
TINY = TINY_MODEL + ["--training.micro_batch_size", "4", "--training.global_batch_size", "4",
                     "--training.progress_bar", "false", "--training.lr_warmup_steps", "2",
                     "--training.lr", "3e-3", "--training.log_interval", "1"]
BASE = TINY_MODEL + [
        "--training.micro_batch_size", "4", "--training.global_batch_size", "8",
        "--training.max_steps", "10",
        "--training.log_interval", "1", "--training.progress_bar", "false",
        "--training.lr_warmup_steps", "2",
        "--training.output_dir", f"/tmp/ms_llm_parallel_test_{_SUFFIX}"]

# FSDP acceptance sizes: every dim-0 uneven on 3 and 4 ranks (257 vocab rows, 200 ffn rows...).
AWKWARD = ["--model.num_layers", "3", "--model.hidden_size", "96", "--model.ffn_hidden_size",
           "200", "--model.num_attention_heads", "4", "--model.num_query_groups", "2",
           "--model.kv_channels", "24", "--model.padded_vocab_size", "257",
           "--model.untie_embeddings_and_output_weights", "true",
           "--data.seq_length", "16", "--training.micro_batch_size", "2",
           "--training.global_batch_size", "12", "--training.max_steps", "5",
           "--training.log_interval", "1", "--training.progress_bar", "false",
           "--training.jit", "false", "--training.lr_warmup_steps", "2",
           "--training.output_dir", f"/tmp/ms_llm_fsdp_test_{_SUFFIX}"]


def small_data_overrides(root: str = f"/tmp/ms_llm_fsdp_test_{_SUFFIX}/data") -> list:
    """A 12-word WordLevel tokenizer and a small corpus, so a 257-row vocabulary is legal (the
    batches themselves come from SyntheticLoader). Written atomically; safe to call from every
    rank."""
    import os
    tok, corpus = os.path.join(root, "tokenizer.json"), os.path.join(root, "corpus.txt")
    if not (os.path.isfile(tok) and os.path.isfile(corpus)):
        from tokenizers import Tokenizer, models, pre_tokenizers
        os.makedirs(root, exist_ok=True)
        words = ["<eos>", "<unk>"] + [f"w{i}" for i in range(10)]
        t = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
        t.pre_tokenizer = pre_tokenizers.Whitespace()
        t.add_special_tokens(["<eos>"])
        tmp = f"{tok}.{os.getpid()}.tmp"
        t.save(tmp)
        os.replace(tmp, tok)
        tmp = f"{corpus}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write("\n\n".join(" ".join(f"w{(i * j) % 10}" for j in range(40))
                                 for i in range(50)))
        os.replace(tmp, corpus)
    return ["--data.tokenizer", tok, "--data.corpus", corpus]


class SyntheticLoader:
    """Deterministic token batches over the whole 257-token vocabulary, sharded like
    BatchIterator: global batch = micro_batch_size x dp_size samples per call."""

    def __init__(self, cfg, dp_rank: int, dp_size: int):
        import numpy as np
        self.np, self.cfg = np, cfg
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.consumed_samples = 0

    def __next__(self):
        np, c = self.np, self.cfg
        mbs, s = c.training.micro_batch_size, c.data.seq_length
        start = self.consumed_samples + self.dp_rank * mbs
        rows = [np.random.default_rng(1000 + i).integers(0, 257, s + 1) for i in
                range(start, start + mbs)]
        self.consumed_samples += mbs * self.dp_size
        ids = np.stack(rows).astype(np.int32)
        return {"tokens": ids[:, :-1], "labels": ids[:, 1:],
                "loss_mask": np.ones((mbs, s), np.float32)}

    def state_dict(self):
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state):
        self.consumed_samples = int(state["consumed_samples"])


# A tiny MoE run (8 experts, top-2, aux loss), micro-batch 2 everywhere so that the 1-, 2- and
# 4-worker runs see the same micro-batches (the aux loss is per micro-batch, so it must).
MOE = ["--training.jit", "false", "--model.mlp_type", "moe", "--model.num_moe_experts", "8",
       "--model.moe_router_topk", "2", "--model.moe_ffn_hidden_size", "32",
       "--model.moe_aux_loss_coeff", "0.01", "--training.micro_batch_size", "2",
       "--training.max_steps", "5"]
# Sigmoid router with aux-loss-free expert bias; experts 2 and 7 get bias -10 so they never
# win a top-2 slot (scores are in (0, 1)): the all-to-alls carry zero-row splits.
MOE_DEAD = ["--model.moe_router_score_function", "sigmoid",
            "--model.moe_router_enable_expert_bias", "true", "--model.moe_aux_loss_coeff", "0"]
DEAD_EXPERTS = (2, 7)


def kill_experts(trainer, experts=DEAD_EXPERTS) -> None:
    """Give ``experts`` a routing bias of -10 in every router of ``trainer.model``."""
    from mindspore import Tensor
    from ms_llm.models.moe import moe_layers
    for layer in moe_layers(trainer.model):
        bias = layer.router.expert_bias.asnumpy().copy()
        bias[list(experts)] = -10.0
        layer.router.expert_bias.set_data(Tensor(bias))


def run_record(trainer) -> dict:
    """Losses, grad norms, (DPO) rewards, (evaluation) eval rows and (MoE) the last forward's
    routed-slot counts per layer."""
    from ms_llm.models.moe import moe_layers
    records = trainer.fit()
    steps = [r for r in records if "loss" in r]          # not the evaluation rows
    out = {"loss": [r["loss"] for r in steps], "grad_norm": [r["grad_norm"] for r in steps]}
    if steps and "optimizer_state_bytes_per_rank" in steps[0]:   # every world rank's
        out["optimizer_bytes"] = steps[0]["optimizer_state_bytes_per_rank"]
    for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracy", "rewards/margin"):
        if steps and key in steps[0]:                     # DPO
            out[key] = [r[key] for r in steps]
    if steps and "mtp_1_loss" in steps[0]:                # multi-token prediction
        out["mtp_1_loss"] = [r["mtp_1_loss"] for r in steps]
    if steps and "max_attention_logit" in steps[0]:       # QK-clip
        out["max_attention_logit"] = [r["max_attention_logit"] for r in steps]
    evals = [r for r in records if "eval_loss" in r]
    if evals:
        out["eval"] = [{k: v for k, v in r.items()} for r in evals]
    # Under pipeline parallel the model also holds other stages' layers, which never ran here.
    layers = [layer for layer in moe_layers(trainer.model) if layer.router.stats is not None]
    if layers:
        out["expert_counts"] = [[int(c) for c in layer.router.stats[1].asnumpy()]
                                for layer in layers]
    return out


class PackedLoader:
    """Packed documents over any loader: token ``eod`` at fixed, per-sample-shifted places (so
    documents cross the context-parallel chunk boundaries), and Megatron's per-document causal
    mask and restarting positions (data.reset_attention_mask / reset_position_ids)."""

    def __init__(self, inner, eod: int = 0):
        self.inner, self.eod = inner, eod

    def __next__(self):
        import numpy as np
        from ms_llm.data.packing import ltor_masks_and_position_ids
        b = dict(next(self.inner))
        tokens = b["tokens"].copy()
        s = tokens.shape[1]
        masks, pos = [], []
        for i in range(tokens.shape[0]):
            for p in range(3 + i % 3, s - 1, 7 + i % 4):
                tokens[i, p] = self.eod
            m, _, ps = ltor_masks_and_position_ids(tokens[i], self.eod, True, True, False)
            masks.append(m)
            pos.append(ps)
        b.update(tokens=tokens, attention_mask=np.stack(masks),
                 position_ids=np.stack(pos).astype(np.int32))
        return b

    @property
    def consumed_samples(self):
        return self.inner.consumed_samples

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state):
        self.inner.load_state_dict(state)
