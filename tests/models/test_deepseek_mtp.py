"""Multi-token prediction (``model.mtp_num_layers``) on a tiny DeepSeek-V3 with two MTP depths
whose weights sit where DeepSeek's release keeps them (``model.layers.{L + j}.*``).

Reference: transformers has the pieces but no MTP training loss, so the test composes one in
torch (float32, as the other parity tests: transformers' grouped expert GEMM has no float64)
from transformers' modules -- the main model's final hidden states
(``DeepseekV3Model``), its ``MtpLayer`` (enorm / hnorm / eh_proj / decoder layer / post-norm)
and the shared embedding and head -- with the loss written out here: cross entropy of depth k
against the labels shifted k places, its loss mask shifted alike, Megatron-Core's
per-token form ``scale / D * sum(mask_k ce_k) * N / N_k`` over the ``N`` main loss tokens.

Tolerances: loss, per-depth losses and global grad norm 1e-5 relative (both sides float32:
~1e-6 relative through 5 layers in another summation order; a wrong shift, norm order or a
missing gradient path changes them by > 1e-3). Conversion is bit-exact.
"""
from __future__ import annotations

import glob
import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from helpers import deepseek_fixtures as fx
from helpers.deepseek_fixtures import run_convert as _run, same_bits as _same
from ms_llm.checkpoint import torch_pickle as tp
from ms_llm.checkpoint.convert import main as convert_main
from ms_llm.checkpoint.hf.io import read_hf_weights

import transformers  # noqa: E402,F401  (test extra: the reference's modules)

L, D, SCALE = 3, 2, 0.3
KIND, KWARGS = fx.CASES["deepseek_q_lora"]


def _mtp_layers(big):
    """transformers' ``MtpLayer`` per depth around the big model's extra decoder layers, their
    own norms and projection redrawn at unit scale (as the fixtures' other weights)."""
    import torch
    from transformers.modeling_layers import MtpLayer
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m
    g = torch.Generator().manual_seed(5)
    out = []
    for j in range(D):
        layer = MtpLayer(big.config, m.DeepseekV3DecoderLayer, m.DeepseekV3RMSNorm, L + j)
        layer.mtp_block = big.model.layers[L + j]
        with torch.no_grad():
            for mod in (layer.enorm, layer.hnorm, layer.post_norm):
                mod.weight.copy_(0.6 + 0.8 * torch.rand(mod.weight.shape, generator=g))
            w = layer.eh_proj.weight
            w.copy_(torch.randn(w.shape, generator=g) / w.shape[1] ** 0.5)
        out.append(layer)
    return out


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """(HF folder with L layers + D MTP depths, transformers' main model, MTP layers)."""
    root = tmp_path_factory.mktemp("mtp")
    big = fx.build_hf(KIND, dict(KWARGS, num_hidden_layers=L + D), seed=3)
    mtp = _mtp_layers(big)
    big.save_pretrained(str(root / "big"))
    w = load_file(str(root / "big" / "model.safetensors"))
    for j, layer in enumerate(mtp):
        p = f"model.layers.{L + j}."
        w[p + "embed_tokens.weight"] = w["model.embed_tokens.weight"].copy()
        w[p + "shared_head.head.weight"] = w["lm_head.weight"].copy()
        for ours, theirs in (("enorm", "enorm"), ("hnorm", "hnorm"), ("eh_proj", "eh_proj"),
                             ("shared_head.norm", "post_norm")):
            w[p + ours + ".weight"] = getattr(layer, theirs).weight.detach().numpy().copy()
    cfg = json.load(open(root / "big" / "config.json"))
    cfg.update(num_hidden_layers=L, num_nextn_predict_layers=D)
    os.makedirs(root / "hf")
    with open(root / "hf" / "config.json", "w") as f:
        json.dump(cfg, f)
    save_file(w, str(root / "hf" / "model.safetensors"), metadata={"format": "pt"})
    return root, big, mtp


def _batch():
    ids, labels = fx.batch(seed=4, b=2, s=10)
    mask = (labels != -100).astype(np.float32)
    mask[1, 4] = 0.0                 # a masked position inside the sequence
    return ids, np.where(labels < 0, 0, labels), mask


