"""MXFP8 on models with modules whose dims are not multiples of the 32-element block
(``quant.mx_unaligned``, docs/features/mxfp8.md): DeepSeek-V3's MLA down-projections (the
qualify proxy: kv_lora_rank 16) and, under tensor parallel, Qwen3.5's ``in_proj_ba`` (32 rows,
16 per shard). As torchao's MX recipe does, such modules stay in the model's precision and are
listed; every other selected module runs the MXFP8 recipe, its numerics those of the spec
reference (``helpers.mx_reference``: float64 quantize-dequantize, not ms-llm's code)."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
from mindspore import Tensor

from helpers.mx_reference import assert_close, qd
from helpers.paths import ROOT
from ms_llm.compat import manual_seed
from ms_llm.config import load_config
from ms_llm.models import GPTModel
from ms_llm.models.families.deepseek_v3.spec import QUALIFY_ARGS as DSV3_ARGS
from ms_llm.models.families.qwen35.spec import QUALIFY_ARGS as QWEN35_ARGS
from ms_llm.quant import MXFP8Linear, apply_quantization, kept_unaligned

DSV3 = os.path.join(ROOT, "configs", "deepseek_v3_proxy.yaml")
TINY = os.path.join(ROOT, "configs", "tiny.yaml")
MX = ("--quant.recipe", "mxfp8")


def _weights_unaligned(model) -> list:
    """The linears under ``decoder.layers.`` (routers aside) with a dim not a multiple of 32,
    from their weight shapes."""
    return [n for n, c in model.cells_and_names()
            if n.startswith("decoder.layers.") and ".router" not in n
            and getattr(c, "weight", None) is not None and len(c.weight.shape) == 2
            and hasattr(c, "in_features") and any(d % 32 for d in c.weight.shape)]


def test_deepseek_v3_mla_down_projections_stay_in_high_precision_and_are_listed():
    cfg = load_config(DSV3, [*DSV3_ARGS, *MX])
    assert cfg.quant.mx_unaligned == "keep"               # the default
    manual_seed(0)
    model = GPTModel(cfg.model)
    unaligned = _weights_unaligned(model)
    assert any(n.endswith("linear_kv_down_proj") for n in unaligned), unaligned
    weights = {n: c.weight.asnumpy() for n, c in model.cells_and_names()
               if getattr(c, "weight", None) is not None and len(c.weight.shape) == 2}
    replaced = apply_quantization(model, cfg.quant)
    assert kept_unaligned(model) == unaligned and not set(unaligned) & set(replaced)
    cells = dict(model.cells_and_names())
    rng = np.random.default_rng(0)
    kept = cells[unaligned[0]]
    assert not isinstance(kept, MXFP8Linear)
    x = rng.standard_normal((5, kept.in_features)).astype(np.float32)
    np.testing.assert_allclose(kept(Tensor(x)).asnumpy(), x @ weights[unaligned[0]].T,
                               rtol=1e-5, atol=1e-6)
    # a quantized module's forward is the spec recipe (unchanged by the kept neighbours)
    name = next(n for n in replaced if n.endswith("linear_q_up_proj"))
    mod = cells[name]
    assert isinstance(mod, MXFP8Linear)
    x = (rng.standard_normal((7, mod.in_features)) * 3).astype(np.float32)
    want = qd(x, -1, "float8_e4m3fn", "floor") @ qd(weights[name], -1, "float8_e4m3fn",
                                                     "floor").T
    assert_close(mod(Tensor(x)).asnumpy(), want, "forward")
    assert np.abs(want - x @ weights[name].T).max() > 1e-4      # not vacuous: FP8 rounds


def test_error_policy_names_the_module_and_the_option():
    cfg = load_config(DSV3, [*DSV3_ARGS, *MX, "--quant.mx_unaligned", "error"])
    with pytest.raises(ValueError, match=r"linear_q_down_proj.*multiple of 32.*"
                                         r"quant.mx_unaligned: keep|linear_kv_down_proj.*"
                                         r"multiple of 32.*quant.mx_unaligned: keep"):
        apply_quantization(GPTModel(cfg.model), cfg.quant)
    with pytest.raises(Exception, match="quant.mx_unaligned"):
        load_config(DSV3, [*DSV3_ARGS, *MX, "--quant.mx_unaligned", "pad"])


def test_qwen35_tensor_parallel_shard_of_in_proj_ba_runs_its_own_matmul():
    """tp 2 cuts ``in_proj_ba``'s 32 rows into 16: that shard runs the source linear's matmul
    (exact fp32) and is listed in parallelize_model's notes; the other shards stay MXFP8."""
    from ms_llm.parallel.parallelize import parallelize_model
    from ms_llm.parallel.plan_shapes import plan_state
    from ms_llm.parallel.state import ParallelSizes
    cfg = load_config(TINY, [*QWEN35_ARGS, *MX, "--parallel.tensor_model_parallel_size", "2",
                             "--training.jit", "false"])
    manual_seed(0)
    model = GPTModel(cfg.model)
    w_ba = model.decoder.layers[0].self_attention.in_proj_ba.weight.asnumpy()
    par = parallelize_model(model, cfg, plan_state(ParallelSizes(tp=2, world=2), 0))
    note = [n for n in par.notes if "kept in high precision" in n]
    assert len(note) == 1 and "decoder.layers.0.self_attention.in_proj_ba (tensor-parallel " \
                               "shard 64x16)" in note[0], par.notes
    assert "in_proj_qkvz" not in note[0] and "linear_fc1" not in note[0]
    shard = model.decoder.layers[0].self_attention.in_proj_ba
    x = np.random.default_rng(1).standard_normal((6, 64)).astype(np.float32)
    rows = shard.weight.asnumpy()
    assert rows.shape == (16, 64) and all(any(np.array_equal(r, w) for w in w_ba) for r in rows)
    np.testing.assert_allclose(shard.matmul(Tensor(x), shard.weight).asnumpy(), x @ rows.T,
                               rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_deepseek_v3_trains_with_mxfp8_and_lists_the_kept_modules(tmp_path, capsys):
    """Two steps of the qualify proxy through ``ms-llm train`` (~60 s on 2 shared cores)."""
    from ms_llm.cli import main as cli_main
    out = tmp_path / "run"
    assert cli_main(["train", DSV3, *DSV3_ARGS, *MX, "--training.max_steps", "2",
                     "--training.micro_batch_size", "1", "--training.global_batch_size", "1",
                     "--data.seq_length", "32", "--training.output_dir", str(out),
                     "--training.progress_bar", "false", "--training.jit", "false",
                     "--training.log_interval", "1"]) == 0
    printed = capsys.readouterr()
    lines = [line for line in (printed.out + printed.err).splitlines()
             if "kept in high precision" in line]
    assert len(lines) == 1 and "linear_kv_down_proj" in lines[0], lines
    with open(out / "metrics.jsonl") as f:
        losses = [json.loads(line)["loss"] for line in f if '"loss"' in line]
    assert len(losses) == 2 and all(np.isfinite(losses))
