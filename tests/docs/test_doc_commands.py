"""Every command README.md and docs/**/*.md show is run by a test.

A command is a logical line of a fenced ``bash`` block (backslash continuations joined, comments
dropped) or a ``$ `` line of a fenced ``console`` block. ``CLAIMS`` maps each command, as shown,
to the tests that run it (with sizes shrunk where a test needs to stay small) or to ``.ci/run``,
the CI script. The tests below fail when a page shows a command nobody claims, when a claim names
a command no page shows any more, or when a claim names a test that does not exist. Output,
YAML and ``text`` blocks are not commands; benchmark invocations that record how a figure in
docs/performance.md was measured are written inline, not as blocks.
"""
import glob
import os
import re
from pathlib import Path

import yaml

# the repository root, wherever under tests/ this file sits
ROOT = str(next(p for p in Path(__file__).resolve().parents if (p / "setup.cfg").is_file()))
CI = ".ci/run"

# the long fine-tuning commands of docs/guides/finetuning.md
SFT = ("ms-llm train --checkpoint.load hf_model --data.tokenizer hf_model --data.data_path data/sft "
       "--data.dataset_type sft --data.seq_length 64 --data.split 90,10,0 "
       "--training.eval_interval 2 --training.eval_iters 1 --training.max_steps 4 "
       "--training.micro_batch_size 2 --training.global_batch_size 4 --training.lr 1e-4 "
       "--training.min_lr 1e-5 --training.log_interval 1 --training.jit false "
       "--training.output_dir outputs/sft")
DPO = ("ms-llm train --checkpoint.load hf_model --data.tokenizer hf_model --data.data_path data/pairs "
       "--training.stage dpo --dpo.beta 0.1 --dpo.loss_type sigmoid --data.seq_length 64 "
       "--data.split 90,10,0 --training.eval_interval 2 --training.eval_iters 1 "
       "--training.micro_batch_size 2 --training.global_batch_size 4 --training.lr 5e-4 "
       "--training.lr_decay_style constant --training.lr_warmup_steps 0")
DPO_TAIL = (" --training.log_interval 1 --checkpoint.save_dir ckpts/dpo "
            "--training.output_dir outputs/dpo")

