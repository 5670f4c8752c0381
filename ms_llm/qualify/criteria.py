"""The published criteria (docs/qualification.md), evaluated on a cell's run records.

Every check returns ``Check(state, detail)`` with state ``ok`` (met), ``fail`` (measured and
wrong: the numbers disagree, or the job crashed) or ``unmet`` (could not be checked: refused by
the configuration, or not built); the cell is Pass when all of (a)-(d) are ok, Fail when the run
or any check fails, else Test when its run trains."""
from __future__ import annotations

import dataclasses
import math
import os
import re
import shutil
from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np

from .matrix import Cell, Tolerance


@dataclass
class Check:
    state: str            # ok | fail | unmet
    detail: str

    def to_dict(self) -> dict:
        return {"state": self.state, "detail": self.detail}


def _curve_diff(got: List[float], want: List[float], rtol: float) -> Optional[str]:
    if len(got) != len(want):
        return f"{len(got)} steps, expected {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        if not abs(g - w) <= rtol * abs(w):
            return f"step {i + 1} rel {abs(g - w) / max(abs(w), 1e-30):.1e} > {rtol:g} " \
                   f"({g!r} vs {w!r})"
    return None


def compare(run: dict, ref: dict, tol: Tolerance, first_step: int = 1) -> Optional[str]:
    """None when ``run`` (steps ``first_step``..) matches ``ref``'s same steps within ``tol``;
    else why not."""
    for key in ("loss", "grad_norm"):
        want = ref[key][first_step - 1:first_step - 1 + len(run[key])] if run[key] else ref[key]
        rtol = tol.norm_rtol if key == "grad_norm" and tol.norm_rtol else tol.rtol
        strict = max(0, tol.strict_steps - (first_step - 1))
        why = _curve_diff(run[key][:strict], want[:strict], tol.strict) if strict else None
        why = why or _curve_diff(run[key], want, rtol)
        if why:
            return f"{key} {why}"
    if len(run["loss"]) == 0:
        return "no steps recorded"
    return None


def trains(rec: dict, steps: int) -> Check:
    """Test: the job ran ``steps`` steps with finite, falling loss."""
    if rec["error"]:
        return Check("unmet" if rec["refused"] else "fail", rec["error"])
    loss = rec["loss"]
    if len(loss) != steps:
        return Check("fail", f"{len(loss)} of {steps} steps logged")
    if not all(math.isfinite(x) for x in loss + rec["grad_norm"]):
        return Check("fail", f"non-finite loss or grad norm: {loss}")
    if not loss[-1] < loss[0]:
        return Check("fail", f"loss did not fall: {loss[0]:.4f} -> {loss[-1]:.4f}")
    return Check("ok", f"{steps} steps, loss {loss[0]:.4f} -> {loss[-1]:.4f}")


def _err(rec: dict, what: str) -> Check:
    return Check("unmet" if rec["refused"] else "fail", f"{what}: {rec['error']}")


def parity(cell: Cell, recs: Dict[str, dict], names) -> Check:
    """(a) loss and grad norm equal the single-process reference."""
    if names.run == names.ref:
        return Check("ok", "the one-process reference itself")
    ref, run = recs[names.ref], recs[names.run]
    if ref["error"]:
        return _err(ref, "one-process reference")
    tol = cell.feature.tol(cell.family)
    why = compare(run, ref, tol)
    if why:
        return Check("fail", f"vs one process: {why}; tolerance {tol.describe()}")
    return Check("ok", f"{len(run['loss'])} steps equal one process within {tol.describe()}")


def resume(cell: Cell, recs: Dict[str, dict], names, at: int, steps: int) -> Check:
    """(c) interrupted after step ``at`` and resumed (same layout, and one process for a parallel
    cell) reproduces the uninterrupted curve."""
    run, tol = recs[names.run], cell.feature.tol(cell.family)
    for key, first, what in ((names.part, 1, "interrupted run"),
                             (names.resume, at + 1, "resumed at the same layout"),
                             (names.other, at + 1, "resumed in one process")):
        if key is None:
            continue
        rec = recs[key]
        if rec["error"]:
            if key == names.other and rec["refused"]:
                return Check("unmet", f"resume at other layout refused: {rec['error']}")
            return _err(rec, what)
        why = compare(rec, run, tol, first)
        if why:
            return Check("fail", f"{what}: {why}; tolerance {tol.describe()}")
    done = "same layout" + (" and in one process" if names.other else "")
    return Check("ok", f"stopped after step {at}, resumed at the {done}: steps "
                       f"{at + 1}-{steps} equal the uninterrupted run within "
                       f"{tol.describe()}")


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and \
        np.ascontiguousarray(a).view(np.uint8).tobytes() == \
        np.ascontiguousarray(b).view(np.uint8).tobytes()


