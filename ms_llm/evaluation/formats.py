"""Readers for the benchmarks' standard local files, one ``Sample`` list per subject.

| task | ``--task-data-path`` holds | a row |
|---|---|---|
| mmlu, mmlu_ppl | ``{subject}_test.csv`` (no header) and a sibling ``dev/{subject}_dev.csv`` for few-shot | question, A, B, C, D, answer |
| ceval | ``{subject}_val.csv`` (header) and a sibling ``dev/{subject}_dev.csv`` | id, question, A, B, C, D, answer[, explanation] |
| boolq | ``*.jsonl`` | {"question", "passage", "answer": true/false[, "title"]} |
| gsm8k | ``*.jsonl``; files whose name holds ``train`` are the few-shot pool only | {"question", "answer": "... #### 42"} |
| human_eval | ``*.jsonl`` (HumanEval.jsonl) | {"task_id", "prompt", "test", "entry_point"[, "canonical_solution"]} |

Subjects are the file names without ``_test`` / ``_val`` / ``_dev`` and the extension (as
MindSpeed names them), in sorted order so every rank sees the same list.
"""
from __future__ import annotations

import csv
import json
import os
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional

CHOICES = ("A", "B", "C", "D")


@dataclass
class Sample:
    """One question: ``fields`` as read; ``gold`` the reference answer as the scorer compares it."""
    subject: str
    index: int
    fields: dict
    gold: str
    shots: List[dict] = field(default_factory=list)


def subject_of(filename: str) -> str:
    return re.sub(r"(?:_test|_val|_dev)?\.\w+$", "", filename)


def _files(folder: str, ext: str) -> List[str]:
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"--task-data-path {folder}: no such folder")
    names = sorted(n for n in os.listdir(folder) if n.endswith(ext))
    if not names:
        raise FileNotFoundError(f"--task-data-path {folder}: no *{ext} file")
    return [os.path.join(folder, n) for n in names]


def _mc_row(path: str, line: int, row: dict) -> dict:
    missing = [k for k in ("question", *CHOICES, "answer") if k not in row or row[k] is None]
    if missing:
        raise ValueError(f"{path}:{line}: missing column(s) {', '.join(missing)}")
    answer = str(row["answer"]).strip()
    if answer not in CHOICES:
        raise ValueError(f"{path}:{line}: answer {answer!r} is not one of A, B, C, D")
    return {"question": str(row["question"]), **{c: str(row[c]) for c in CHOICES},
            "answer": answer}


def read_mc_csv(path: str, header: bool) -> List[dict]:
    """An MMLU (``header`` False: question, A-D, answer) or C-Eval (``header`` True) CSV."""
    with open(path, encoding="utf-8", newline="") as f:
        if header:
            reader = csv.DictReader(f)
            return [_mc_row(path, i + 2, r) for i, r in enumerate(reader)]
        rows = []
        for i, r in enumerate(csv.reader(f)):
            if len(r) != 6:
                raise ValueError(f"{path}:{i + 1}: {len(r)} columns, MMLU rows have 6 "
                                 f"(question, A, B, C, D, answer)")
            rows.append(_mc_row(path, i + 1, dict(zip(("question", *CHOICES, "answer"), r))))
        return rows


def read_jsonl(path: str, required=()) -> List[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{i + 1}: not JSON ({e})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{i + 1}: a JSON object per line is expected")
            missing = [k for k in required if k not in row]
            if missing:
                raise ValueError(f"{path}:{i + 1}: missing key(s) {', '.join(missing)}")
            rows.append(row)
    return rows


def _dev_rows(folder: str, subject: str, header: bool, num_fewshot: Optional[int]) -> List[dict]:
    dev = os.path.join(os.path.dirname(os.path.normpath(folder)), "dev", f"{subject}_dev.csv")
    if num_fewshot == 0 or (num_fewshot is None and not os.path.isfile(dev)):
        return []
    if not os.path.isfile(dev):
        raise FileNotFoundError(f"{dev}: few-shot examples for {subject} (--num-fewshot "
                                f"{num_fewshot}) not found; pass --num-fewshot 0")
    return read_mc_csv(dev, header)[:5 if num_fewshot is None else num_fewshot]


def load_multiple_choice(folder: str, header: bool, num_fewshot: Optional[int]
                         ) -> Dict[str, List[Sample]]:
    """MMLU (``header`` False) or C-Eval (True) test files with their dev shots (the first
    ``num_fewshot`` rows of ``../dev/{subject}_dev.csv``; default 5 when that file exists)."""
    out = {}
    for path in _files(folder, ".csv"):
        subject = subject_of(os.path.basename(path))
        shots = _dev_rows(folder, subject, header, num_fewshot)
        out[subject] = [Sample(subject, i, r, r["answer"], shots)
                        for i, r in enumerate(read_mc_csv(path, header))]
    return out


def load_boolq(folder: str) -> Dict[str, List[Sample]]:
    out = {}
    for path in _files(folder, ".jsonl"):
        rows = read_jsonl(path, ("question", "passage", "answer"))
        out[subject_of(os.path.basename(path))] = [
            Sample("", i, r, "T" if _bool(path, i, r["answer"]) else "F")
            for i, r in enumerate(rows)]
    for subject, samples in out.items():
        for s in samples:
            s.subject = subject
    return out


def _bool(path: str, i: int, value) -> bool:
    if isinstance(value, bool):
        return value
    if str(value).strip().lower() in ("true", "yes", "t", "y", "1"):
        return True
    if str(value).strip().lower() in ("false", "no", "f", "n", "0"):
        return False
    raise ValueError(f"{path}:{i + 1}: answer {value!r} is not true/false")


def gsm8k_gold(answer: str) -> str:
    """The final number of a GSM8K answer (after ``####``), commas removed."""
    return answer.split("####")[-1].strip().replace(",", "")


def load_gsm8k(folder: str, num_fewshot: Optional[int]) -> Dict[str, List[Sample]]:
    """Scored files and the few-shot pool (files named ``*train*``: their first
    ``num_fewshot`` rows, default 4 as in MindSpeed's chain-of-thought prompt)."""
    paths = _files(folder, ".jsonl")
    pool = [r for p in paths if "train" in os.path.basename(p)
            for r in read_jsonl(p, ("question", "answer"))]
    k = 4 if num_fewshot is None else num_fewshot
    if k > len(pool) and num_fewshot is not None:
        raise ValueError(f"--num-fewshot {k}: {folder} has {len(pool)} few-shot rows (files "
                         f"named *train*.jsonl)")
    shots = pool[:k]
    out = {}
    for path in paths:
        if "train" in os.path.basename(path):
            continue
        subject = subject_of(os.path.basename(path))
        rows = read_jsonl(path, ("question", "answer"))
        out[subject] = [Sample(subject, i, r, gsm8k_gold(r["answer"]), shots)
                        for i, r in enumerate(rows)]
    if not out:
        raise FileNotFoundError(f"--task-data-path {folder}: no *.jsonl file to score (files "
                                f"named *train* are the few-shot pool)")
    return out


def load_human_eval(folder: str) -> Dict[str, List[Sample]]:
    out = {}
    for path in _files(folder, ".jsonl"):
        subject = subject_of(os.path.basename(path))
        rows = read_jsonl(path, ("task_id", "prompt", "test", "entry_point"))
        out[subject] = [Sample(subject, i, r, "passed") for i, r in enumerate(rows)]
    return out
