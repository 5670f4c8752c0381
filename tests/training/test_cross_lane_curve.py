"""The same curve in both lanes: the PyTorch lane's loop (``pytorch_lane``: megatron-core's
GPTDataset and OptimizerParamScheduler, torch AdamW with Megatron's weight-decay groups and
clipping, transformers' Qwen3) and ms-llm on the same HF folder, indexed data and flags (given as
the Megatron flags of ``pretrain_gpt.py``): loss and grad norm per iteration at rtol 1e-4 for 20
iterations with warmup and cosine decay, 2 micro-batches per step, at dp=1 (in process) and dp=2
(msrun), and the lr each logs equal to Megatron's printed lr. After a resume from the PyTorch
lane's torch_dist checkpoint at iteration 10 (saved through megatron-core's dist_checkpointing,
as Megatron-LM saves it), iterations 11..20 continue the lane's curve, in one process and at
tp=2 under msrun; ms-llm's torch_dist save at 20 loads in megatron-core.

Tolerance: both lanes run fp32; the kernels differ in summation order (~1e-7 relative per op),
which Adam's normalised steps carry forward; 1e-4 is the issue's bar and holds with a margin at
this lr (the observed maximum is printed on failure).
"""
import json
import os

import numpy as np
import pytest

from helpers.finetune_fixtures import WORDS, alpaca_rows, preprocess, write_jsonl, write_tokenizer
from helpers.hf_fixtures import make_hf_checkpoint
from helpers.mcore_run import run_mcore
from helpers.msrun import ROOT, run_msrun, worker_logs
from helpers.pytorch_lane import LaneArgs, build, dump, train

ITERS = 20


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lanes")
    hf = root / "hf"
    make_hf_checkpoint(hf, "qwen3", hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16,
                       ffn=96, vocab=64, tied=False, seed=11, rope_theta=1e6)
    write_tokenizer(hf)
    rows = alpaca_rows(120, seed=12)
    text = write_jsonl(root / "text.jsonl", [{"text": " ".join([r["instruction"], r["output"]] * 2)}
                                             for r in rows])
    prefix = preprocess(text, str(hf), str(root / "pre"), "GeneralPretrainHandler",
                        "--append-eod") + "_text_document"
    a = LaneArgs(hf_dir=str(hf), data_prefix=prefix, cache=str(root / "mcore_cache"),
                 eod=WORDS.index("<eos>"), vocab_size=64, train_iters=ITERS)
    lane = build(a)
    ref = train(lane, a, 10)
    dump(lane, a, str(root / "lane10.pt"), heads=4, groups=2, head_dim=16)
    ref += train(lane, a, ITERS - 10)
    dump(lane, a, str(root / "lane20.pt"), heads=4, groups=2, head_dim=16)
    return root, a, ref


@pytest.fixture(scope="module")
def lane_ckpt(setup):
    """The PyTorch lane's torch_dist training checkpoint at iteration 10."""
    root = setup[0]
    run_mcore("save_lane", root / "lane_ckpt", root / "lane10.pt")
    return str(root / "lane_ckpt")


def resume_flags(a: LaneArgs, lane: str, save: str) -> list:
    argv = megatron_flags(a, save)
    argv = [x for x in argv if x not in ("--no-load-optim", "--no-load-rng")]
    i = argv.index("--load")
    argv[i + 1] = lane
    return argv + ["--ckpt-format", "torch_dist"]


def megatron_flags(a: LaneArgs, save: str) -> list:
    """The PyTorch lane's run as ``pretrain_gpt.py`` flags (what its script would pass)."""
    return [
        "--spec", "mindspeed_llm.tasks.models.spec.qwen3_spec", "layer_spec",
        "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "96",
        "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
        "--kv-channels", "16", "--qk-layernorm", "--padded-vocab-size", "64",
        "--make-vocab-size-divisible-by", "1", "--max-position-embeddings", "2048",
        "--rotary-base", "1000000", "--disable-bias-linear", "--swiglu",
        "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--position-embedding-type",
        "rope", "--untie-embeddings-and-output-weights", "--attention-dropout", "0",
        "--hidden-dropout", "0", "--tokenizer-type", "PretrainedFromHF",
        "--tokenizer-name-or-path", a.hf_dir, "--data-path", a.data_prefix,
        "--split", "100,0,0", "--seq-length", str(a.seq_length),
        "--micro-batch-size", str(a.micro_batch_size),
        "--global-batch-size", str(a.global_batch_size), "--train-iters", str(a.train_iters),
        "--lr", str(a.lr), "--min-lr", str(a.min_lr), "--lr-warmup-iters",
        str(a.lr_warmup_iters), "--lr-decay-style", a.lr_decay_style,
        "--weight-decay", str(a.weight_decay), "--clip-grad", str(a.clip_grad),
        "--adam-beta1", str(a.adam_beta1), "--adam-beta2", str(a.adam_beta2),
        "--adam-eps", str(a.adam_eps), "--seed", str(a.seed), "--log-interval", "1",
        "--eval-iters", "0", "--load", a.hf_dir, "--save", save, "--save-interval", "10",
        "--no-load-optim", "--no-load-rng", "--use-flash-attn"]