def round_trip(cell: Cell, recs: Dict[str, dict], names, work: str) -> Check:
    """(b) save -> export HF -> reload gives the trained model's logits; HF -> Megatron -> HF is
    bit-exact."""
    for key, what in ((names.trained, "trained run"), (names.reload, "HF reload")):
        if recs[key]["error"]:
            return _err(recs[key], what)
    if not (os.path.isfile(names.probe) and os.path.isfile(names.reload_probe)):
        return Check("fail", "probe logits were not written")
    a, b = np.load(names.probe), np.load(names.reload_probe)
    tol = cell.feature.tol(cell.family).logits_rtol
    scale = float(np.abs(a).max())
    diff = float(np.abs(a - b).max()) if a.shape == b.shape else math.inf
    if not diff <= tol * scale:
        return Check("fail", f"reloaded HF export's logits differ: max |dL| {diff:.3e} > "
                             f"{tol:g} x max |L| {scale:.3e}")
    mg, back = names.hf_dir + "_mg", names.hf_dir + "_back"
    for d in (mg, back):
        shutil.rmtree(d, ignore_errors=True)
    lay = dict(zip(cell.layout[::2], cell.layout[1::2]))
    from .matrix import EP, PP, TP
    target = ["--target-tensor-parallel-size", lay.get(TP, "1"),
              "--target-pipeline-parallel-size", lay.get(PP, "1"),
              "--target-expert-parallel-size", lay.get(EP, "1")]
    if "--parallel.num_layer_list" in lay:      # the trained uneven split, as MindSpeed's flag
        target += ["--num-layer-list", lay["--parallel.num_layer_list"]]
    from ms_llm.checkpoint.convert import main as convert
    import contextlib
    import io
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        rc = convert(["--load-model-type", "hf", "--save-model-type", "mg", "--load-dir",
                      names.hf_dir, "--save-dir", mg, "--model-type-hf", cell.family.hf_type,
                      *target])
        rc = rc or convert(["--load-model-type", "mg", "--save-model-type", "hf", "--load-dir",
                            mg, "--save-dir", back, "--hf-cfg-dir", names.hf_dir])
    if rc:
        return Check("fail", f"ms-llm convert exited {rc}: {buf.getvalue().strip()[-300:]}")
    from ms_llm.checkpoint.hf.io import read_hf_weights
    w0, w1 = read_hf_weights(names.hf_dir), read_hf_weights(back)
    if set(w0) != set(w1):
        return Check("fail", f"HF -> Megatron -> HF changed the tensor names: "
                             f"{sorted(set(w0) ^ set(w1))[:4]}")
    bad = [k for k in w0 if not _same_bits(w0[k], w1[k])]
    if bad:
        return Check("fail", f"HF -> Megatron ({' '.join(target[1::2])}) -> HF not bit-exact: "
                             f"{bad[:3]}")
    return Check("ok", f"HF export reloaded: max |dL| {diff:.1e} (<= {tol:g} x {scale:.2f}); "
                       f"HF -> Megatron (tp/pp/ep {'/'.join(target[1::2])}) -> HF bit-exact "
                       f"({len(w0)} tensors)")


def restart_built() -> Optional[str]:
    """None when automatic restart and the fault hook exist; else what is missing."""
    from ms_llm.config import TrainingConfig
    from .matrix import ROOT
    if "max_restarts" not in {f.name for f in dataclasses.fields(TrainingConfig)}:
        return "not built (training.max_restarts is not in the config schema)"
    with open(os.path.join(ROOT, "scripts", "pretrain.sh"), encoding="utf-8") as f:
        if "MAX_RESTARTS" not in f.read():
            return "not built (scripts/pretrain.sh has no MAX_RESTARTS)"
    return None


def short(letter: str, chk: Check) -> str:
    d = re.sub(r"\S*/\S*", "...", chk.detail)      # no paths in the table
    if d.startswith("not built"):
        d = "not built"
    return f"{letter}: {d if len(d) <= 90 else d[:87] + '...'}"


def verdict(test: Check, checks: Dict[str, Check]) -> tuple:
    """A cell's status and its unmet / failed criteria, one short line each."""
    if test.state == "unmet":
        return "not built", [f"refused: {re.sub(r'^config error: ', '', test.detail)[:90]}"]
    if test.state == "fail":
        return "Fail", [f"runs: {re.sub(r'[^ ]*/[^ ]*', '...', test.detail)[:90]}"]
    fails = [short(k, c) for k, c in checks.items() if c.state == "fail"]
    if fails:
        return "Fail", fails
    unmet = [short(k, c) for k, c in checks.items() if c.state != "ok"]
    return ("Test", unmet) if unmet else ("Pass", [])
