"""The qualification matrix: model families (rows' columns), features/layouts, and the tolerances
each feature is held to. Data only; ``plan.py`` turns a cell into runs.

Tolerances (criterion (a), parallel vs one process; (c), resumed vs uninterrupted) are the ones
the test suite justifies for the same layouts:

* fp32 layouts (dp, tp+sp, fsdp, ep, MegaMoE, pipeline, context parallel, LoRA, DPO): rtol 1e-5
  on loss and grad norm. The ranks sum the same fp32 terms in another order (all-reduce, sharded
  matmuls, reduce-scatter), ~1e-7 relative per step, which Adam's normalised update amplifies a
  little over a few steps (tests/parallel/test_parallel_training.py, test_fsdp.py, test_lora_parallel.py,
  test_dpo_parallel.py, test_pipeline_training.py, test_deepseek_parallel.py).
* context parallel on MoE models: grad norm rtol 3e-5 (tests/parallel/test_context_parallel_training.py:
  the router's per-rank token sums reorder more terms).
* Muon (dp 2) and lane resume (torch_dist saves, dp 2): rtol 1e-5, as fp32 layouts
  (tests/optim/test_muon_parallel.py, test_torch_dist_resume.py).
* MXFP8 (tp=2): step 1 (before any update) at rtol 1e-5, all steps at 2e-3: a summation-order difference
  can flip one element's FP8 rounding (one E4M3 step is 6 % of that element), which moves loss and
  grad norm once Adam has moved the weights (measured: 1.7e-5 / 3.3e-4 at step 5;
  tests/parallel/test_parallel_training.py).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(ROOT, "configs")

STEPS = 6       # AdamW steps per run (``--steps``); resumed runs are interrupted after STEPS // 2

# Shared tiny shapes: PyNative (a jit compile costs 30-50 s here), micro-batch 2 everywhere so
# the 1- and 2-worker runs see the same micro-batches (MoE aux losses are per micro-batch).
COMMON = ["--training.log_interval", "1", "--training.progress_bar", "false",
          "--training.lr_warmup_steps", "2", "--training.jit", "false",
          "--training.micro_batch_size", "2", "--training.global_batch_size", "4",
          "--data.seq_length", "32", "--parallel.collective_timeout_s", "180"]


@dataclass(frozen=True)
class Family:
    name: str
    config: str
    args: Tuple[str, ...]
    moe: bool
    hf_type: str          # ms-llm convert --model-type-hf
    num_layer_list: Optional[str] = None   # the pipeline cell's uneven split (FamilySpec.qualify)
    quick: bool = False                    # in the quick suite


def _families() -> Dict[str, Family]:
    """The registry's families that say how to qualify them (``FamilySpec.qualify``)."""
    from ms_llm.models.registry import families
    return {s.qualify.name: Family(s.qualify.name, s.qualify.config, s.qualify.args, s.is_moe,
                                   s.convert_name, s.qualify.num_layer_list, s.qualify.quick)
            for s in families() if s.qualify is not None}


FAMILIES: Dict[str, Family] = _families()


@dataclass(frozen=True)
class Tolerance:
    """(a)/(c): rtol on loss and grad norm; ``strict_steps`` steps first at ``strict``."""
    rtol: float = 1e-5
    norm_rtol: Optional[float] = None      # default: rtol
    strict_steps: int = 0
    strict: float = 1e-5
    logits_rtol: float = 1e-5              # (b): max |dL| <= logits_rtol * max |L|
    why: str = "fp32: the ranks sum the same terms in another order"

    def describe(self) -> str:
        s = f"rtol {self.rtol:g}"
        if self.norm_rtol is not None:
            s += f" (grad norm {self.norm_rtol:g})"
        if self.strict_steps:
            first = "step 1" if self.strict_steps == 1 else f"steps 1-{self.strict_steps}"
            s = f"{first} rtol {self.strict:g}, all steps {s}"
        return s


FP32 = Tolerance()


@dataclass(frozen=True)
class Feature:
    name: str
    nproc: int
    layout: Tuple[str, ...] = ()            # parallel keys: dropped for the 1-process runs
    model: Tuple[str, ...] = ()             # feature keys: kept in the reference too
    moe_only: bool = False
    moe_model: Tuple[str, ...] = ()         # feature keys for MoE families only
    needs: Tuple[str, ...] = ()             # data the feature needs: "pairs" (DPO), "base" (LoRA)
    tolerance: Tolerance = FP32
    moe_tolerance: Optional[Tolerance] = None
    notes: str = ""
    moe_layout: Optional[Tuple[str, ...]] = None   # MoE families: e.g. ep where tp is refused
    # pipeline stages: a family whose layers do not split evenly adds its --num-layer-list
    split_layers: bool = False

    def tol(self, family: Family) -> Tolerance:
        return self.moe_tolerance if family.moe and self.moe_tolerance else self.tolerance


TP, EP, PP, CP, FSDP = ("--parallel.tensor_model_parallel_size", "--parallel.expert_model_parallel_size",
                        "--parallel.pipeline_model_parallel_size",
                        "--parallel.context_parallel_size", "--parallel.fsdp_size")
