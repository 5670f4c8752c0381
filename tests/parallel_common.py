"""The tiny run shared by the parallel-training tests and their msrun workers."""
import os

CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs",
                      "tiny.yaml")
BASE = ["--model.num_layers", "2", "--model.hidden_size", "64", "--model.ffn_hidden_size", "128",
        "--model.num_attention_heads", "4", "--model.num_query_groups", "2",
        "--model.kv_channels", "16", "--data.seq_length", "32", "--training.micro_batch_size",
        "4", "--training.global_batch_size", "8", "--training.max_steps", "10",
        "--training.log_interval", "1", "--training.progress_bar", "false",
        "--training.lr_warmup_steps", "2", "--training.output_dir", "/tmp/ms_llm_parallel_test"]