def assert_same_curve(ours, ref, iters=ITERS):
    assert len(ours) == len(ref) == iters
    for key in ("loss", "grad_norm"):
        a, b = np.array([r[key] for r in ours]), np.array([r[key] for r in ref])
        np.testing.assert_allclose(a, b, rtol=1e-4, err_msg=f"{key}: max rel "
                                   f"{np.max(np.abs(a - b) / np.abs(b)):.2e}")
    assert [r["lr"] for r in ours] == [r["lr"] for r in ref]
    print("max relative difference:", {k: float(np.max(np.abs(
        np.array([r[k] for r in ours]) / np.array([r[k] for r in ref]) - 1)))
        for k in ("loss", "grad_norm")})


def test_dp1_matches_the_pytorch_lane(setup):
    from ms_llm.config import load_config
    from ms_llm.mindspeed.flags import to_overrides, translate
    from ms_llm.training.trainer import Trainer
    root, a, ref = setup
    keys = translate(megatron_flags(a, str(root / "save1")), world_size=1).keys
    keys.update({"training.output_dir": str(root / "out1"), "training.progress_bar": False,
                 "data.data_cache_path": str(root / "cache1")})
    ours = Trainer(load_config(None, to_overrides(keys))).fit()
    assert_same_curve(ours, ref)


def pretrain_gpt_on_two_workers(work, argv) -> list:
    """``pretrain_gpt.py argv`` on 2 msrun workers run from ``work`` (MindSpeed scripts write
    relative to the working folder, as here); the logged loss rows of its metrics."""
    work.mkdir()
    cwd = os.getcwd()
    os.chdir(work)
    try:
        r = run_msrun(os.path.join(ROOT, "pretrain_gpt.py"), 2, str(work / "logs"), argv,
                      timeout=600)
    finally:
        os.chdir(cwd)
    logs = worker_logs(str(work / "logs"), 2)
    assert r.returncode == 0, "\n".join([log[-3000:] for log in logs] + [r.stderr[-2000:]])
    return [json.loads(x) for x in open(work / "outputs" / "default" / "metrics.jsonl")
            if '"loss"' in x]


@pytest.mark.msrun
@pytest.mark.slow
def test_dp2_under_msrun_matches_the_pytorch_lane(setup):
    root, a, ref = setup
    argv = megatron_flags(a, str(root / "save2")) + ["--micro-batch-size", "1",
                                                     "--data-cache-path", str(root / "cache2")]
    work = root / "dp2"
    ours = pretrain_gpt_on_two_workers(work, argv)
    assert_same_curve(ours, ref)


def _stacked(key: str):
    """megatron-core's local-spec state_dict key -> (torch_dist key, layer or None)."""
    parts = key.split(".")
    if parts[:2] != ["decoder", "layers"]:
        return key, None
    rest = ".".join(parts[3:])
    rest = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
            "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}.get(rest, rest)
    return "decoder.layers." + rest, int(parts[2])


def test_resume_from_the_pytorch_lane_at_10_continues_its_curve(setup, lane_ckpt):
    """ms-llm resumes the lane's iteration-10 torch_dist checkpoint (weights, Adam moments,
    step, scheduler, consumed samples) and iterations 11..20 match the lane's; its torch_dist
    save at 20 loads in megatron-core equal to the lane's own state at 20 (weights and moments:
    the two lanes' fp32 kernels differ by summation order, rtol 1e-4 / atol 1e-6 as the curve)."""
    from ms_llm.config import load_config
    from ms_llm.mindspeed.flags import to_overrides, translate
    from ms_llm.training.trainer import Trainer
    root, a, ref = setup
    save = str(root / "ours_td")
    keys = translate(resume_flags(a, lane_ckpt, save), world_size=1).keys
    keys.update({"training.output_dir": str(root / "out_r"), "training.progress_bar": False,
                 "data.data_cache_path": str(root / "cache_r")})
    ours = Trainer(load_config(None, to_overrides(keys))).fit()
    assert [r["step"] for r in ours] == list(range(11, ITERS + 1))
    assert_same_curve(ours, ref[10:], iters=ITERS - 10)
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read() == "20"
    run_mcore("load_train", os.path.join(save, "iter_0000020"), root / "mc20.npz")
    got = dict(np.load(root / "mc20.npz"))
    run_mcore("save_lane", root / "lane20_ckpt", root / "lane20.pt")
    want = dict(np.load(str(root / "lane20_ckpt") + ".npz"))
    assert float(got.pop("step")) == 20
    for key, value in got.items():
        moment, name = "", key
        for m in ("exp_avg_sq.", "exp_avg."):
            if key.startswith(m):
                moment, name = "optimizer.state." + m, key[len(m):]
                break
        base, layer = _stacked(name)
        expect = want[moment + base] if layer is None else want[moment + base][layer]
        np.testing.assert_allclose(value, expect, rtol=1e-4, atol=1e-6, err_msg=key)


@pytest.mark.msrun
@pytest.mark.slow
def test_resume_from_the_pytorch_lane_at_tp2_under_msrun(setup, lane_ckpt):
    """The dp=1 torch_dist checkpoint resumes at tp=2 (torch_dist is layout-free): the same
    curve for iterations 11..20 within the parallel tolerance (rtol 1e-4, as dp=2)."""
    root, a, ref = setup
    argv = resume_flags(a, lane_ckpt, str(root / "ours_tp2")) + [
        "--tensor-model-parallel-size", "2", "--data-cache-path", str(root / "cache_tp2")]
    work = root / "tp2"
    ours = pretrain_gpt_on_two_workers(work, argv)
    assert [r["step"] for r in ours] == list(range(11, ITERS + 1))
    assert_same_curve(ours, ref[10:], iters=ITERS - 10)
