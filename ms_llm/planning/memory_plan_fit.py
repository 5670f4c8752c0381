"""``ms-llm plan``'s table and the search for the cheapest change that makes a layout fit
(``memory_plan`` does the accounting; the command line is ``ms_llm.cli.plan``)."""
from __future__ import annotations

from typing import List, Optional, Tuple

from .memory_plan import GB, MemoryPlan, planned_model_config, plan_memory


def plan_with_fix(cfg, nproc: int, device_memory_gb: Optional[float] = None,
                  distributed_optimizer: Optional[bool] = None) -> MemoryPlan:
    """``plan_memory`` and, when the plan does not fit ``device_memory_gb``, the cheapest change
    that does (``plan.suggestion``)."""
    c = planned_model_config(cfg)
    from ms_llm.parallel.plan_shapes import full_shapes   # imports MindSpore: not for --help
    from ms_llm.parallel.plan_experts import fold_experts, unfold_shapes
    built, fold = fold_experts(c, cfg.parallel.expert_model_parallel_size)
    shapes, cache = unfold_shapes(full_shapes(built, cfg.parallel.noop_layers), fold), {}
    plan = plan_memory(cfg, nproc, device_memory_gb, distributed_optimizer, c, shapes, cache)
    if plan.fits is False:
        distopt = plan.layout["distributed_optimizer"]
        plan.suggestion = suggest_fix(cfg, nproc, device_memory_gb, distopt, c, shapes, cache)
    return plan


# --------------------------------------------------------------------------- suggestions
def _candidates(cfg, nproc: int, distopt: bool) -> List[Tuple[str, dict, bool]]:
    """(description, config changes, distributed optimizer) in order of cost: recompute first
    (compute only), then the distributed optimizer (a reduce-scatter + all-gather instead of an
    all-reduce), FSDP (gathers every step), larger tensor parallel (more communication per
    layer), larger pipeline parallel (bubble)."""
    t, p = cfg.training, cfg.parallel
    out = []
    fsdp_on = p.fsdp_size > 1
    if t.recompute_granularity is None:
        out.append(("selective recompute", {"training.recompute_granularity": "selective"},
                    distopt))
    if t.recompute_granularity != "full":
        out.append(("full recompute", {"training.recompute_granularity": "full",
                                       "training.recompute_method": "uniform"}, distopt))
    base_rc = {"training.recompute_granularity": "full", "training.recompute_method": "uniform"}
    tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, \
        p.context_parallel_size
    dp = nproc // (tp * pp * cp)
    replicas = dp * cp     # the dp-cp group the distributed optimizer and FSDP cut over
    if not distopt and replicas > 1 and not fsdp_on:
        out.append(("distributed optimizer", {}, True))
        out.append(("distributed optimizer + full recompute", dict(base_rc), True))
    if not fsdp_on and replicas > 1:
        out.append(("FSDP over the data-parallel group", {"parallel.fsdp_size": replicas},
                    False))
        out.append(("FSDP over the data-parallel group + full recompute",
                    {"parallel.fsdp_size": replicas, **base_rc}, False))
    for new_tp in (2 * tp, 4 * tp, 8 * tp):
        if nproc % (new_tp * pp * cp) == 0 and new_tp <= 8:
            out.append((f"tensor parallel {new_tp} (+ sequence parallel, full recompute)",
                        {"parallel.tensor_model_parallel_size": new_tp,
                         "parallel.sequence_parallel": True, **base_rc}, distopt))
    for new_pp in (2 * pp, 4 * pp, 8 * pp):
        if nproc % (tp * new_pp * cp) == 0:
            out.append((f"pipeline parallel {new_pp} (+ full recompute)",
                        {"parallel.pipeline_model_parallel_size": new_pp, **base_rc}, distopt))
    return out


def _apply(cfg, changes: dict):
    return cfg.with_values(changes)