FEATURES: Dict[str, Feature] = {f.name: f for f in [
    Feature("single", 1, notes="the one-process reference itself"),
    Feature("dp", 2),
    Feature("tp+sp", 2, (TP, "2", "--parallel.sequence_parallel", "true")),
    # a 35-row vocabulary (make_vocab_size_divisible_by 1) and untied output layer: the
    # embedding and output rows split 18 / 17 over the two ranks
    Feature("fsdp-uneven", 2, (FSDP, "2"),
            ("--data.make_vocab_size_divisible_by", "1",
             "--model.untie_embeddings_and_output_weights", "true")),
    Feature("ep", 2, (EP, "2"), moe_only=True),
    Feature("MegaMoE", 2, (EP, "2"), ("--moe.dispatcher", "megamoe"), moe_only=True),
    # step 1 precedes any update: only the summation order differs (1e-5); after it one
    # flipped FP8 rounding moves the later steps (tests/parallel/test_parallel_training.py, test_fsdp.py)
    # MoE families run MXFP8 and LoRA under expert parallel: tensor parallel with MoE is refused
    Feature("MXFP8", 2, (TP, "2"), ("--quant.recipe", "mxfp8"), moe_layout=(EP, "2"),
            tolerance=Tolerance(rtol=2e-3, strict_steps=1, strict=1e-5,
                                why="one FP8 rounding flip moves later steps (6 % of an "
                                    "element); see tests/parallel/test_parallel_training.py")),
    Feature("LoRA", 2, (TP, "2"), ("--lora.r", "4", "--lora.alpha", "8"), needs=("base",),
            moe_layout=(EP, "2"),
            tolerance=Tolerance(logits_rtol=1e-4, why="fp32; the merged export rounds "
                                "W + (alpha/r) B A once, the adapter forward twice")),
    Feature("DPO", 2, (), ("--training.stage", "dpo"), needs=("pairs",)),
    # the 3-layer rows (the DeepSeek proxy, the hybrid families' DeltaNet / attention /
    # DeltaNet) split 1 + 2 (their Qualify.num_layer_list): an even split is refused
    Feature("pipeline", 2, (PP, "2"), split_layers=True),
    # MoE: the aux losses stay on (the routers sum their counts over cp, docs/features/moe.md)
    Feature("context-parallel", 2, (CP, "2"),
            moe_tolerance=Tolerance(norm_rtol=3e-5, why="the routers' per-rank token sums "
                                    "reorder more terms (tests/test_context_parallel_training)")),
    # Muon at dp 2 (each matrix orthogonalised on its owner rank, the updates all-gathered):
    # Newton-Schulz is a smooth polynomial of the normalised momentum and carries the
    # gradients' summation-order rounding on unamplified (tests/optim/test_muon_parallel.py: dp, tp,
    # FSDP, ep at rtol 1e-5); the momentum goes through the checkpoint (tests/optim/test_muon.py)
    Feature("Muon", 2, (), ("--training.optimizer", "muon"),
            tolerance=Tolerance(why="fp32 Muon: Newton-Schulz carries the reordered sums' "
                                "rounding on unamplified (tests/optim/test_muon_parallel.py)")),
    # the PyTorch lane's training checkpoint: every save is Megatron-Core's torch_dist
    # (iter_*/ + tracker), and (c)/(d) resume from it (at dp 2 and in one process); its fp32
    # tensors are the trainer's own, so the resumed curve holds (a)'s tolerance
    # (tests/checkpoint/test_torch_dist_resume.py: rtol 1e-6)
    Feature("lane resume", 2, (), ("--checkpoint.format", "torch_dist")),
]}

SUITES: Dict[str, Tuple[List[str], List[str]]] = {
    # (families, features)
    "quick": ([f for f, fam in FAMILIES.items() if fam.quick], ["single", "dp", "tp+sp", "ep"]),
    "full": (list(FAMILIES), list(FEATURES)),
}


@dataclass(frozen=True)
class Cell:
    family: Family
    feature: Feature

    @property
    def key(self) -> str:
        return f"{self.family.name}:{self.feature.name}"

    @property
    def layout(self) -> Tuple[str, ...]:
        """The parallel keys this cell's parallel run adds to the one-process arguments."""
        f = self.feature
        if f.split_layers and self.family.num_layer_list:
            return (*f.layout, "--parallel.num_layer_list", self.family.num_layer_list)
        return f.moe_layout if self.family.moe and f.moe_layout is not None else f.layout

    @property
    def slug(self) -> str:
        return "".join(c if c.isalnum() or c in "-." else "_"
                       for c in f"{self.family.name}__{self.feature.name}")

    @property
    def applicable(self) -> bool:
        return self.family.moe or not self.feature.moe_only


def select(suite: str, cells: Optional[List[str]] = None) -> List[Cell]:
    """The suite's cells, or exactly ``cells`` ("family:feature") when given."""
    if cells:
        out = []
        for c in cells:
            fam, _, feat = c.partition(":")
            if fam not in FAMILIES or feat not in FEATURES:
                raise ValueError(f"--cells: unknown cell {c!r} (families: {sorted(FAMILIES)}; "
                                 f"features: {sorted(FEATURES)})")
            out.append(Cell(FAMILIES[fam], FEATURES[feat]))
        return out
    fams, feats = SUITES[suite]
    return [Cell(FAMILIES[a], FEATURES[b]) for a in fams for b in feats]
