"""The tiny Qwen3-Next run (configs/qwen3_next_80b_a3b.yaml, shrunk) shared by
tests/parallel/test_qwen3_next_parallel.py and its msrun worker (train_parallel.py with @qwen3next).
Three layers, Gated DeltaNet / gated attention / Gated DeltaNet (chunks of 16 tokens, two
per sequence, so the chunk scan carries a state), every one MoE (4 experts, top 2,
aux loss) with a gated shared expert. Micro-batch 2 and global batch 4 everywhere, so 1- and
2-worker runs see the same micro-batches (the aux loss is per micro-batch)."""
import os

from .paths import CONFIGS

# Per pytest-xdist worker (msrun workers inherit it), as in parallel_common.
_SUFFIX = os.environ.get("PYTEST_XDIST_WORKER", "main")
Q3N_CONFIG = os.path.join(CONFIGS, "qwen3_next_80b_a3b.yaml")
Q3N_BASE = ["--model.num_layers", "3",
            "--model.layer_types", "gated_delta_net,attention,gated_delta_net",
            "--model.hidden_size", "64", "--model.ffn_hidden_size", "96",
            "--model.num_attention_heads", "4", "--model.num_query_groups", "2",
            "--model.kv_channels", "16", "--model.max_position_embeddings", "64",
            "--model.padded_vocab_size", "512",
            "--model.linear_key_head_dim", "16", "--model.linear_value_head_dim", "16",
            "--model.linear_num_key_heads", "2", "--model.linear_num_value_heads", "4",
            "--model.linear_chunk_size", "16",
            "--model.num_moe_experts", "4", "--model.moe_router_topk", "2",
            "--model.moe_ffn_hidden_size", "32", "--model.moe_shared_expert_intermediate_size",
            "32", "--model.moe_aux_loss_coeff", "0.01",
            "--data.corpus", "embedded", "--data.tokenizer", "embedded",
            "--data.embedded_vocab_size", "512", "--data.seq_length", "32",
            "--training.micro_batch_size", "2", "--training.global_batch_size", "4",
            "--training.max_steps", "5", "--training.jit", "false",
            "--training.lr", "3e-3", "--training.min_lr", "3e-4",
            "--training.log_interval", "1", "--training.progress_bar", "false",
            "--training.lr_warmup_steps", "2",
            "--training.output_dir", f"/tmp/ms_llm_q3n_test_{_SUFFIX}"]
