"""LoRA: the ``lora:`` section, the adapter module against a numpy reference, target selection
and the trainable count, MXFP8 bases, ``adapters_disabled``, and the file side: merged export
equals ``W + (alpha/r) B A`` computed here in numpy, PEFT's layout, ``convert --lora-load``, lr 0
exports the input bit for bit, resume checks the base.

Tolerances: the adapter forward is fp32 against a float64 numpy reference (rtol 1e-5: fp32
rounding of two small matmuls); merged weights are float64 sums stored in fp32 on both sides
(rtol 1e-6 allows one rounding step of a differently ordered sum).
"""
import json
import os
import shutil

import numpy as np
import pytest
from mindspore import Tensor
from safetensors.numpy import load_file

from helpers.finetune_fixtures import write_tokenizer
from helpers.hf_fixtures import make_hf_checkpoint

from ms_llm.config import ConfigError, load_config
from ms_llm.lora import adapters_disabled, apply_lora, count_parameters, select_targets
from ms_llm.lora.modules import LoRALinear, is_frozen_base
from ms_llm.models import GPTModel
from ms_llm.checkpoint import from_pretrained
from ms_llm.training.trainer import Trainer
from helpers.paths import ROOT

CONFIG = os.path.join(ROOT, "configs", "tiny.yaml")
RUN = ["--data.seq_length", "16", "--training.micro_batch_size", "2",
       "--training.global_batch_size", "2", "--training.progress_bar", "false",
       "--training.lr_warmup_steps", "1", "--training.log_interval", "1",
       "--training.jit", "false", "--training.lr", "0.01", "--training.min_lr", "0.0"]
# qwen3: 4 heads in 2 KV groups of head dim 16 (GQA, so the qkv split is non-trivial)
NH, NG, D, H, FFN = 4, 2, 16, 64, 96


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    make_hf_checkpoint(root / "hf", "qwen3", hidden=H, layers=2, heads=NH, kv_heads=NG,
                       head_dim=D, ffn=FFN, vocab=64, tied=False, seed=7)
    write_tokenizer(root / "hf")
    (root / "corpus.txt").write_text("\n\n".join(" ".join(f"w{(i * j + j) % 30}"
                                                           for j in range(60)) for i in range(40)))
    return root


def lora_cfg(root, out, *extra):
    return load_config(CONFIG, ["--checkpoint.load", str(root / "hf"), "--data.tokenizer",
                                str(root / "hf"), "--data.corpus", str(root / "corpus.txt"),
                                *RUN, "--training.output_dir", str(out / "run"),
                                "--checkpoint.save_dir", str(out / "save"), "--lora.r", "4",
                                "--lora.alpha", "8", *extra])


# ------------------------------------------------------------------------------ config
def one_line_error(root, tmp_path, *extra) -> str:
    with pytest.raises(ConfigError) as e:
        lora_cfg(root, tmp_path, *extra)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_config_rules(base, tmp_path):
    cfg = load_config(CONFIG, [])
    assert cfg.lora.r == 0 and "lora" in cfg.to_dict()
    assert "lora.flavour" in one_line_error(base, tmp_path, "--lora.flavour", "x")
    msg = one_line_error(base, tmp_path, "--lora.target_modules", "linear_qkv,q_proj")
    assert "lora.target_modules" in msg and "'q_proj'" in msg
    assert "lora.dropout" in one_line_error(base, tmp_path, "--lora.dropout", "1.0")
    assert "lora.alpha" in one_line_error(base, tmp_path, "--lora.alpha", "0")
    with pytest.raises(ConfigError, match="lora.r > 0 needs checkpoint.load"):
        load_config(CONFIG, ["--lora.r", "8"])


# ------------------------------------------------------------------------------ module
def small_model(**kw):
    cfg = load_config(CONFIG, ["--model.num_layers", "2", "--model.hidden_size", "64",
                               "--model.ffn_hidden_size", "96", "--model.num_attention_heads",
                               "4", "--model.num_query_groups", "2", "--model.kv_channels", "16",
                               "--model.padded_vocab_size", "64", "--training.jit", "false",
                               *[str(a) for kv in kw.items() for a in kv]])
    return cfg, GPTModel(cfg.model)


class _L:
    def __init__(self, r=4, alpha=8.0, dropout=0.0, targets=("linear_qkv",)):
        self.r, self.alpha, self.dropout, self.target_modules = r, alpha, dropout, list(targets)


