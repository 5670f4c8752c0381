"""The tiny DeepSeek-V3-style run (configs/deepseek_v3_proxy.yaml, shrunk) shared by
tests/parallel/test_deepseek_parallel.py and its msrun worker (train_parallel.py with @deepseek).
Micro-batch 2 and global batch 4
everywhere, so 1- and 2-worker runs see the same micro-batches (the sequence aux loss and the
expert-bias counts are per micro-batch)."""
import os

from .paths import CONFIGS

# Per pytest-xdist worker (msrun workers inherit it), as in parallel_common.
_SUFFIX = os.environ.get("PYTEST_XDIST_WORKER", "main")
DS_CONFIG = os.path.join(CONFIGS, "deepseek_v3_proxy.yaml")
DS_BASE = ["--model.hidden_size", "64", "--model.ffn_hidden_size", "96",
           "--model.q_lora_rank", "32", "--model.kv_lora_rank", "16", "--model.qk_head_dim", "16",
           "--model.qk_pos_emb_head_dim", "8", "--model.v_head_dim", "16",
           "--model.moe_ffn_hidden_size", "32", "--model.moe_shared_expert_intermediate_size",
           "32", "--model.moe_router_bias_update_rate", "0.01",
           "--data.seq_length", "32", "--training.micro_batch_size", "2",
           "--training.global_batch_size", "4", "--training.max_steps", "5",
           "--data.embedded_vocab_size", "512",
           "--training.log_interval", "1", "--training.progress_bar", "false",
           "--training.lr_warmup_steps", "2",
           "--training.output_dir", f"/tmp/ms_llm_ds_test_{_SUFFIX}"]
DENSE_MLA = ["--model.mlp_type", "dense"]
