"""Acceptance: one published script of each family added to the tested set runs end to end
under msrun with only the launcher line, the sizes and the paths changed, and its curve is the
one ``ms-llm train`` gives for the same flags in one process.

* ``deepseek2_lite/pretrain_deepseek2_lite_16b_ptd_8p.sh`` (``deepseek_spec``: MLA without a
  query LoRA, the pai_megatron_aux_loss softmax router, one dense layer first, 2 shared experts,
  full recompute) on 2 workers with expert parallel 2, from a DeepSeek-V2 HF folder.
* ``qwen3_next/pretrain_qwen3_next_80b_16K_A3_ptd.sh`` (``qwen3_next_spec``: Gated DeltaNet and
  gated full attention every 4th layer, MoE with a gated shared expert) on 2 workers with
  pipeline parallel 2 and one layer per virtual stage (2 chunks per rank), from a Qwen3-Next HF
  folder.

2 workers x 1 micro-batch x 2 accumulation steps (or pipeline micro-batches) against 1 process x
4 micro-batches: the same samples per step; bf16 forward per micro-batch, fp32 gradient sums in
another order: rtol 1e-3 (the dense scripts' tolerance, tests/mindspeed/
test_mindspeed_scripts_msrun.py).
"""
import numpy as np
import pytest

from helpers.finetune_fixtures import alpaca_rows, preprocess, write_jsonl, write_tokenizer
from helpers.mindspeed_scripts import one_process_run, run_script, save_tiny_hf

pytestmark = [pytest.mark.msrun, pytest.mark.slow]

COMMON = {"--hidden-size": "64", "--num-attention-heads": "4", "--ffn-hidden-size": "96",
          "--padded-vocab-size": "64", "--seq-length": "32", "--global-batch-size": "4",
          "--train-iters": "4", "--save-interval": "2", "--moe-ffn-hidden-size": "32",
          "--num-experts": "8"}
DEEPSEEK2_LITE = dict(COMMON, **{
    "--num-layers": "2", "--vocab-size": "64", "--kv-lora-rank": "32", "--qk-head-dim": "16",
    "--qk-pos-emb-head-dim": "8", "--v-head-dim": "16", "--expert-model-parallel-size": "2"})
QWEN3_NEXT = dict(COMMON, **{
    "--num-layers": "4", "--kv-channels": "16", "--linear-key-head-dim": "16",
    "--linear-value-head-dim": "16", "--linear-num-key-heads": "2",
    "--linear-num-value-heads": "4", "--mamba-chunk-size": "16", "--moe-router-topk": "2",
    "--pipeline-model-parallel-size": "2", "--expert-model-parallel-size": "1",
    "--max-position-embeddings": "64"})


# DeepSeek-V2-Lite's rope_scaling (the script's --rope-scaling-* flags say the same)
V2_LITE_YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707,
                "rope_theta": 10000.0}

QWEN3_NEXT_ROPE = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("mindspeed_families")
    save_tiny_hf(root / "deepseek2_hf", "deepseek-v2", seed=3, num_hidden_layers=2,
                 vocab_size=64, n_routed_experts=8, num_experts_per_tok=6, n_shared_experts=2,
                 routed_scaling_factor=1.0, max_position_embeddings=163840,
                 rope_parameters=V2_LITE_YARN)
    save_tiny_hf(root / "qwen3_next_hf", "qwen3-next", seed=4, num_hidden_layers=4,
                 vocab_size=64, num_experts=8, num_experts_per_tok=2,
                 shared_expert_intermediate_size=32, full_attention_interval=4,
                 mlp_only_layers=[], max_position_embeddings=64,
                 rope_parameters=QWEN3_NEXT_ROPE)
    for hf in ("deepseek2_hf", "qwen3_next_hf"):
        write_tokenizer(root / hf)
    rows = alpaca_rows(64, seed=4)
    text = write_jsonl(root / "text.jsonl", [{"text": " ".join([r["instruction"], r["output"]] * 3)}
                                             for r in rows])
    preprocess(text, str(root / "deepseek2_hf"), str(root / "pre"), "GeneralPretrainHandler",
               "--append-eod")
    return root


def paths(folder, hf, tag):
    return {"@LOAD@": str(folder / hf), "@TOKENIZER@": str(folder / hf),
            "@DATA@": str(folder / "pre_text_document"), "@SAVE@": str(folder / tag / "save")}


@pytest.mark.parametrize("name, hf, sizes", [
    ("deepseek2_lite/pretrain_deepseek2_lite_16b_ptd_8p.sh", "deepseek2_hf", DEEPSEEK2_LITE),
    pytest.param("qwen3_next/pretrain_qwen3_next_80b_16K_A3_ptd.sh", "qwen3_next_hf", QWEN3_NEXT,
                 marks=pytest.mark.extended),   # Qwen3-Next's layouts: test_qwen3_next_parallel
], ids=["deepseek2_lite", "qwen3_next"])
def test_published_script_of_a_new_family_under_msrun(folder, name, hf, sizes):
    tag = name.split("/")[0]
    argv, rows, log0 = run_script(str(folder / tag), name, 2, paths(folder, hf, tag), sizes)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(np.isfinite(r["loss"]) for r in rows)
    ref = one_process_run(argv, str(folder / f"{tag}_one"))
    np.testing.assert_allclose([r["loss"] for r in rows], [r["loss"] for r in ref], rtol=1e-3)
    assert [r["lr"] for r in rows] == [r["lr"] for r in ref]