def _reference(big, mtp, ids, labels, mask):
    """(total loss, grad norm, per-depth mean losses) in torch."""
    import torch
    F = torch.nn.functional
    big.zero_grad()
    for m in mtp:
        m.zero_grad()
    b, s = ids.shape
    x = torch.tensor(ids)
    pos = torch.arange(s)[None].expand(b, s)
    causal = torch.full((s, s), float("-inf")).triu(1)[None, None]
    model = big.model
    h = model.embed_tokens(x)
    pe = model.rotary_emb(h, pos)
    for layer in model.layers[:L]:
        h = layer(h, attention_mask=causal, position_ids=pos, position_embeddings=pe)
    h = model.norm(h)
    lab, msk = torch.tensor(labels), torch.tensor(mask)
    n = msk.sum()

    def ce(hidden, target):
        logits = big.lm_head(hidden)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                               reduction="none").reshape(b, s)

    total = (ce(h, lab) * msk).sum() / n
    means = []
    for m in mtp:
        # depth k: tokens, labels and mask shifted one more place left, the tail zero
        x = torch.cat([x[:, 1:], torch.zeros_like(x[:, :1])], 1)
        lab = torch.cat([lab[:, 1:], torch.zeros_like(lab[:, :1])], 1)
        msk = torch.cat([msk[:, 1:], torch.zeros_like(msk[:, :1])], 1)
        h = m(model.embed_tokens(x), h, pe, causal, pos, None)
        summed = (ce(h, lab) * msk).sum()
        means.append(float(summed.detach() / msk.sum()))
        total = total + SCALE / D * summed * (n / msk.sum()) / n
    total.backward()
    params = list(big.parameters()) + [q for m in mtp for q in m.parameters()
                                       if all(q is not r for r in big.parameters())]
    norm = float(torch.sqrt(sum((q.grad.double() ** 2).sum() for q in params
                                if q.grad is not None)))
    return float(total.detach()), norm, means


def _ms_model(path):
    from ms_llm.checkpoint.hf.io import read_hf_config
    from ms_llm.checkpoint import from_pretrained
    from ms_llm.models.families import config_from_hf
    cfg = config_from_hf(read_hf_config(str(path))).replace(mtp_num_layers=D,
                                                            mtp_loss_scaling_factor=SCALE)
    return from_pretrained(str(path), config=cfg)


def _ms_loss(model, ids, labels, mask):
    """The trainer's objective for one micro-batch (main + MTP term over the batch's tokens)."""
    import mindspore as ms
    m = ms.Tensor(mask)
    inv = ms.Tensor(np.float32(1.0 / mask.sum()))
    params = model.trainable_params()

    def fn(x, y):
        loss = (model(x, labels=y) * m).sum() * inv
        return loss + model.mtp_loss(m)[0] * inv

    loss, grads = ms.value_and_grad(fn, None, params)(ms.Tensor(ids.astype(np.int32)),
                                                      ms.Tensor(labels.astype(np.int32)))
    norm = float(np.sqrt(sum((g.asnumpy().astype(np.float64) ** 2).sum() for g in grads)))
    means = [float(v.asnumpy()) for v in model.mtp_loss(m)[1]]
    return float(loss.asnumpy()), norm, means


def test_mtp_loss_and_grads_match_reference(folder):
    root, big, mtp = folder
    ids, labels, mask = _batch()
    want_loss, want_norm, want_means = _reference(big, mtp, ids, labels, mask)
    model = _ms_model(root / "hf")
    assert [n for n, _ in model.named_parameters() if n.startswith("mtp.layers.1.")][:3] == [
        "mtp.layers.1.enorm.weight", "mtp.layers.1.hnorm.weight", "mtp.layers.1.eh_proj.weight"]
    loss, norm, means = _ms_loss(model, ids, labels, mask)
    np.testing.assert_allclose(means, want_means, rtol=1e-5)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(norm, want_norm, rtol=1e-5)


