"""LoRA and MXFP8 on the hybrid models (Qwen3-Next, Qwen3.5): the module conversions reach the
Gated DeltaNet projections (``in_proj_qkvz``, ``in_proj_ba``, ``out_proj``) as well as the gated
attention and MLP linears.

LoRA: training from a tiny transformers-written folder runs with adapters on DeltaNet and
attention projections; the merged export equals ``W + (alpha / r) B A`` computed here in numpy
for each DeltaNet projection (Qwen3-Next's HF tensors are the fused ones), the other tensors
keep the base's bits, and the merged folder computes what the trained model computes (Qwen3.5:
through its split / permuted HF layout). PEFT export is refused in one line (not built for
these layer kinds).

MXFP8: ``apply_quantization``'s default selection converts every DeltaNet projection; each
converted module equals the recipe (``mx_reference.qd``: spec quantize-dequantize in float64
of input and weight, then the matmul); a few AdamW steps of the quantized hybrid model train.

Tolerances: merged weights rtol 1e-6 (float64 sums stored in fp32 on both sides); merged vs
trained logits 1e-4 (fp32, the adapter path sums in another order); the MXFP8 module 1e-5 of
the largest entry as test_mx_linear (fp32 accumulation of identical quantized operands)."""
from __future__ import annotations

import dataclasses
import glob
import os

import numpy as np
import pytest
from mindspore import Tensor
from safetensors.numpy import load_file

import transformers  # noqa: F401  (test extra)

from helpers.finetune_fixtures import write_tokenizer

from ms_llm.config import load_config
from ms_llm.models.registry import get_family
from ms_llm.training.trainer import Trainer
from helpers.paths import ROOT

TARGETS = "in_proj_qkvz,in_proj_ba,out_proj,linear_qkv"


def _hf_folder(name: str, root):
    import torch
    spec = get_family(name)
    cfg = transformers.AutoConfig.for_model(spec.hf_model_type, **spec.tiny_hf)
    model = getattr(transformers, spec.hf_architecture)(cfg)
    g = torch.Generator().manual_seed(13)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g) if p.ndim == 1
                    else torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    model.save_pretrained(str(root / "hf"))
    write_tokenizer(root / "hf")
    (root / "corpus.txt").write_text("\n\n".join(" ".join(f"w{(i * j + j) % 30}"
                                                           for j in range(60)) for i in range(40)))


def _lora_run(root, out):
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), [
        "--checkpoint.load", str(root / "hf"), "--data.tokenizer", str(root / "hf"),
        "--data.corpus", str(root / "corpus.txt"), "--data.seq_length", "16",
        "--training.micro_batch_size", "2", "--training.global_batch_size", "2",
        "--training.progress_bar", "false", "--training.lr_warmup_steps", "1",
        "--training.log_interval", "1", "--training.jit", "false", "--training.lr", "0.01",
        "--training.min_lr", "0.0", "--training.max_steps", "3",
        "--training.output_dir", str(out / "run"), "--checkpoint.save_dir", str(out / "save"),
        "--lora.r", "4", "--lora.alpha", "8", "--lora.target_modules", TARGETS])
    trainer = Trainer(cfg)
    trainer.fit()
    return trainer, str(out / "save" / "iter_0000003")


def _adapters(ckpt):
    from ms_llm.checkpoint.native.load import DCPReader
    r = DCPReader(ckpt)
    try:
        return {n: r.read(n).astype(np.float64) for n in r.names() if ".lora_" in n}
    finally:
        r.close()


