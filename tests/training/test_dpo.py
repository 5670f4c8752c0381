"""DPO (``training.stage: dpo``): the three losses and their gradients against NumPy written
here from the formulas (TRL's ``dpo_loss``), the loss through a tiny model, a batch whose chosen
and rejected answers are equal, and the one-line errors for pairwise data with the wrong stage.

Tolerances: the NumPy reference runs in float64 on the same fp32 inputs; MindSpore computes in
fp32, so values agree to ~1e-6 relative (rtol 1e-5); the log-softmax over a 64-word vocabulary
and sums over <= 24 tokens keep the through-the-model figures within rtol 1e-4 / atol 1e-6.
"""
import math

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

from helpers.finetune_fixtures import RUN, make_hf_folder, pairwise_rows, preprocess, write_jsonl
from ms_llm.cli import main as cli_main
from ms_llm.config import ConfigError, DPOConfig, load_config
from ms_llm.checkpoint import from_pretrained
from ms_llm.ops.cross_entropy import cross_entropy
from ms_llm.training.dpo import DPOObjective, dpo_loss, sequence_logps
from ms_llm.training.trainer import Trainer

LOSSES = [("sigmoid", 0.0), ("sigmoid", 0.2), ("hinge", 0.0), ("ipo", 0.0)]


def np_logsigmoid(x):
    return -np.logaddexp(0.0, -x)


def np_dpo(pc, pr, rc, rr, beta, loss_type, ls):
    """(per-pair loss, d loss / d (pi_c - pi_r)) written from TRL's formulas."""
    z = (pc - pr) - (rc - rr)
    if loss_type == "sigmoid":
        sig = 1.0 / (1.0 + np.exp(-beta * z))
        loss = -np_logsigmoid(beta * z) * (1 - ls) - np_logsigmoid(-beta * z) * ls
        return loss, -beta * (1 - ls) * (1 - sig) + beta * ls * sig
    if loss_type == "hinge":
        return np.maximum(0.0, 1 - beta * z), np.where(1 - beta * z > 0, -beta, 0.0)
    return (z - 1 / (2 * beta)) ** 2, 2 * (z - 1 / (2 * beta))


