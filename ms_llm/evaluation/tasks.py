"""The MindSpeed tasks: how each one reads its files, prompts the model and scores a reply.

| task | scored by |
|---|---|
| ``mmlu`` / ``ceval`` | greedy generation; the answer letter read from the reply (MindSpeed's regexes) |
| ``mmlu_ppl`` | log-likelihood of each answer letter after the prompt; the most likely one |
| ``boolq`` | log-probability of the next token being ``Yes``'s against ``No``'s (MindSpeed compares those two logits) |
| ``gsm8k`` | greedy chain-of-thought generation up to ``Question:``; its last number against the reference |
| ``human_eval`` | greedy completion cut at the HumanEval stop lines, run with the tests in a time-limited subprocess (pass@1) |

``run_task`` scores the samples ``mine(sample)`` selects (a data-parallel rank's share) and
returns one record per sample; ``ms_llm.cli.evaluate`` gathers and tabulates them.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

from . import formats, prompts
from .formats import Sample
from .sandbox import DEFAULT_STOP, human_eval_program, run_program

TASKS = ("mmlu", "mmlu_ppl", "ceval", "boolq", "gsm8k", "human_eval")
NOT_BUILT = ("cmmlu", "agieval", "bbh", "hellaswag", "needlebench")
DEFAULT_NEW_TOKENS = {"mmlu": 2, "ceval": 2, "gsm8k": 256, "human_eval": 512}


@dataclass
class TaskOptions:
    batch_size: int = 1
    max_new_tokens: Optional[int] = None
    num_fewshot: Optional[int] = None
    chat: bool = False
    instruction_template: Optional[str] = None
    max_eval_samples: Optional[int] = None
    exec_timeout: float = 10.0


def load_task(task: str, folder: str, opts: TaskOptions) -> Dict[str, List[Sample]]:
    """The task's samples by subject (``--max-eval-samples`` keeps the first n of each)."""
    if task in NOT_BUILT:
        raise ValueError(f"--task {task}: not built in ms-llm (built: {', '.join(TASKS)})")
    if task not in TASKS:
        raise ValueError(f"--task {task}: unknown (built: {', '.join(TASKS)})")
    if task in ("mmlu", "mmlu_ppl"):
        data = formats.load_multiple_choice(folder, header=False, num_fewshot=opts.num_fewshot)
    elif task == "ceval":
        data = formats.load_multiple_choice(folder, header=True, num_fewshot=opts.num_fewshot)
    elif task == "boolq":
        data = formats.load_boolq(folder)
    elif task == "gsm8k":
        data = formats.load_gsm8k(folder, opts.num_fewshot)
    else:
        data = formats.load_human_eval(folder)
    if opts.max_eval_samples is not None:
        data = {k: v[:opts.max_eval_samples] for k, v in data.items()}
    return data


def run_task(task: str, data: Dict[str, List[Sample]], scorer, opts: TaskOptions,
             mine: Callable[[int], bool] = lambda i: True, execute: bool = True) -> List[dict]:
    """Records ``{subject, index, correct, prediction}`` of the samples whose position in
    the task's flat order ``mine`` accepts. ``execute`` False leaves HumanEval's ``correct``
    as None (a tensor-parallel peer that need not run the same programs twice)."""
    flat = [s for subject in data for s in data[subject]]
    samples = [s for i, s in enumerate(flat) if mine(i)]
    if task == "mmlu_ppl":
        return _choice_loglikelihood(samples, scorer, opts)
    if task == "boolq":
        return _boolq(samples, scorer, opts)
    return _generated(task, samples, scorer, opts, execute)


def _context(scorer, text: str, opts: TaskOptions) -> List[int]:
    """Prompt ids: plain text, or one user turn of the tokenizer's chat template."""
    if not opts.chat:
        return scorer.encode(text)
    rendered = scorer.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                    add_generation_prompt=True)
    return scorer.encode(rendered, add_special_tokens=False)


def _record(s: Sample, correct, prediction: str) -> dict:
    return {"subject": s.subject, "index": s.index, "correct": correct,
            "prediction": prediction}


def _choice_loglikelihood(samples, scorer, opts) -> List[dict]:
    conts = prompts.choice_continuations("en")
    pairs = []
    for s in samples:
        ctx_text = prompts.multiple_choice_prompt(s, "en")
        ctx = _context(scorer, ctx_text, opts)
        pairs += [(ctx, scorer.encode(c, add_special_tokens=False)) for c in conts]
    scores = scorer.loglikelihood(pairs, opts.batch_size)
    out = []
    for k, s in enumerate(samples):
        lls = [scores[4 * k + j][0] for j in range(4)]
        pred = formats.CHOICES[max(range(4), key=lambda j: lls[j])]
        out.append(_record(s, pred == s.gold, pred))
    return out


def _boolq(samples, scorer, opts) -> List[dict]:
    yes = scorer.encode("Yes", add_special_tokens=False)[-1]
    no = scorer.encode("No", add_special_tokens=False)[-1]
    pairs = []
    for s in samples:
        ctx = _context(scorer, prompts.boolq_prompt(s), opts)
        pairs += [(ctx, [yes]), (ctx, [no])]
    scores = scorer.loglikelihood(pairs, opts.batch_size)
    out = []
    for k, s in enumerate(samples):
        pred = "T" if scores[2 * k][0] >= scores[2 * k + 1][0] else "F"
        out.append(_record(s, pred == s.gold, pred))
    return out


def _generated(task, samples, scorer, opts, execute) -> List[dict]:
    new_tokens = opts.max_new_tokens or DEFAULT_NEW_TOKENS[task]
    if task in ("mmlu", "ceval"):
        texts = [prompts.multiple_choice_prompt(s, "en" if task == "mmlu" else "zh")
                 for s in samples]
        stop = ()
    elif task == "gsm8k":
        texts, stop = [prompts.gsm8k_prompt(s) for s in samples], prompts.GSM8K_STOP
    else:
        texts = [prompts.human_eval_prompt(s, opts.instruction_template) for s in samples]
        stop = DEFAULT_STOP
    replies: List[str] = []
    for start in range(0, len(samples), opts.batch_size):
        batch = [_context(scorer, t, opts) for t in texts[start:start + opts.batch_size]]
        replies += scorer.generate(batch, new_tokens, stop=stop)
    out = []
    for s, reply in zip(samples, replies):
        if task in ("mmlu", "ceval"):
            pred = prompts.extract_choice(reply)
            out.append(_record(s, pred == s.gold, pred))
        elif task == "gsm8k":
            pred = prompts.extract_last_number(reply)
            out.append(_record(s, prompts.same_number(pred, s.gold), pred))
        else:
            completion = prompts.cut_at_stop(reply, DEFAULT_STOP)
            if not execute:
                out.append(_record(s, None, completion))
                continue
            result = run_program(human_eval_program(s.fields, completion), opts.exec_timeout)
            if not any("status" in r for r in out):     # once per task: what was enforced
                print(f"ms-llm evaluate: human_eval sandbox: {result.boundary}",
                      file=sys.stderr, flush=True)
            rec = _record(s, result.passed, completion)
            rec["status"], rec["detail"] = result.status, result.detail
            out.append(rec)
    return out