@pytest.mark.parametrize("name", ["qwen3-next", "qwen35"])
def test_lora_on_deltanet_trains_and_merges_exactly(name, tmp_path):
    from ms_llm.checkpoint import from_pretrained
    from ms_llm.cli import main
    _hf_folder(name, tmp_path)
    trainer, ckpt = _lora_run(tmp_path, tmp_path)
    ad = _adapters(ckpt)
    gdn = [k for k in ad if "in_proj_qkvz.lora_B" in k]
    assert gdn and all(np.any(ad[k]) for k in ad if "lora_B" in k)   # every adapter trained
    assert main(["export", ckpt, str(tmp_path / "merged")]) == 0
    got = load_file(str(tmp_path / "merged" / "model.safetensors"))
    base = load_file(str(tmp_path / "hf" / "model.safetensors"))
    if name == "qwen3-next":       # HF holds the fused DeltaNet tensors: check them in numpy
        for i in (0, 2):
            for mod in ("in_proj_qkvz", "in_proj_ba", "out_proj"):
                p = f"decoder.layers.{i}.self_attention.{mod}."
                want = base[f"model.layers.{i}.linear_attn.{mod}.weight"].astype(np.float64) \
                    + 2.0 * ad[p + "lora_B.weight"] @ ad[p + "lora_A.weight"]
                np.testing.assert_allclose(got[f"model.layers.{i}.linear_attn.{mod}.weight"],
                                           want.astype(np.float32), rtol=1e-6, atol=1e-7)
    for k, v in base.items():       # norms, conv, decay, experts, embedding: the base's bits
        if not any(m in k for m in ("in_proj", "out_proj", "q_proj", "k_proj", "v_proj")):
            assert got[k].tobytes() == v.tobytes(), k
    ids = Tensor(np.arange(16, dtype=np.int32).reshape(1, 16) % 32)
    trainer.model.set_train(False)
    merged = from_pretrained(str(tmp_path / "merged"))
    merged.set_train(False)
    np.testing.assert_allclose(merged(ids).asnumpy(), trainer.model(ids).asnumpy(),
                               rtol=1e-4, atol=1e-4)
    assert main(["export", ckpt, str(tmp_path / "peft"), "--lora-only"]) == 2
    assert not os.path.exists(tmp_path / "peft" / "adapter_model.safetensors")


def _mx_cfg():
    from helpers.qwen3_next_parallel_common import Q3N_BASE, Q3N_CONFIG
    return load_config(Q3N_CONFIG, Q3N_BASE + ["--model.linear_num_value_heads", "16"])


def test_mxfp8_converts_deltanet_projections_and_matches_the_recipe():
    import mindspore as ms
    from mindspore.experimental.optim import AdamW
    from ms_llm.compat import manual_seed
    from ms_llm.models import GPTModel
    from ms_llm.quant import MXFP8Linear, apply_quantization
    from helpers.mx_reference import assert_close, qd
    cfg = _mx_cfg()
    quant = dataclasses.replace(cfg.quant, recipe="mxfp8")
    manual_seed(3)
    model = GPTModel(cfg.model)
    names = apply_quantization(model, quant)
    for i in (0, 2):
        for mod in ("in_proj_qkvz", "in_proj_ba", "out_proj"):
            assert f"decoder.layers.{i}.self_attention.{mod}" in names
    rng = np.random.default_rng(1)
    gdn = model.decoder.layers[0].self_attention
    for mod in (gdn.in_proj_qkvz, gdn.in_proj_ba, gdn.out_proj):
        assert isinstance(mod, MXFP8Linear)
        w = mod.weight.asnumpy()
        x = (rng.standard_normal((2, 7, w.shape[1])) * 2).astype(np.float32)
        want = qd(x.reshape(-1, w.shape[1]), -1, "float8_e4m3fn", quant.scale_mode) @ \
            qd(w, -1, "float8_e4m3fn", quant.scale_mode).T
        assert_close(mod(Tensor(x)).asnumpy().reshape(-1, w.shape[0]), want, "forward")
    ids = Tensor(np.random.default_rng(0).integers(0, 512, (1, 32)).astype(np.int32))
    params = model.trainable_params()
    opt = AdamW(params, lr=3e-3)
    gf = ms.value_and_grad(lambda t: model(t, labels=t).mean(), None, params)
    hist = []
    for _ in range(2):
        loss, grads = gf(ids)
        opt(grads)
        hist.append(float(loss))
    assert np.all(np.isfinite(hist)) and hist[-1] < hist[0], hist