@pytest.mark.parametrize("loss_type,ls", LOSSES)
def test_loss_and_gradient_wrt_logps_match_numpy(loss_type, ls):
    rng = np.random.RandomState(0)
    pc, pr, rc, rr = (rng.randn(16).astype(np.float32) * 3 for _ in range(4))
    beta = 0.3

    def f(a, b):
        return dpo_loss(a, b, Tensor(rc), Tensor(rr), beta, loss_type, ls).sum()

    loss = dpo_loss(*(Tensor(x) for x in (pc, pr, rc, rr)), beta, loss_type, ls).asnumpy()
    ga, gb = ms.grad(f, grad_position=(0, 1))(Tensor(pc), Tensor(pr))
    want, dz = np_dpo(*(x.astype(np.float64) for x in (pc, pr, rc, rr)), beta, loss_type, ls)
    np.testing.assert_allclose(loss, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ga.asnumpy(), dz, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gb.asnumpy(), -dz, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo")
    hf = make_hf_folder(root / "hf")
    preprocess(write_jsonl(root / "pairs.jsonl", pairwise_rows()), hf, str(root / "pairs"),
               "AlpacaStylePairwiseHandler")
    preprocess(write_jsonl(root / "same.jsonl", pairwise_rows(8, same=True)), hf,
               str(root / "same"), "AlpacaStylePairwiseHandler")
    return root


def _batch(rng, rows=6, s=12, vocab=64):
    """2B rows (chosen, then rejected) with a prompt part off the loss, replies on it."""
    tokens = rng.randint(2, vocab, size=(rows, s)).astype(np.int32)
    labels = rng.randint(2, vocab, size=(rows, s)).astype(np.int32)
    mask = np.zeros((rows, s), np.float32)
    for r in range(rows):
        lo = rng.randint(1, 5)
        mask[r, lo:lo + rng.randint(1, s - lo)] = 1.0
    return tokens, labels, mask


def np_seq_logps(logits, labels, mask, average):
    x = logits.astype(np.float64)
    logp = x - x.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    picked = np.take_along_axis(logp, labels[..., None].astype(np.int64), -1)[..., 0]
    out = (picked * mask).sum(-1)
    n = np.maximum(mask.sum(-1), 1.0)
    return (out / n if average else out), np.exp(logp), n


@pytest.mark.parametrize("loss_type,ls", LOSSES)
def test_loss_and_gradient_wrt_logits_through_a_tiny_model(tiny, loss_type, ls):
    """The model's logits feed the same cross entropy the model's labels path uses; the DPO loss
    of the trainer (``DPOObjective.loss``: model forward with labels) equals NumPy's from those
    logits, and the gradient w.r.t. the logits equals NumPy's chain rule
    ``dL/dlogp_row * mask * (onehot(label) - softmax) [/ reply length for ipo]``."""
    model = from_pretrained(str(tiny / "hf"))
    rng = np.random.RandomState(1)
    tokens, labels, mask = _batch(rng)
    n = len(tokens) // 2
    ref = (rng.randn(2 * n) * 2 - 8).astype(np.float32)
    avg = loss_type == "ipo"
    logits = model(Tensor(tokens)).asnumpy()
    cfg = DPOConfig(beta=0.5, loss_type=loss_type, label_smoothing=ls)

    logps, soft, lengths = np_seq_logps(logits, labels, mask, avg)
    want, dz = np_dpo(logps[:n], logps[n:], ref[:n], ref[n:], 0.5, loss_type, ls)

    objective = DPOObjective(cfg, model, [], None, None, reference=lambda: None)
    loss, pi = objective.loss(Tensor(tokens), Tensor(labels), Tensor(mask), Tensor(ref),
                              Tensor(np.float32(1.0 / n)))
    np.testing.assert_allclose(float(loss.asnumpy()), want.mean(), rtol=1e-4)
    np.testing.assert_allclose(pi.asnumpy(), logps, rtol=1e-4, atol=1e-5)

    def f(lg):
        lp = sequence_logps(cross_entropy(lg, Tensor(labels)), Tensor(mask), avg)
        return dpo_loss(lp[:n], lp[n:], Tensor(ref[:n]), Tensor(ref[n:]), 0.5, loss_type,
                        ls).sum()

    grad = ms.grad(f)(Tensor(logits)).asnumpy()
    d_row = np.concatenate([dz, -dz])                                  # dL/dlogp per row
    onehot = np.eye(logits.shape[-1])[labels]
    scale = (d_row / (lengths if avg else 1.0))[:, None, None]
    want_grad = scale * mask[..., None] * (onehot - soft)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-4, atol=1e-6)


def dpo_cfg(root, out, *extra):
    return load_config(None, ["--checkpoint.load", str(root / "hf"), "--data.tokenizer",
                              str(root / "hf"), "--training.stage", "dpo", *RUN,
                              "--training.output_dir", str(out), *extra])


def test_chosen_equal_to_rejected_gives_zero_margin(tiny, tmp_path):
    """Equal answers: policy and reference log-probs of chosen and rejected are the same rows,
    so the margin is exactly 0 (and the sigmoid loss ln 2) whatever the weights; their
    gradients cancel, so the step leaves the model (nearly) where it was."""
    trainer = Trainer(dpo_cfg(tiny, tmp_path, "--data.data_path", str(tiny / "same"),
                              "--training.max_steps", "2"))
    recs = trainer.fit()
    for r in recs:
        assert r["rewards/margin"] == 0.0 and r["rewards/accuracy"] == 0.0, r
        assert r["rewards/chosen"] == r["rewards/rejected"], r
        assert r["loss"] == pytest.approx(math.log(2.0), rel=1e-6), r
        assert r["grad_norm"] < 1e-5, r   # fp32 rounding of the summed, opposite row gradients


def _cli(capsys, *args):
    rc = cli_main(["train", *args])
    return rc, capsys.readouterr().err.strip()


