"""``ms-llm evaluate``'s run (its command line is ``ms_llm.cli.evaluate``): every rank loads the
model, ranks of one tensor-parallel group run it together, the questions are dealt round-robin
over the ``world / tp`` data-parallel groups, and the per-question records are gathered on every
rank; rank 0 prints the table."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Dict, List


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