CLAIMS = {
    # README.md, docs/install.md
    "python3 -m venv .venv && . .venv/bin/activate && pip install -e . && bash scripts/pretrain.sh":
        ("test_pretrain_sh_trains_and_plots",),
    'python3 -m venv .venv && . .venv/bin/activate && pip install -e ".[test]" && python -m pytest -q':
        (CI,),
    "python -m pytest -q -m extended": ("test_extended_marker_selects_the_long_cross_checks",),
    # docs/quickstart.md
    "bash scripts/pretrain.sh --training.max_steps 20": ("test_pretrain_sh_trains_and_plots",),
    "ms-llm plot outputs/tiny": ("test_pretrain_sh_trains_and_plots",),
    # docs/features/parallelism.md
    "NPROC=2 bash scripts/pretrain.sh --parallel.tensor_model_parallel_size 2 "
    "--parallel.sequence_parallel true": ("test_readme_tensor_parallel_trains_as_typed",),
    "NPROC=2 bash scripts/pretrain.sh --parallel.context_parallel_size 2 --data.seq_length 1024 "
    "--training.micro_batch_size 1 --training.global_batch_size 2":
        ("test_readme_context_parallel_command",),
    # docs/features/pipeline.md
    "NPROC=2 bash scripts/pretrain.sh --parallel.pipeline_model_parallel_size 2 "
    "--parallel.virtual_pipeline_model_parallel_size 2": ("test_readme_pipeline_command",),
    "ms-llm schedule configs/tiny.yaml --parallel.pipeline_model_parallel_size 2 "
    "--parallel.virtual_pipeline_model_parallel_size 2 --training.micro_batch_size 4":
        ("test_readme_schedule_command",),
    # docs/features/moe.md
    "NPROC=2 bash scripts/pretrain.sh configs/deepseek_v3_proxy.yaml "
    "--parallel.expert_model_parallel_size 2 --model.mtp_num_layers 1":
        ("test_readme_deepseek_proxy_ep2_command",),
    # docs/features/bf16.md, muon.md
    "ms-llm train configs/tiny.yaml --training.bf16 true":
        ("test_bf16_training_fp32_mains_exact_resume_and_export",),
    "ms-llm train configs/tiny.yaml --training.optimizer muon --training.lr 0.02":
        ("test_muon_training_resumes_exactly_and_is_planned",),
    # docs/features/memory.md
    "bash scripts/pretrain.sh --training.recompute_granularity full --training.recompute_method "
    "block --training.recompute_num_layers 2 --training.recompute_norm true":
        ("test_readme_recompute_command",),
    "ms-llm plan configs/qwen3_8b.yaml --nproc 8 --device-memory-gb 64":
        ("test_readme_shows_what_plan_prints",),
    # docs/features/fault_tolerance.md
    "MS_LLM_FAULT_INJECT=4:1 MAX_RESTARTS=1 NPROC=2 bash scripts/pretrain.sh --training.max_steps 6 "
    "--checkpoint.save_dir ckpt --checkpoint.save_interval 2":
        ("test_killed_worker_restarts_and_continues_the_curve",),
    "ms-llm checkpoint verify ckpt": ("test_checkpoint_verify_command",),
    # docs/features/observability.md
    "ms-llm train --training.tensorboard_dir outputs/tb --training.timing_log_level 2 "
    "--training.log_timers_to_tensorboard true":
        ("test_tensorboard_event_files_equal_metrics_jsonl_and_resume_has_each_step_once",
         "test_timers_levels_and_min_max"),
    "ms-llm train --training.profile true --training.profile_step_start 5 "
    "--training.profile_step_end 7": ("test_profile_two_steps_on_cpu_has_the_matmuls",),
    "NPROC=2 bash scripts/pretrain.sh --training.deterministic true":
        ("test_deterministic_reruns_are_bit_identical",),
    # docs/guides/finetuning.md (the SFT and DPO blocks are read from the page and run as typed)
    "ms-llm train --checkpoint.load Qwen3-0.6B --data.tokenizer Qwen3-0.6B --lora.r 8 "
    "--lora.alpha 16 --checkpoint.save_dir ckpt_lora": ("test_readme_lora_commands",),
    "ms-llm export ckpt_lora qwen3_lora_merged": ("test_readme_lora_commands",),
    "ms-llm export ckpt_lora qwen3_lora_peft --lora-only": ("test_readme_lora_commands",),
    "ms-llm convert --load-model-type hf --save-model-type mg --load-dir Qwen3-0.6B "
    "--lora-load ckpt_lora --save-dir qwen3_lora_mg": ("test_readme_lora_commands",),
    "ms-llm preprocess --input alpaca.jsonl --tokenizer-name-or-path hf_model "
    "--handler-name AlpacaStyleInstructionHandler --output-prefix data/sft":
        ("test_readme_sft_with_evaluation",),
    SFT: ("test_readme_sft_with_evaluation",),
    "ms-llm preprocess --input pairs.jsonl --tokenizer-name-or-path hf_model "
    "--handler-name AlpacaStylePairwiseHandler --output-prefix data/pairs":
        ("test_readme_dpo_sequence",),
    DPO + " --training.max_steps 2" + DPO_TAIL: ("test_readme_dpo_sequence",),
    DPO + " --training.max_steps 4" + DPO_TAIL + " --training.resume auto":
        ("test_readme_dpo_sequence",),
    "ms-llm export ckpts/dpo hf_dpo": ("test_readme_dpo_sequence",),
    # docs/guides/checkpoints.md
    "ms-llm convert --load-model-type hf --save-model-type mg --model-type-hf qwen3 "
    "--load-dir Qwen3-0.6B --save-dir qwen3_mg --target-tensor-parallel-size 2 "
    "--target-pipeline-parallel-size 1": ("test_hf_to_mg_tp2_pp2_layout_and_round_trip",),
    "ms-llm convert --load-model-type mg --save-model-type hf --load-dir qwen3_mg "
    "--save-dir qwen3_hf": ("test_hf_to_mg_tp2_pp2_layout_and_round_trip",),
    "ms-llm export outputs/ckpt hf_out": ("test_cli_export_newest_checkpoint",),
    # docs/guides/inference.md
    'ms-llm generate --load Qwen3-0.6B --prompt "The capital of France is" --max-new-tokens 32':
        ("test_generate_stream_equals_plain_equals_python",),
    'ms-llm chat --load Qwen3-0.6B --system "Answer briefly."':
        ("test_chat_keeps_the_conversation",),
    # docs/guides/evaluation.md
    "ms-llm evaluate --task mmlu --task-data-path data/mmlu/test --load Qwen3-0.6B "
    "--evaluation-batch-size 8 --max-new-tokens 2 --output-json mmlu.json":
        ("test_every_format_matches_the_reference",),
    "ms-llm lm-eval --model ms-llm --model_args pretrained=Qwen3-0.6B --tasks my_task "
    "--include_path my_tasks/ --batch_size 16":
        ("test_cli_runs_the_harness_with_ms_llm_registered",),
    # docs/qualification.md
    "ms-llm qualify --suite quick --out outputs/qualify": ("test_qualify_ci_matrix",),
    "ms-llm qualify --cells qwen35:dp,qwen35:Muon --out docs/support --merge":
        ("test_a_run_merges_its_cells_into_the_published_table",),
    "ms-llm qualify --merge-from /tmp/big_run --merge-from /tmp/new_cells --out docs/support":
        ("test_merge_folders_replaces_cells_and_names_each_cells_commit",),
}