def test_pairwise_data_with_the_wrong_stage_is_one_line(tiny, tmp_path, capsys):
    common = ["--checkpoint.load", str(tiny / "hf"), "--data.tokenizer", str(tiny / "hf"),
              *RUN, "--training.output_dir", str(tmp_path / "o")]
    rc, err = _cli(capsys, *common, "--data.data_path", str(tiny / "pairs"),
                   "--data.dataset_type", "sft")
    assert rc == 2 and err.count("\n") == 0, err
    assert err.startswith("config error: command line --data.data_path: data.data_path: ") and \
        "holds pairwise (chosen/rejected) data, which trains with training.stage dpo" in err, err

    sft = tmp_path / "sft"
    preprocess(write_jsonl(tmp_path / "a.jsonl", [{"instruction": "w1 w2", "output": "w3"}] * 4),
               str(tiny / "hf"), str(sft), "AlpacaStyleInstructionHandler")
    capsys.readouterr()
    rc, err = _cli(capsys, *common, "--data.data_path", str(sft), "--training.stage", "dpo")
    assert rc == 2 and err.count("\n") == 0, err
    assert "training.stage dpo needs pairwise data" in err, err

    rc, err = _cli(capsys, *common, "--data.data_path", str(tiny / "pairs"),
                   "--dpo.beta", "0.2")
    assert rc == 2 and err == ("config error: command line --dpo.beta: dpo.beta is set but "
                               "training.stage is not dpo"), err
    rc, err = _cli(capsys, *common, "--training.stage", "dpo")
    assert rc == 2 and "training.stage dpo needs data.data_path" in err, err
    rc, err = _cli(capsys, *common, "--training.stage", "dpo", "--data.data_path",
                   str(tiny / "pairs"), "--dpo.loss_type", "ipo", "--dpo.label_smoothing", "0.1")
    assert rc == 2 and "dpo.label_smoothing applies to dpo.loss_type sigmoid only" in err, err


def test_layouts_and_keys_dpo_does_not_take_are_config_errors(tiny):
    data = ["--data.data_path", str(tiny / "pairs"), "--data.tokenizer", str(tiny / "hf")]
    cases = [
        (["--training.stage", "dpo", "--parallel.pipeline_model_parallel_size", "2"],
         "command line --training.stage: training.stage dpo with "
         "parallel.pipeline_model_parallel_size > 1 is not built yet"),
        (["--training.stage", "dpo", "--model.hidden_dropout", "0.1"],
         "command line --model.hidden_dropout: training.stage dpo needs model.hidden_dropout and "
         "model.attention_dropout 0"),
        (["--dpo.loss_type", "kto"], "command line --dpo.loss_type: dpo.loss_type must be one "
                                     "of sigmoid, hinge, ipo, got 'kto'"),
        (["--training.stage", "ppo"], "command line --training.stage: training.stage must be "
                                      "null or one of dpo, got 'ppo'"),
    ]
    for extra, want in cases:
        with pytest.raises(ConfigError) as e:
            load_config(None, data + extra)
        assert str(e.value).startswith(want) and "\n" not in str(e.value), (extra, str(e.value))
    # DPO and evaluation with context parallel are built (test_dpo_parallel, test_context_
    # parallel_training): the configs load
    for extra in (["--training.stage", "dpo", "--parallel.context_parallel_size", "2"],
                  ["--training.eval_interval", "5", "--parallel.context_parallel_size", "2"]):
        load_config(None, data + extra)


def test_lora_dpo_reference_is_the_base_with_adapters_off(tiny, tmp_path):
    """With LoRA the reference is the frozen base, adapters off (no weight snapshot): step 1
    (B = 0) has policy == reference; later the reference log-probs still equal those of the
    untouched HF model computed here, while the policy's moved."""
    from ms_llm.training.dpo import FrozenReference
    trainer = Trainer(dpo_cfg(tiny, tmp_path, "--data.data_path", str(tiny / "pairs"),
                              "--training.max_steps", "2", "--lora.r", "4", "--lora.alpha", "8",
                              # Megatron's schedule applies lr_warmup_init (0) at iteration 1:
                              # no warmup, so step 1 moves the adapters
                              "--training.lr_warmup_steps", "0"))
    assert not isinstance(getattr(trainer.objective.reference, "__self__", None), FrozenReference)
    recs = trainer.fit()
    assert recs[0]["loss"] == pytest.approx(math.log(2.0), rel=1e-6)
    assert recs[0]["rewards/margin"] == 0.0 and recs[1]["rewards/margin"] != 0.0
    rows = trainer.objective.rows(next(trainer.data.loader))
    ref = trainer.objective.reference_logps(rows).asnumpy()
    base = from_pretrained(str(tiny / "hf"))
    nll = base(rows["tokens"], labels=rows["labels"]).asnumpy()
    want = -(nll * rows["loss_mask"].asnumpy()).sum(-1)
    np.testing.assert_allclose(ref, want, rtol=1e-5, atol=1e-5)   # same fp32 forward
    policy = -(trainer.model(rows["tokens"], labels=rows["labels"]).asnumpy()
               * rows["loss_mask"].asnumpy()).sum(-1)
    assert np.abs(policy - want).max() > 1e-4                     # the adapters trained
