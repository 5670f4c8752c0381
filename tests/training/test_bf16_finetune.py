"""bf16 mixed precision (``training.bf16``) with DPO and with LoRA, against the same runs in fp32.

What is checked:
* DPO, full fine-tuning: bf16 model parameters, fp32 main parameters (``optim.MainParams``); the
  reference log-probs come from the same bf16 forward as the policy's, so step 1 (policy ==
  reference) has margin exactly 0 and loss exactly ln 2, as in fp32.
* DPO with LoRA: the frozen base stays bf16 and outside the optimizer (no fp32 copy of it), the
  adapters are fp32 and are their own main parameters; the reference is the bf16 base with the
  adapters off.

Tolerance (bf16 vs fp32 on the same weights rounded to bf16): a reply's log-prob sums ~5 per-token
log-probs whose bf16 activations (unit roundoff 2^-9) put ~1e-3 .. 1e-2 absolute error on each;
the DPO logit takes beta (0.1) times differences of four such sums, and the sigmoid loss has slope
<= 0.5, so the loss moves by ~1e-3 at most (measured 2e-5 .. 8e-4 over 3 steps). Checked at 3e-3
absolute. Gradient norms: bf16 gradients are ~1% off per tensor (test_bf16), the global norm
~0.1% (measured <= 3e-3 relative); checked at 2e-2 relative. A wrong reference or a missing
update gives O(1e-2 .. 1) on the loss and O(1) on the norm.
"""
import math

import mindspore as ms
import numpy as np
import pytest

from helpers.finetune_fixtures import RUN, make_hf_folder, pairwise_rows, preprocess, write_jsonl
from ms_llm.config import load_config
from ms_llm.lora.modules import is_frozen_base
from ms_llm.optim import MainParams
from ms_llm.training.trainer import Trainer

LOSS_ATOL, NORM_RTOL = 3e-3, 2e-2


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bf16_dpo")
    hf = make_hf_folder(root / "hf")
    preprocess(write_jsonl(root / "pairs.jsonl", pairwise_rows()), hf, str(root / "pairs"),
               "AlpacaStylePairwiseHandler")
    return root


def _dpo(root, out, bf16, *extra):
    cfg = load_config(None, ["--checkpoint.load", str(root / "hf"), "--data.tokenizer",
                             str(root / "hf"), "--training.stage", "dpo", *RUN,
                             # Megatron's schedule applies lr_warmup_init (0) at iteration 1:
                             # no warmup, so the first update moves the policy
                             "--training.lr_warmup_steps", "0",
                             "--data.data_path", str(root / "pairs"), "--training.max_steps", "2",
                             "--training.output_dir", str(out), "--training.bf16", bf16, *extra])
    trainer = Trainer(cfg)
    return trainer, trainer.fit()


def _close_to_fp32(got, want):
    assert got[0]["loss"] == pytest.approx(math.log(2.0), rel=1e-6)   # policy == reference
    assert got[0]["rewards/margin"] == 0.0
    for g, w in zip(got, want):
        assert abs(g["loss"] - w["loss"]) < LOSS_ATOL, (g, w)
        assert abs(g["grad_norm"] / w["grad_norm"] - 1) < NORM_RTOL, (g, w)
    assert got[1]["loss"] != got[0]["loss"]      # the first update moved the policy


def test_bf16_dpo_full_finetune_matches_fp32(pairs, tmp_path):
    _, want = _dpo(pairs, tmp_path / "fp32", "false")
    trainer, got = _dpo(pairs, tmp_path / "bf16", "true")
    opt = trainer.optimizer
    assert isinstance(opt, MainParams)
    assert {p.dtype for p in opt.model_params} == {ms.bfloat16}
    assert {p.dtype for p in opt.params} == {ms.float32}
    # the reference snapshot is the starting bf16 weights (no fp32 copy of the model)
    assert {v.dtype for v in trainer.objective.reference.__self__.initial} == {ms.bfloat16}
    _close_to_fp32(got, want)


def test_bf16_lora_dpo_frozen_bf16_base_matches_fp32(pairs, tmp_path):
    lora = ["--lora.r", "4", "--lora.alpha", "8"]
    _, want = _dpo(pairs, tmp_path / "fp32", "false", *lora)
    trainer, got = _dpo(pairs, tmp_path / "bf16", "true", *lora)
    named = trainer.named_params
    base = [p for _, p in named if is_frozen_base(p)]
    adapters = [p for n, p in named if ".lora_" in n]
    assert base and adapters
    assert {p.dtype for p in base} == {ms.bfloat16}            # frozen base: bf16, no mains
    assert {p.dtype for p in adapters} == {ms.float32}         # adapters: their own fp32 mains
    opt_ids = {id(p) for p in trainer.optimizer.params}
    assert opt_ids == {id(p) for p in adapters}
    assert trainer.optimizer.state_bytes()["main_params"] == 0
    _close_to_fp32(got, want)
    # the adapters trained: the policy moved away from the (bf16, adapters-off) reference
    assert any(np.abs(p.asnumpy()).max() > 0 for n, p in named if ".lora_B" in n)