def doc_files():
    return [os.path.join(ROOT, "README.md")] + sorted(
        glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))


def fenced_blocks(text):
    """(language, body) of every fenced block."""
    return re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)


def commands_of(lang, body):
    if lang == "console":
        return [line[2:].strip() for line in body.splitlines() if line.startswith("$ ")]
    if lang != "bash":
        return []
    out, current = [], ""
    for line in body.splitlines():
        current += line.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        command = re.sub(r"(^|\s)#.*$", "", current).strip()
        if command:
            out.append(" ".join(command.split()))
        current = ""
    return out


def shown_commands():
    """{command: [pages showing it]}."""
    shown = {}
    for path in doc_files():
        text = open(path, encoding="utf-8").read()
        for lang, body in fenced_blocks(text):
            for command in commands_of(lang, body):
                shown.setdefault(command, []).append(os.path.relpath(path, ROOT))
    return shown


def test_every_shown_command_is_claimed_by_a_test():
    unclaimed = {c: pages for c, pages in shown_commands().items() if c not in CLAIMS}
    assert not unclaimed, ("commands shown in the docs that no test claims (add the test that "
                           f"runs each to CLAIMS, or drop the command): {unclaimed}")


def test_every_claim_is_still_shown():
    stale = sorted(set(CLAIMS) - set(shown_commands()))
    assert not stale, f"CLAIMS names commands no page shows any more: {stale}"


def test_every_claiming_test_exists():
    sources = "\n".join(open(p, encoding="utf-8").read() for p in
                        glob.glob(os.path.join(ROOT, "tests", "**", "*.py"), recursive=True))
    ci = open(os.path.join(ROOT, CI), encoding="utf-8").read()
    for command, tests in CLAIMS.items():
        assert tests, command
        for name in tests:
            if name == CI:
                assert all(part.strip() in ci for part in command.split("&&")), command
            else:
                assert re.search(rf"^def {re.escape(name)}\(", sources, re.M), (name, command)


def test_mxfp8_page_yaml_is_a_valid_quant_section(tmp_path):
    """docs/features/mxfp8.md's YAML example loads with the default config and selects modules
    of the default model (its patterns match, its ignored layer is left out)."""
    from ms_llm.config import load_config
    from ms_llm.models import GPTModel
    from ms_llm.quant import apply_quantization

    text = open(os.path.join(ROOT, "docs", "features", "mxfp8.md"), encoding="utf-8").read()
    (example,) = [body for lang, body in fenced_blocks(text) if lang == "yaml"]
    run = yaml.safe_load(open(os.path.join(ROOT, "configs", "tiny.yaml"), encoding="utf-8"))
    run.update(yaml.safe_load(example))
    path = tmp_path / "mxfp8.yaml"
    path.write_text(yaml.safe_dump(run))
    cfg = load_config(str(path))
    assert cfg.quant.recipe == "mxfp8"
    names = apply_quantization(GPTModel(cfg.model), cfg.quant)
    assert names and not [n for n in names if n.startswith("decoder.layers.0.")]


def test_extended_marker_selects_the_long_cross_checks():
    """docs/install.md's ``python -m pytest -q -m extended`` (collected here on one file, not
    run): the default run (setup.cfg's ``-m "not extended"``) leaves the 50-step O2 curve out and
    the command's ``-m extended`` selects it alone."""
    import subprocess
    import sys

    def collected(*marker):
        r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0",
                            "-p", "no:cacheprovider", *marker, "tests/optim/test_adamw_o2.py"],
                           capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        return {line.split("::")[-1] for line in r.stdout.splitlines() if "::" in line}

    curve = "test_o2_curve_over_50_steps_stays_within_tolerance_of_fp32_moments"
    default, extended = collected(), collected("-m", "extended")
    assert curve not in default and default
    assert extended == {curve}
