"""``ms-llm plan`` on every published MindSpeed-LLM training script, at the world size its
launcher line starts (``tests/fixtures/mindspeed_world_sizes.json``), on shapes only.

Each script's flags become the YAML ``pretrain_gpt.py --print-config`` prints; ``ms-llm plan`` on
it either plans (exit 0) or reports a refusal in one line (exit 2): never a traceback. A plan is
checked against an independent count of the model's parameters from the script's flags
(``helpers.megatron_param_count``: Megatron-Core's modules, not ms-llm's code): the total exactly,
and the stages' first ranks together hold the dense part cut over tensor parallel plus the
routed experts cut over expert parallel (within 2 %: norms are replicated over tensor parallel;
a tied embedding, or multi-token prediction's, has a copy on the last stage). Planning allocates nothing model-sized: the
process's peak RSS grows less than ``RSS_BUDGET`` while planning a 671B model.

Notes: LoRA scripts are planned as full tunes (``--lora-r`` needs a real ``--load`` base
folder); a script whose tokenizer gives the vocabulary (llama2) is planned with
``--vocab-size 32000``, its tokenizer's size. Three scripts run by default; the rest are marked
slow (1-10 s each on 2 shared cores, the 671B ones ~30 s: the full-size shape-only model and
one small twin per pipeline stage are built, Python module construction dominating)."""
from __future__ import annotations

import io
import json
import time
from contextlib import redirect_stderr, redirect_stdout

import pytest

from helpers.megatron_param_count import megatron_parameter_count
from helpers.mindspeed_examples import load, world_sizes
from ms_llm.cli.plan import main as plan_main
from ms_llm.config import ConfigError
from ms_llm.mindspeed.flags import explain, to_yaml, translate

SCRIPTS = load()
WORLD = world_sizes()
LLAMA2_VOCAB = 32000
RSS_BUDGET_MB = 600
TIME_BUDGET_S = 120       # per script, 2 cores shared with other jobs
# plans the layout refuses (one line, exit 2), with the reason
PLAN_REFUSED = {
    # ep 16 over tp 1 x pp 8 x cp 2 = 128 ranks: ms-llm's experts span data-parallel ranks only
    # (dp 8), Megatron-Core's span dp x cp
    "deepseek3/tune_deepseek3_671b_16k_lora_A3_ptd.sh": "expert_model_parallel_size 16 must "
                                                        "divide the data-parallel size 8",
}
# in the default run: the script that stopped with a TypeError (a pipeline stage's grouped
# experts) and two dense ones; the rest are slow (1-10 s each, the 671B ones ~30 s)
FAST = {"qwen3_moe/pretrain_qwen3_30b_a3b_4K_ptd.sh", "qwen3/pretrain_qwen3_0point6b_4K_ptd.sh",
        "llama2/pretrain_llama2_13b_ptd.sh"}


def _marks(name):
    return [] if name in FAST else [pytest.mark.slow]


def _argv(name):
    argv = list(SCRIPTS[name]["argv"])
    if "--padded-vocab-size" not in argv and "--vocab-size" not in argv:
        argv += ["--vocab-size", str(LLAMA2_VOCAB)]
    return argv


def _peak_rss_reset() -> None:
    """Reset the process's peak RSS (VmHWM), Linux >= 4.0."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _rss_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"{field} not in /proc/self/status")


def _plan(yaml_path, world):
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = plan_main([str(yaml_path), "--nproc", str(world), "--json"])
    return rc, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("name", [pytest.param(n, marks=_marks(n)) for n in sorted(SCRIPTS)])
def test_plan_of_a_published_script_at_its_world_size(name, tmp_path):
    world, argv = WORLD[name], _argv(name)
    try:
        keys = translate(argv, world_size=world).keys
    except ConfigError as e:       # a flag refused (tests/mindspeed/test_mindspeed_flags.py)
        assert "\n" not in explain(str(e))
        return
    keys.pop("checkpoint.load", None)     # placeholders, see the module docstring
    keys.pop("lora.r", None)
    path = tmp_path / "run.yaml"
    path.write_text(to_yaml(keys))
    _peak_rss_reset()
    before = _rss_mb("VmRSS")
    t0 = time.perf_counter()
    rc, out, err = _plan(path, world)
    seconds = time.perf_counter() - t0
    grown = _rss_mb("VmHWM") - before
    assert grown < RSS_BUDGET_MB, f"planning grew the peak RSS by {grown:.0f} MB"
    assert seconds < TIME_BUDGET_S, f"planning took {seconds:.1f} s"
    if rc != 0:                    # a refusal: one line, never a traceback
        lines = err.strip().splitlines()
        assert rc == 2 and len(lines) == 1 and lines[0].startswith("ms-llm plan: "), err
        assert name in PLAN_REFUSED and PLAN_REFUSED[name] in lines[0] or \
            "not built" in lines[0] or "not supported" in lines[0], lines[0]
        return
    assert name not in PLAN_REFUSED, "planned: remove it from PLAN_REFUSED"
    plan = json.loads(out)
    ref = megatron_parameter_count(argv, LLAMA2_VOCAB)
    assert plan["total_params"] == ref["total"]
    layout = plan["layout"]
    tp, ep = layout.get("tp", 1), layout.get("ep", 1)
    dense = ref["total"] - ref["experts"]
    expected = dense / tp + ref["experts"] / ep
    untied = "--untie-embeddings-and-output-weights" in argv
    if layout.get("pp", 1) > 1 and (not untied or "--mtp-num-layers" in argv):
        # the last stage's copy of the embedding: the tied output layer's, or the one
        # multi-token prediction embeds its shifted tokens with (Megatron-Core's MTP)
        expected += ref["embedding"] / tp
    held = sum(s["num_params"] for s in plan["stages"])
    assert abs(held / expected - 1) < 0.02, (held, expected)
    assert len(plan["stages"]) == layout.get("pp", 1)
    assert all(0 < s["params"] <= s["peak"] for s in plan["stages"])
    assert plan["peak_gb"] > 0
