"""``ms-llm plot <output_dir>``: the loss curve of a run as a PNG."""
from __future__ import annotations

import json
import os


def read_metrics(output_dir: str) -> list:
    path = os.path.join(output_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no metrics (has the run logged a step?)")
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    raise ValueError(f"{path}:{lineno}: not a JSON object") from None
    return rows


def plot_loss(output_dir: str, out_path: str = None) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in read_metrics(output_dir) if "loss" in r]   # not the eval_* rows
    out_path = out_path or os.path.join(output_dir, "loss.png")
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], lw=1.5, color="#1f77b4")
    ax.set_xlabel("step")
    ax.set_ylabel("lm loss")
    ax.set_title(f"loss: {os.path.basename(os.path.abspath(output_dir))}")
    ax.grid(alpha=0.3)
    ax2 = ax.twinx()
    ax2.plot([r["step"] for r in rows], [r["lr"] for r in rows], lw=1, color="#ff7f0e", alpha=0.6)
    ax2.set_ylabel("learning rate", color="#ff7f0e")
    fig.tight_layout()
    tmp = out_path + ".tmp.png"
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, out_path)
    return out_path
