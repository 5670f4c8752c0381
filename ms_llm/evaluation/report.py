"""Per-subject and total accuracy of a task's records, as a table and as JSON."""
from __future__ import annotations

from typing import Dict, List


def summarize(records: List[dict]) -> Dict[str, object]:
    """``{"subjects": {name: {n, correct, acc}}, "total": {n, correct, acc}}``; the total is
    over questions (MindSpeed's ``total_acc_n / total_n``), not a mean of subject accuracies."""
    subjects: Dict[str, Dict[str, float]] = {}
    for r in records:
        s = subjects.setdefault(r["subject"], {"n": 0, "correct": 0})
        s["n"] += 1
        s["correct"] += int(bool(r["correct"]))
    for s in subjects.values():
        s["acc"] = s["correct"] / s["n"]
    n = sum(s["n"] for s in subjects.values())
    correct = sum(s["correct"] for s in subjects.values())
    return {"subjects": dict(sorted(subjects.items())),
            "total": {"n": n, "correct": correct, "acc": correct / n if n else 0.0}}


def table(task: str, summary: Dict[str, object]) -> str:
    metric = "pass@1" if task == "human_eval" else "acc"
    rows = [(name, s["n"], s["correct"], s["acc"]) for name, s in summary["subjects"].items()]
    t = summary["total"]
    rows.append(("total", t["n"], t["correct"], t["acc"]))
    width = max(len("subject"), *(len(r[0]) for r in rows))
    lines = [f"{task}", f"{'subject':<{width}}  {'n':>6}  {'correct':>7}  {metric:>7}"]
    lines += [f"{name:<{width}}  {n:>6}  {c:>7}  {acc:>7.4f}" for name, n, c, acc in rows]
    return "\n".join(lines)