def test_adapter_forward_matches_numpy_and_disables():
    _, model = small_model()
    names = apply_lora(model, _L(targets=["linear_qkv", "linear_fc2"]), seed=3)
    assert names == [f"decoder.layers.{i}.{m}" for i in range(2)
                     for m in ("self_attention.linear_qkv", "mlp.linear_fc2")]
    m = dict(model.cells_and_names())["decoder.layers.1.self_attention.linear_qkv"]
    assert isinstance(m, LoRALinear)
    a = m.lora_A.weight.asnumpy()
    assert a.shape == (4, 64) and np.abs(a).max() <= 1 / np.sqrt(64)      # PEFT's kaiming bound
    assert not np.any(m.lora_B.weight.asnumpy())
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 5, 64)).astype(np.float32)
    base_only = m(Tensor(x)).asnumpy()
    w = m.weight.asnumpy().astype(np.float64)
    np.testing.assert_allclose(base_only, x @ w.T, rtol=1e-5, atol=1e-5)
    b = rng.standard_normal(m.lora_B.weight.shape).astype(np.float32)
    m.lora_B.weight.set_data(Tensor(b))
    want = x @ w.T + (8.0 / 4) * (x.astype(np.float64) @ a.T.astype(np.float64)) @ b.T
    np.testing.assert_allclose(m(Tensor(x)).asnumpy(), want, rtol=1e-5, atol=1e-5)
    with adapters_disabled(model):
        np.testing.assert_array_equal(m(Tensor(x)).asnumpy(), base_only)
    np.testing.assert_allclose(m(Tensor(x)).asnumpy(), want, rtol=1e-5, atol=1e-5)


def test_targets_globs_and_trainable_count():
    _, model = small_model()
    base_params = {n: p for n, p in model.parameters_and_names()}
    total0 = count_parameters(model)[1]
    names = apply_lora(model, _L(r=2, targets=["decoder.layers.*.self_attention.linear_proj",
                                               "linear_fc1"]), seed=0)
    assert names == ["decoder.layers.0.self_attention.linear_proj", "decoder.layers.0.mlp.linear_fc1",
                     "decoder.layers.1.self_attention.linear_proj", "decoder.layers.1.mlp.linear_fc1"]
    # r * (in + out) per adapted module: proj 64->64, fc1 64->2*96
    want = 2 * (2 * (64 + 64) + 2 * (64 + 192))
    trainable, total = count_parameters(model)
    assert trainable == want and total == total0 + want
    after = dict(model.parameters_and_names())
    for n, p in base_params.items():      # same objects, frozen, nothing copied
        assert after[n] is p and not p.requires_grad and is_frozen_base(p)
    with pytest.raises(ValueError, match="matches no"):
        select_targets(small_model()[1], ["decoder.layers.9.*.linear_qkv"])
    with pytest.raises(ValueError, match="selects no module"):
        apply_lora(small_model()[1], _L(targets=[]))


def test_moe_experts_are_not_adapted():
    _, model = small_model(**{"--model.mlp_type": "moe", "--model.num_moe_experts": "4",
                              "--model.moe_ffn_hidden_size": "32"})
    names = apply_lora(model, _L(targets=["linear_qkv", "linear_fc1", "linear_fc2"]), seed=0)
    assert names == [f"decoder.layers.{i}.self_attention.linear_qkv" for i in range(2)]
    with pytest.raises(ValueError, match="experts is not built"):
        select_targets(model, ["*.local_experts.*.linear_fc1"])