def suggest_fix(cfg, nproc: int, device_memory_gb: float, distopt: bool, c, shapes,
                cache: Optional[dict] = None) -> Optional[dict]:
    """The first (cheapest) candidate change whose predicted peak fits; None when none does."""
    tried = []
    for what, changes, dopt in _candidates(cfg, nproc, distopt):
        new = _apply(cfg, changes)
        try:
            plan = plan_memory(new, nproc, device_memory_gb, dopt, c, _shapes=shapes,
                               _cache=cache)
        except ValueError as e:
            tried.append(f"{what}: {e}")
            continue
        if plan.fits:
            shown = dict(changes)
            if dopt and not distopt:
                shown["parallel.use_distributed_optimizer"] = True
                if "distributed optimizer" not in what:
                    what += " + distributed optimizer"
            return {"what": what, "change": shown, "peak_gb": round(plan.peak_gb, 3),
                    "layout": plan.layout}
        tried.append(f"{what}: {plan.peak_gb:.1f} GB")
    return {"what": None, "change": {}, "peak_gb": None, "tried": tried}


# --------------------------------------------------------------------------- output
def _gb(x: int) -> str:
    return f"{x / GB:.2f}"


def format_plan(plan: MemoryPlan, source: str) -> str:
    lay = plan.layout
    rc = lay["recompute"] or "none"
    if lay["recompute"] and lay["recompute_method"] == "block":
        rc += f" (block, first {lay['recompute_num_layers']} layers)"
    if lay["recompute_norm"]:
        rc += " + norm"
    lines = [f"ms-llm plan: {source} on {plan.nproc} worker(s), "
             f"{plan.total_params / 1e9:.3f} B parameters" if plan.total_params >= 1e9 else
             f"ms-llm plan: {source} on {plan.nproc} worker(s), "
             f"{plan.total_params / 1e6:.2f} M parameters",
             f"layout: tp {lay['tp']}{' + sp' if lay['sp'] else ''}, pp {lay['pp']}"
             f"{' x vpp ' + str(lay['vpp']) if lay['vpp'] > 1 else ''}"
             f"{', cp ' + str(lay['cp']) + ' (' + lay['cp_algo'] + ')' if lay['cp'] > 1 else ''}"
             f", ep {lay['ep']}, dp {lay['dp']}{', FSDP' if lay['fsdp'] > 1 else ''}"
             f"{', distributed optimizer' if lay['distributed_optimizer'] else ''}; "
             f"micro-batch {lay['micro_batch']} x seq {lay['seq']}, "
             f"{lay['micro_batches_per_step']} micro-batch(es)/step; recompute {rc}",
             "",
             "| rank (stage) | params | grads | optimizer | activations | comm buffers | "
             "fixed | peak GB |",
             "|---|---|---|---|---|---|---|---|"]
    for i, s in enumerate(plan.stages):
        lines.append(f"| {s.rank} ({i}) | {_gb(s.params)} | {_gb(s.grads)} | {_gb(s.optimizer)} "
                     f"| {_gb(s.activations)} | {_gb(s.comm)} | {_gb(s.fixed)} | {_gb(s.peak)} |")
    lines.append("")
    verdict = f"predicted peak per rank: {plan.peak_gb:.2f} GB"
    if plan.device_memory_gb is not None:
        verdict += (f" of {plan.device_memory_gb:g} GB: "
                    f"{'fits' if plan.fits else 'does NOT fit'}")
    lines.append(verdict)
    sug = plan.suggestion
    if sug is not None:
        if sug["what"] is None:
            lines.append("no single change tried fits: " + "; ".join(sug["tried"]))
        else:
            flags = " ".join(f"--{k} {_flag(v)}" for k, v in sug["change"].items())
            lines.append(f"cheapest change that fits: {sug['what']}: {flags} -> predicted peak "
                         f"{sug['peak_gb']:.2f} GB")
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def _flag(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    return str(v)