def test_mtp_converts_hf_mg_hf_bit_exact_with_megatron_keys(folder):
    """tp=2 with pp=2 (the MTP block on the last stage, with its embedding copy), back to HF
    bit-exact; the Megatron folder reloads with the same MTP loss."""
    root, _, _ = folder
    mg, back = root / "mg", root / "back"
    _run("--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", root / "hf",
         "--save-dir", mg, "--target-tensor-parallel-size", "2",
         "--target-pipeline-parallel-size", "2", "--num-layer-list", "1,2")
    _run("--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", mg,
         "--save-dir", back)
    hf, got = read_hf_weights(str(root / "hf")), read_hf_weights(str(back))
    assert set(got) == set(hf)
    for k in hf:
        assert _same(got[k], hf[k]), k
    files = {os.path.basename(os.path.dirname(f)): tp.load(f)["model"] for f in
             sorted(glob.glob(str(mg / "iter_0000001" / "mp_rank_*" / "model_optim_rng.pt")))}
    p = f"model.layers.{L}."
    for t in range(2):
        first, last = files[f"mp_rank_{t:02d}_000"], files[f"mp_rank_{t:02d}_001"]
        assert not any(k.startswith("mtp.") for k in first)
        assert _same(last["mtp.layers.0.eh_proj.weight"],
                     np.split(hf[p + "eh_proj.weight"], 2, axis=0)[t])
        assert _same(last["mtp.layers.0.enorm.weight"], hf[p + "enorm.weight"])
        assert _same(last["mtp.layers.1.final_layernorm.weight"],
                     hf[f"model.layers.{L + 1}.shared_head.norm.weight"])
        assert _same(last["mtp.layers.0.transformer_layer.self_attention.linear_qb.weight"],
                     np.split(hf[p + "self_attn.q_b_proj.weight"], 2, axis=0)[t])
        assert "mtp.layers.0.transformer_layer.mlp.router.expert_bias" in last
        assert _same(last["embedding.word_embeddings.weight"],
                     first["embedding.word_embeddings.weight"])
    ids, labels, mask = _batch()
    a = _ms_loss(_ms_model(root / "hf"), ids, labels, mask)
    b = _ms_loss(_ms_model(mg), ids, labels, mask)
    assert a == b


def test_mtp_num_layers_flag(folder, tmp_path, capsys):
    root, _, _ = folder
    _run("--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", root / "hf",
         "--save-dir", tmp_path / "none", "--mtp-num-layers", "0")
    sd = tp.load(str(tmp_path / "none" / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt"))
    assert not any(k.startswith("mtp.") for k in sd["model"])
    assert convert_main(["--load-model-type", "hf", "--save-model-type", "mg", "--load-dir",
                         str(root / "hf"), "--save-dir", str(tmp_path / "x"),
                         "--mtp-num-layers", "1"]) == 2
    assert "--mtp-num-layers 1: the checkpoint has 2 MTP layer(s)" in capsys.readouterr().err


def test_trainer_adds_the_scaled_mtp_loss_and_logs_it(tmp_path):
    """YAML/CLI reach: ``--model.mtp_num_layers 1`` on the DeepSeek proxy. The first step's
    main loss does not depend on MTP (same data, and the main model's initial weights do not
    change when the MTP block is built), so the logged loss is the plain run's plus
    ``mtp_loss_scaling_factor / D`` times the logged MTP loss (rtol 1e-6: float32 sums)."""
    from helpers.deepseek_parallel_common import DS_BASE, DS_CONFIG
    from ms_llm.config import load_config
    from ms_llm.training.trainer import Trainer
    # no router aux loss: the MTP depth's MoE router would add its own (as in Megatron-Core)
    one = ["--training.max_steps", "1", "--training.output_dir", str(tmp_path / "o"),
           "--model.moe_aux_loss_coeff", "0"]
    plain = Trainer(load_config(DS_CONFIG, DS_BASE + one)).fit()[0]
    rows = Trainer(load_config(DS_CONFIG, DS_BASE + one + [
        "--model.mtp_num_layers", "1", "--model.mtp_loss_scaling_factor", "0.3"])).fit()
    assert "mtp_1_loss" not in plain and np.isfinite(rows[0]["mtp_1_loss"])
    np.testing.assert_allclose(rows[0]["loss"], plain["loss"] + 0.3 * rows[0]["mtp_1_loss"],
                               rtol=1e-6)