def test_mxfp8_base_keeps_its_recipe():
    from ms_llm.quant import MXFP8Linear, apply_quantization
    cfg, model = small_model(**{"--quant.recipe": "mxfp8"})
    apply_quantization(model, cfg.quant)
    apply_lora(model, _L(targets=["linear_fc2"]), seed=0)
    m = dict(model.cells_and_names())["decoder.layers.0.mlp.linear_fc2"]
    assert m.base_type == MXFP8Linear.__name__
    rng = np.random.default_rng(1)
    x = Tensor(rng.standard_normal((3, 96)).astype(np.float32))
    b = rng.standard_normal(m.lora_B.weight.shape).astype(np.float32)
    m.lora_B.weight.set_data(Tensor(b))
    mx_only = MXFP8Linear(m.weight)(x).asnumpy()
    delta = 2.0 * (x.asnumpy().astype(np.float64) @ m.lora_A.weight.asnumpy().T) @ b.T
    np.testing.assert_allclose(m(x).asnumpy(), mx_only + delta, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------ files
def split_qkv(w):
    """Megatron's per-group rows [q (nh/ng*d) | k (d) | v (d)] -> HF q, k, v (independent)."""
    g = w.reshape(NG, (NH // NG + 2) * D, -1)
    q = g[:, :NH // NG * D].reshape(NH * D, -1)
    return q, g[:, NH // NG * D:NH // NG * D + D].reshape(NG * D, -1), \
        g[:, NH // NG * D + D:].reshape(NG * D, -1)


def adapters_of(ckpt):
    """(A, B) per Megatron module from a saved checkpoint (fc1's B stored as :gate/:up)."""
    from ms_llm.checkpoint.native.load import DCPReader
    r = DCPReader(ckpt)
    out = {}
    for i in range(2):
        for mod in ("self_attention.linear_qkv", "self_attention.linear_proj",
                    "mlp.linear_fc1", "mlp.linear_fc2"):
            p = f"decoder.layers.{i}.{mod}."
            b = np.concatenate([r.read(p + "lora_B.weight:gate"), r.read(p + "lora_B.weight:up")]) \
                if mod == "mlp.linear_fc1" else r.read(p + "lora_B.weight")
            out[(i, mod)] = (r.read(p + "lora_A.weight").astype(np.float64), b.astype(np.float64))
    names = r.names()
    r.close()
    return out, names


def expected_merged(base_dir, ad, scale):
    """HF tensors of the merged model, from the base and (A, B) in numpy."""
    w = load_file(os.path.join(base_dir, "model.safetensors"))
    out = dict(w)
    for i in range(2):
        p = f"model.layers.{i}."
        a, b = ad[(i, "self_attention.linear_qkv")]
        for hf, bp in zip(("q_proj", "k_proj", "v_proj"), split_qkv(b)):
            out[p + f"self_attn.{hf}.weight"] = w[p + f"self_attn.{hf}.weight"] + scale * bp @ a
        a, b = ad[(i, "self_attention.linear_proj")]
        out[p + "self_attn.o_proj.weight"] = w[p + "self_attn.o_proj.weight"] + scale * b @ a
        a, b = ad[(i, "mlp.linear_fc1")]
        out[p + "mlp.gate_proj.weight"] = w[p + "mlp.gate_proj.weight"] + scale * b[:FFN] @ a
        out[p + "mlp.up_proj.weight"] = w[p + "mlp.up_proj.weight"] + scale * b[FFN:] @ a
        a, b = ad[(i, "mlp.linear_fc2")]
        out[p + "mlp.down_proj.weight"] = w[p + "mlp.down_proj.weight"] + scale * b @ a
    return {k: v.astype(np.float32) for k, v in out.items()}


def test_lr0_export_is_the_input_and_peft_layout(base, tmp_path):
    from ms_llm.cli import main
    cfg = lora_cfg(base, tmp_path, "--training.max_steps", "2", "--training.lr", "0",
                   "--training.min_lr", "0")
    Trainer(cfg).fit()
    ckpt = tmp_path / "save" / "iter_0000002"
    _, names = adapters_of(str(ckpt))
    assert not any(n.endswith("linear_qkv.weight") or "embedding" in n for n in names)
    assert main(["export", str(tmp_path / "save"), str(tmp_path / "hf0")]) == 0
    got, want = load_file(str(tmp_path / "hf0" / "model.safetensors")), \
        load_file(str(base / "hf" / "model.safetensors"))
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].tobytes() == want[k].tobytes(), k
    assert os.path.isfile(tmp_path / "hf0" / "tokenizer.json")
    moved = tmp_path / "moved"                     # --base: the same base somewhere else
    shutil.copytree(base / "hf", moved)
    assert main(["export", str(ckpt), str(tmp_path / "hf1"), "--base", str(moved)]) == 0
    (moved / "config.json").write_text((moved / "config.json").read_text() + "\n")
    assert main(["export", str(ckpt), str(tmp_path / "hf2"), "--base", str(moved)]) == 2
    assert not os.path.exists(tmp_path / "hf2")
    # PEFT's layout: its key names, HF module shapes, the config PEFT reads
    assert main(["export", str(ckpt), str(tmp_path / "peft"), "--lora-only"]) == 0
    ad = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    shapes = {"q_proj": (NH * D, H), "k_proj": (NG * D, H), "v_proj": (NG * D, H),
              "o_proj": (H, NH * D), "gate_proj": (FFN, H), "up_proj": (FFN, H),
              "down_proj": (H, FFN)}
    want_keys = {}
    for i in range(2):
        for mod, (out_f, in_f) in shapes.items():
            attn = mod in ("q_proj", "k_proj", "v_proj", "o_proj")
            k = f"base_model.model.model.layers.{i}.{'self_attn' if attn else 'mlp'}.{mod}"
            want_keys[k + ".lora_A.weight"] = (4, in_f)
            want_keys[k + ".lora_B.weight"] = (out_f, 4)
    assert {k: v.shape for k, v in ad.items()} == want_keys
    pc = json.load(open(tmp_path / "peft" / "adapter_config.json"))
    assert pc["peft_type"] == "LORA" and pc["task_type"] == "CAUSAL_LM" and pc["r"] == 4
    assert pc["lora_alpha"] == 8 and sorted(pc["target_modules"]) == sorted(shapes)
    assert pc["base_model_name_or_path"] == str(base / "hf")


def test_merged_export_convert_and_resume(base, tmp_path):
    from ms_llm.cli import main
    trainer = Trainer(lora_cfg(base, tmp_path, "--training.max_steps", "3"))
    trainer.fit()
    ckpt = str(tmp_path / "save" / "iter_0000003")
    ad, _ = adapters_of(ckpt)
    assert all(np.any(b) for _, b in ad.values())        # every adapter trained
    assert main(["export", ckpt, str(tmp_path / "merged")]) == 0
    got = load_file(str(tmp_path / "merged" / "model.safetensors"))
    want = expected_merged(str(base / "hf"), ad, 8.0 / 4)
    base_w = load_file(str(base / "hf" / "model.safetensors"))
    for k, v in want.items():
        if "proj" in k:
            np.testing.assert_allclose(got[k], v, rtol=1e-6, atol=1e-7, err_msg=k)
            assert not np.array_equal(got[k], base_w[k]), k
        else:   # norms, embedding, head: the base's bits
            assert got[k].tobytes() == base_w[k].tobytes(), k
    # MindSpeed's flag: merging during conversion gives the same weights
    assert main(["convert", "--load-model-type", "hf", "--save-model-type", "hf", "--load-dir",
                 str(base / "hf"), "--save-dir", str(tmp_path / "conv"), "--lora-load",
                 str(tmp_path / "save"), "--lora-r", "4", "--lora-alpha", "8",
                 "--lora-target-modules", "linear_fc2", "linear_qkv", "linear_fc1",
                 "linear_proj"]) == 0
    conv = load_file(str(tmp_path / "conv" / "model.safetensors"))
    assert all(conv[k].tobytes() == got[k].tobytes() for k in got)
    assert main(["convert", "--load-model-type", "hf", "--save-model-type", "hf", "--load-dir",
                 str(base / "hf"), "--save-dir", str(tmp_path / "conv2"), "--lora-load", ckpt,
                 "--lora-r", "8"]) == 2
    assert main(["convert", "--load-model-type", "hf", "--save-model-type", "hf", "--load-dir",
                 str(base / "hf"), "--save-dir", str(tmp_path / "conv2"), "--lora-load", ckpt,
                 "--lora-target-modules", "linear_qkv"]) == 2
    assert not os.path.exists(tmp_path / "conv2")
    # the PEFT folder merges to the same weights (q/k/v from the shared A, rows of B)
    assert main(["export", ckpt, str(tmp_path / "peft"), "--lora-only"]) == 0
    assert main(["convert", "--load-model-type", "hf", "--save-model-type", "hf", "--load-dir",
                 str(base / "hf"), "--save-dir", str(tmp_path / "conv3"), "--lora-load",
                 str(tmp_path / "peft")]) == 0
    conv3 = load_file(str(tmp_path / "conv3" / "model.safetensors"))
    for k in got:
        np.testing.assert_allclose(conv3[k], got[k], rtol=1e-6, atol=1e-7, err_msg=k)
    # the merged folder computes what the trained model computes; adapters off = the base
    ids = Tensor(np.arange(16, dtype=np.int32).reshape(1, 16) % 32)
    trainer.model.set_train(False)
    trained = trainer.model(ids).asnumpy()
    merged = from_pretrained(str(tmp_path / "merged"))
    merged.set_train(False)
    np.testing.assert_allclose(merged(ids).asnumpy(), trained, rtol=1e-4, atol=1e-4)
    plain = from_pretrained(str(base / "hf"))
    plain.set_train(False)
    with adapters_disabled(trainer.model):
        np.testing.assert_allclose(trainer.model(ids).asnumpy(), plain(ids).asnumpy(),
                                   rtol=1e-6, atol=1e-6)
    # resume: the adapters come back onto the same base; a changed base is refused
    resumed = Trainer(lora_cfg(base, tmp_path, "--training.max_steps", "3",
                               "--training.resume", "auto"))
    assert resumed.step == 3
    resumed.model.set_train(False)
    np.testing.assert_array_equal(resumed.model(ids).asnumpy(), trained)
    other = tmp_path / "other"
    shutil.copytree(base / "hf", other)
    with open(other / "config.json", "a") as f:
        f.write("\n")
    cfg = lora_cfg(base, tmp_path, "--training.resume", "auto", "--checkpoint.load", str(other))
    with pytest.raises(ConfigError, match="a different base"):
        Trainer(cfg)
