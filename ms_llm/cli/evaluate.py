"""``ms-llm evaluate``: MindSpeed-LLM's ``evaluation.py`` command line over local benchmark files.

One process: ``ms-llm evaluate --task mmlu --task-data-path data/mmlu/test --load MODEL``.
Under msrun (this file is the worker script): every rank loads the model, ranks of one
tensor-parallel group (``--tensor-model-parallel-size``) run it together, and the questions are
dealt round-robin over the ``world / tp`` data-parallel groups; the per-question records are
gathered on every rank and rank 0 prints the table. MindSpeed's model-shape flags (``--num-layers``
...) are accepted and ignored: the shape comes from ``--load``.
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from ms_llm.evaluation.run import evaluate


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ms-llm evaluate", description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", nargs="+", required=True,
                   help="mmlu | mmlu_ppl | ceval | boolq | gsm8k | human_eval")
    p.add_argument("--task-data-path", nargs="+", required=True, dest="task_data_path",
                   help="one folder per --task (or one for all)")
    p.add_argument("--load", required=True,
                   help="HF folder, Megatron folder or training checkpoint (save_dir / iter_*)")
    p.add_argument("--tokenizer-name-or-path", dest="tokenizer", default=None,
                   help="tokenizer file or folder (default: the --load folder's)")
    p.add_argument("--max-new-tokens", type=int, default=None, dest="max_new_tokens",
                   help="generation budget (default: mmlu/ceval 2, gsm8k 256, human_eval 512)")
    p.add_argument("--evaluation-batch-size", type=int, default=1, dest="batch_size")
    p.add_argument("--prompt-type", default=None, dest="prompt_type",
                   help="wrap every prompt as a user turn of the tokenizer's chat template")
    p.add_argument("--no-chat-template", action="store_true", dest="no_chat_template",
                   help="never use the chat template (MindSpeed uses it when the tokenizer has "
                        "one)")
    p.add_argument("--num-fewshot", type=int, default=None, dest="num_fewshot",
                   help="few-shot examples (default: mmlu/ceval 5 from ../dev if present, "
                        "gsm8k 4 from *train*.jsonl)")
    p.add_argument("--instruction-template", default=None, dest="instruction_template",
                   help="human_eval: a template with {prompt} around each problem")
    p.add_argument("--max-eval-samples", type=int, default=None, dest="max_eval_samples",
                   help="first n questions of each subject (debugging)")
    p.add_argument("--human-eval-timeout", type=float, default=10.0, dest="exec_timeout",
                   help="seconds each HumanEval program may run")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1, dest="tp")
    p.add_argument("--seq-length", type=int, default=None, dest="seq_length",
                   help="longest sequence fed to the model (default max_position_embeddings)")
    p.add_argument("--bf16", action="store_const", const="bfloat16", dest="dtype")
    p.add_argument("--fp16", action="store_const", const="float16", dest="dtype")
    p.add_argument("--output-json", default=None, dest="output_json",
                   help="write per-subject and total accuracy (and every record) here")
    return p


def main(argv: Optional[List[str]] = None, out=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args, unknown = build_parser().parse_known_args(argv)
    flags = [a for a in unknown if a.startswith("--")]
    if flags:
        print(f"ms-llm evaluate: ignoring {' '.join(flags)} (the model's shape and parallel "
              f"settings other than --tensor-model-parallel-size come from --load)",
              file=sys.stderr)
    from ms_llm.evaluation.sandbox import SandboxError
    try:
        evaluate(args, out)
    except (ValueError, FileNotFoundError, SandboxError) as e:
        print(f"ms-llm evaluate: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":        # the worker script msrun runs
    sys.exit(main())
