"""Turn cells into runs and runs into jobs (one process, or one msrun launch per family and
worker count), in three phases:

1. one process per family: every cell's single-process reference (criterion (a)), the LoRA base
   (a plain run exported to Hugging Face), and the ``single`` cell's interrupted/resumed runs;
2. one msrun launch per family (and worker count): each parallel cell's uninterrupted run, the
   run interrupted after half the steps (its checkpoint copied aside), and its resumption;
3. one process per family: each parallel checkpoint resumed in one process (resume at another
   layout), its trained model's logits, its HF export, and that export reloaded.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from .matrix import CONFIGS, STEPS, Cell, Feature


@dataclass
class Job:
    name: str
    nproc: int
    runs: List[dict] = field(default_factory=list)


@dataclass
class CellRuns:
    """Names of the runs (in the jobs' results) a cell's criteria read."""
    ref: str
    run: str
    part: Optional[str] = None
    resume: Optional[str] = None
    other: Optional[str] = None       # resumed at another layout (one process)
    trained: Optional[str] = None     # the run whose in-memory logits (b) compares
    reload: Optional[str] = None
    hf_dir: Optional[str] = None
    probe: Optional[str] = None
    reload_probe: Optional[str] = None


def _strip(args: List[str], prefixes) -> List[str]:
    out, i = [], 0
    while i < len(args):
        if any(args[i].startswith(p) for p in prefixes):
            i += 2
            continue
        out.append(args[i])
        i += 1
    return out


class Planner:
    def __init__(self, work: str, data: Dict[str, List[str]], break_cells=(),
                 steps: int = STEPS):
        self.work, self.data, self.break_cells = work, data, set(break_cells)
        self.steps, self.resume_at = steps, steps // 2
        self.jobs: Dict[str, Job] = {}
        self.cells: Dict[str, CellRuns] = {}
        self.refs: Dict[tuple, str] = {}     # one reference run per distinct configuration
        self.base_from: Optional[str] = None

    def _job(self, phase: int, family: str, nproc: int) -> Job:
        name = f"p{phase}_{family}" + (f"_n{nproc}" if nproc > 1 else "")
        if name not in self.jobs:
            self.jobs[name] = Job(name, nproc)
        return self.jobs[name]

    def _dir(self, *parts: str) -> str:
        return os.path.join(self.work, *parts)

    def base_hf(self, family) -> str:
        """The LoRA base of ``family``: a plain 6-step run exported to HF (planned once), or
        the one an earlier run's scratch folder holds (``base_from``: ``--fault-only``)."""
        if self.base_from:
            return os.path.join(self.base_from, "base", family.name, "hf")
        hf = self._dir("base", family.name, "hf")
        job = self._job(1, family.name, 1)
        if not any(r["name"] == f"{family.name}.base" for r in job.runs):
            ck = self._dir("base", family.name, "ckpt")
            job.runs.insert(0, dict(name=f"{family.name}.base", config=self.config(family),
                                    args=[*self.family_args(family, None), "--training.output_dir",
                                          self._dir("base", family.name, "out"),
                                          "--checkpoint.save_dir", ck],
                                    export_hf=hf))
        return hf

    @staticmethod
    def config(family) -> str:
        return os.path.join(CONFIGS, family.config)

    def family_args(self, family, feature: Optional[Feature]) -> List[str]:
        from .matrix import COMMON
        needs = feature.needs if feature else ()
        data = self.data["pairs"] if "pairs" in needs else self.data["corpus"]
        # the interrupted runs stop early on the same LR schedule (lr_decay_steps = steps)
        return [*family.args, *COMMON, *data, "--training.max_steps", str(self.steps),
                "--training.lr_decay_steps", str(self.steps)]

    def single_args(self, cell: Cell) -> List[str]:
        args = self.family_args(cell.family, cell.feature) + list(cell.feature.model)
        if cell.family.moe:
            args += list(cell.feature.moe_model)
        if "base" in cell.feature.needs:
            args += ["--checkpoint.load", self.base_hf(cell.family)]
        return args

    def add(self, cell: Cell) -> CellRuns:
        f, x, s = cell.family, cell.feature, cell.slug
        single = self.single_args(cell)
        layout = single + list(cell.layout)
        if cell.key in self.break_cells:      # test-only: a cell whose layout run differs
            layout += ["--training.seed", "4321"]

        def run(name, args, **kw):
            return dict(name=f"{s}.{name}", config=self.config(f),
                        args=[*args, "--training.output_dir", self._dir("runs", s, name)], **kw)

        ck = self._dir("ckpt", s)
        hf = self._dir("hf", s)
        probe, reload_probe = self._dir("runs", s, "probe.npy"), self._dir("runs", s,
                                                                           "reload_probe.npy")
        os.makedirs(self._dir("runs", s), exist_ok=True)
        reload_args = _strip(single, ("--lora.", "--checkpoint.load")) + [
            "--checkpoint.load", hf]
        partial = ["--training.max_steps", str(self.resume_at)]
        p1 = self._job(1, f.name, 1)
        ref = self.refs.get(tuple(single))
        if ref is None:     # dp, tp+sp, pipeline, ... of a family share one reference
            ref = self.refs[tuple(single)] = f"{s}.ref"
            p1.runs.append(run("ref", single))
        names = CellRuns(ref=ref, run=ref, hf_dir=hf, probe=probe,
                         reload_probe=reload_probe, part=f"{s}.part", resume=f"{s}.resume",
                         reload=f"{s}.reload")
        if x.nproc == 1:
            p1.runs.append(run("part", single + partial + ["--checkpoint.save_dir", ck]))
            p1.runs.append(run("resume", single + ["--checkpoint.save_dir", ck,
                                                   "--training.resume", "auto"],
                               probe=probe, export_hf=hf))
            p1.runs.append(run("reload", reload_args, no_fit=True, probe=reload_probe))
            names.trained = names.resume
            if cell.key in self.break_cells:
                names.run = f"{s}.broken"
                p1.runs.append(run("broken", layout))
        else:
            p2 = self._job(2, f.name, x.nproc)
            names.run = f"{s}.run"
            p2.runs.append(run("run", layout))
            p2.runs.append(run("part", layout + partial + ["--checkpoint.save_dir", ck],
                               copy_ckpt=[ck, ck + "_other"]))
            p2.runs.append(run("resume", layout + ["--checkpoint.save_dir", ck,
                                                   "--training.resume", "auto"]))
            p3 = self._job(3, f.name, 1)
            names.other = names.trained = f"{s}.other"
            p3.runs.append(run("other", single + ["--checkpoint.save_dir", ck + "_other",
                                                  "--training.resume", "auto"],
                               probe=probe, export_hf=hf))
            p3.runs.append(run("reload", reload_args, no_fit=True, probe=reload_probe))
        self.cells[cell.key] = names
        return names

    def ordered_jobs(self) -> List[Job]:
        return sorted(self.jobs.values(), key=lambda j: (j.name[:2], j.name))
