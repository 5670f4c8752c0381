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
import json
import os
import sys
from typing import Dict, List, Optional

DESCRIPTION = __doc__.split("\n\n")[0]


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


def _check(args: argparse.Namespace) -> None:
    if len(args.task_data_path) not in (1, len(args.task)):
        raise ValueError(f"--task-data-path: {len(args.task_data_path)} folders for "
                         f"{len(args.task)} tasks (give one per task, or one)")
    for flag, value in (("--evaluation-batch-size", args.batch_size), ("--tensor-model-"
                        "parallel-size", args.tp)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")


def _setup(args: argparse.Namespace):
    """The scorer (sharded over the tp group under msrun), this rank's dp coordinates and the
    group to gather over."""
    from ms_llm.compat import setup_device
    setup_device()
    from ms_llm.evaluation.scorer import ModelScorer
    from ms_llm.parallel.runtime import init_distributed
    info = init_distributed()
    if info.world_size % args.tp:
        raise ValueError(f"--tensor-model-parallel-size {args.tp} does not divide the "
                         f"{info.world_size} processes")
    model = None
    dp_rank, dp_size, tp_rank = 0, 1, 0
    if info.world_size > 1:
        from ms_llm.inference.loading import load_model
        from ms_llm.parallel.state import initialize_model_parallel
        pstate = initialize_model_parallel(tp=args.tp)
        dp_rank, dp_size, tp_rank = pstate.dp_rank, info.world_size // args.tp, pstate.tp_rank
        model = load_model(args.load, args.dtype)
        if args.tp > 1:
            from ms_llm.parallel.parallelize import describe_layouts
            from ms_llm.parallel.tensor_parallel import apply_tensor_parallel
            describe_layouts(model)
            apply_tensor_parallel(model, pstate.group("tp"))
    elif args.tp > 1:
        raise ValueError(f"--tensor-model-parallel-size {args.tp} needs {args.tp} processes: "
                         f"launch under msrun")
    scorer = ModelScorer.from_path(args.load, args.tokenizer, args.dtype, args.seq_length,
                                   model=model)
    return scorer, info, dp_rank, dp_size, tp_rank


def _gather(records: List[dict], world_size: int) -> List[dict]:
    if world_size == 1:
        return records
    from ms_llm.parallel import comm
    parts: list = [None] * world_size
    comm.all_gather_object(parts, records)
    merged: Dict[tuple, dict] = {}
    for part in parts:                      # tp peers hold the same records: keep one, and
        for r in part:                      # HumanEval's executed one over a peer's None
            key = (r["subject"], r["index"])
            if key not in merged or merged[key]["correct"] is None:
                merged[key] = r
    return [merged[k] for k in sorted(merged)]


def evaluate(args: argparse.Namespace, out=None) -> Dict[str, dict]:
    """Run every ``--task``; return ``{task: summary}`` (rank 0 prints the tables)."""
    from ms_llm.evaluation import report, tasks
    out = out or sys.stdout
    _check(args)
    opts = tasks.TaskOptions(batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                             num_fewshot=args.num_fewshot,
                             instruction_template=args.instruction_template,
                             max_eval_samples=args.max_eval_samples,
                             exec_timeout=args.exec_timeout)
    folders = (args.task_data_path * len(args.task) if len(args.task_data_path) == 1
               else args.task_data_path)
    data = {t: tasks.load_task(t, f, opts) for t, f in zip(args.task, folders)}
    scorer, info, dp_rank, dp_size, tp_rank = _setup(args)
    if args.prompt_type is not None and not scorer.tokenizer.chat_template:
        raise ValueError(f"--prompt-type: tokenizer {scorer.tokenizer.path} has no "
                         f"chat_template")
    opts.chat = bool(scorer.tokenizer.chat_template) and (
        args.prompt_type is not None or not args.no_chat_template)
    results: Dict[str, dict] = {}
    for task in args.task:
        records = tasks.run_task(task, data[task], scorer, opts,
                                 mine=lambda i: i % dp_size == dp_rank,
                                 execute=tp_rank == 0)
        records = _gather(records, info.world_size)
        summary = report.summarize(records)
        results[task] = dict(summary, records=records)
        if info.rank == 0:
            print(report.table(task, summary), file=out, flush=True)
    if info.rank == 0 and args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1, ensure_ascii=False)
    return results


def main(argv: Optional[List[str]] = None, out=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args, unknown = build_parser().parse_known_args(argv)
    flags = [a for a in unknown if a.startswith("--")]
    if flags:
        print(f"ms-llm evaluate: ignoring {' '.join(flags)} (the model's shape and parallel "
              f"settings other than --tensor-model-parallel-size come from --load)",
              file=sys.stderr)
    try:
        evaluate(args, out)
    except (ValueError, FileNotFoundError) as e:
        print(f"ms-llm evaluate: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":        # the worker script msrun runs
    sys.exit(main())
