"""LoRA on the DeepSeek-router families: GLM-4.5 (routers with an expert bias, shared experts, a
first dense layer) and DeepSeek-V3 (the same plus multi-head latent attention, whose linears are
targeted by MindSpeed-LLM's DeepSeek names: ``linear_qkv`` = the down-projections it fuses, and
``linear_q_up_proj`` / ``linear_kv_up_proj``). A tiny transformers-built model is trained two LoRA
steps, merged, exported to Hugging Face and loaded by transformers' own model (the independent
reference): it gives the trained model's logits. DeepSeek-V3's PEFT export (HF module names) is
applied to the base by the formula PEFT documents, W + (alpha / r) B A, in torch: the same logits.

GLM-4.5 trains with the aux-loss-free expert-bias update on: the bias is a router buffer that
training keeps updating under the frozen base, so the merged export must carry it (it once kept
the base's, and GLM-4.5's qualify LoRA cell failed (b) by 8e-3), and a PEFT export, which cannot
carry it, is refused. DeepSeek-V3 trains with the update off, so its PEFT adapters are the whole
change.

Tolerance: max |dL| <= 1e-4 x max |L| (qualify's LoRA bound: fp32, the merged export rounds
W + (alpha/r) B A once where the adapter forward rounds twice; measured ~2e-7 relative). A wrong
merge, a lost adapter or the base's expert bias moves the logits by >= 1e-2 relative.
"""
import os

import numpy as np
import pytest

from helpers.deepseek_fixtures import DEEPSEEK_BASE, GLM_BASE, build_hf
from helpers.finetune_fixtures import write_tokenizer
from helpers.paths import ROOT

from ms_llm.config import load_config
from ms_llm.training.trainer import Trainer

pytestmark = pytest.mark.slow     # two tiny MoE trainings: ~30 s each on 2 shared cores

CONFIG = os.path.join(ROOT, "configs", "tiny.yaml")   # the loaded folder defines the model
RUN = ["--data.seq_length", "16", "--training.micro_batch_size", "2",
       "--training.global_batch_size", "2", "--training.progress_bar", "false",
       "--training.lr_warmup_steps", "1", "--training.log_interval", "1",
       "--training.jit", "false", "--training.lr", "0.01", "--training.min_lr", "0.0",
       "--training.max_steps", "2", "--lora.r", "4", "--lora.alpha", "8"]
# HF config, extra training keys
CASES = {
    "glm45": ("glm4_moe", dict(GLM_BASE, vocab_size=64),
              ("--model.moe_router_bias_update_rate", "0.05")),
    "deepseek-v3": ("deepseek_v3", dict(DEEPSEEK_BASE, vocab_size=64),
                    ("--model.moe_router_bias_update_rate", "0", "--lora.target_modules",
                     "linear_qkv,linear_q_up_proj,linear_kv_up_proj,linear_proj,linear_fc1,"
                     "linear_fc2")),
}


def _corpus(path) -> None:
    path.write_text("\n\n".join(" ".join(f"w{(i * j + j) % 30}" for j in range(60))
                                for i in range(40)))


_RUNS = {}     # case -> (name, trainer, folder): each case trains once for every test


def _trained(name, tmp_path_factory):
    if name not in _RUNS:
        tmp_path = tmp_path_factory.mktemp(name)
        kind, kwargs, extra = CASES[name]
        build_hf(kind, kwargs, seed=3).save_pretrained(str(tmp_path / "hf"))
        write_tokenizer(tmp_path / "hf")
        _corpus(tmp_path / "corpus.txt")
        cfg = load_config(CONFIG, ["--checkpoint.load", str(tmp_path / "hf"), "--data.tokenizer",
                                   str(tmp_path / "hf"), "--data.corpus",
                                   str(tmp_path / "corpus.txt"), *RUN, *extra,
                                   "--training.output_dir", str(tmp_path / "run"),
                                   "--checkpoint.save_dir", str(tmp_path / "save")])
        trainer = Trainer(cfg)
        trainer.fit()
        trainer.model.set_train(False)
        _RUNS[name] = (name, trainer, tmp_path)
    return _RUNS[name]


@pytest.fixture(scope="module", params=sorted(CASES))
def trained(request, tmp_path_factory):
    return _trained(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def glm45(tmp_path_factory):
    """GLM-4.5 with the expert bias updated in training (its PEFT export is refused)."""
    return _trained("glm45", tmp_path_factory)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """DeepSeek-V3 with every MLA linear targeted and the expert bias frozen."""
    return _trained("deepseek-v3", tmp_path_factory)


def _transformers_logits(folder, ids):
    import torch
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder),
                                                              torch_dtype=torch.float32)
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        return model.eval()(torch.tensor(ids.astype(np.int64))).logits.numpy()


def test_merged_export_reloads_equal_in_transformers(trained):
    from mindspore import Tensor
    from safetensors.numpy import load_file
    from ms_llm.cli import main
    name, trainer, tmp = trained
    ids = np.random.default_rng(20260).integers(0, 32, (2, 16)).astype(np.int32)
    want = trainer.model(Tensor(ids)).asnumpy()
    assert main(["export", str(tmp / "save"), str(tmp / "merged")]) == 0
    got = _transformers_logits(tmp / "merged", ids)
    err, scale = float(np.abs(got - want).max()), float(np.abs(want).max())
    assert err <= 1e-4 * scale, (name, err, scale)
    base, merged = load_file(str(tmp / "hf" / "model.safetensors")), \
        load_file(str(tmp / "merged" / "model.safetensors"))
    moved = [k for k in base if k.endswith("e_score_correction_bias")
             and not np.array_equal(base[k], merged[k])]
    changed = sorted(k.split(".", 3)[3] for k in base if not np.array_equal(base[k], merged[k]))
    if name == "glm45":     # the run moved the expert bias (else this test misses the bug)
        assert moved, name
    else:                   # every targeted latent-attention linear was merged
        assert not moved
        for hf in ("q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "kv_b_proj", "o_proj"):
            assert f"self_attn.{hf}.weight" in changed, (hf, changed)
        assert "mlp.gate_proj.weight" in changed            # the first, dense layer's MLP
        assert not any("experts" in k for k in changed)     # experts carry no adapter


def test_peft_export_refuses_a_moved_expert_bias(glm45, capsys):
    from ms_llm.cli import main
    _, _, tmp = glm45
    assert main(["export", str(tmp / "save"), str(tmp / "peft"), "--lora-only"]) == 2
    err = capsys.readouterr().err.strip()
    assert "e_score" not in err and "mlp.router.expert_bias was updated in training" in err, err
    assert not os.path.exists(tmp / "peft")


def test_peft_export_applied_in_torch_equals_the_trained_model(deepseek):
    import json
    import torch
    import transformers
    from mindspore import Tensor
    from safetensors.torch import load_file
    from ms_llm.cli import main
    _, trainer, tmp = deepseek
    assert main(["export", str(tmp / "save"), str(tmp / "peft"), "--lora-only"]) == 0
    cfg = json.loads((tmp / "peft" / "adapter_config.json").read_text())
    adapters = load_file(str(tmp / "peft" / "adapter_model.safetensors"))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp / "hf"),
                                                              torch_dtype=torch.float32)
    model.config._attn_implementation = "eager"
    weights = dict(model.named_parameters())
    prefix = "base_model.model."
    with torch.no_grad():
        for key in [k for k in adapters if k.endswith(".lora_A.weight")]:
            module = key[len(prefix):-len(".lora_A.weight")]
            b = adapters[key.replace("lora_A", "lora_B")]
            weights[module + ".weight"] += cfg["lora_alpha"] / cfg["r"] * (b @ adapters[key])
    hf_modules = {k.split(".")[-3] for k in adapters}
    assert {"q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "kv_b_proj", "o_proj"} <= hf_modules
    ids = np.random.default_rng(20260).integers(0, 32, (2, 16)).astype(np.int32)
    want = trainer.model(Tensor(ids)).asnumpy()
    with torch.no_grad():
        got = model.eval()(torch.tensor(ids.astype(np.int64))).logits.numpy()
    err, scale = float(np.abs(got - want).max()), float(np.abs(want).max())
    assert err <= 1e-4 * scale, (err, scale)


def test_peft_folder_merges_to_the_merged_export(deepseek):
    """``convert --lora-load PEFT_FOLDER`` (the per-HF-module path) gives the weights
    ``ms-llm export`` merged from the checkpoint (float64 sums stored in fp32: rtol 1e-6)."""
    from safetensors.numpy import load_file
    from ms_llm.cli import main
    _, _, tmp = deepseek
    if not (tmp / "peft").exists():
        assert main(["export", str(tmp / "save"), str(tmp / "peft"), "--lora-only"]) == 0
    if not (tmp / "merged").exists():
        assert main(["export", str(tmp / "save"), str(tmp / "merged")]) == 0
    assert main(["convert", "--load-model-type", "hf", "--save-model-type", "hf", "--load-dir",
                 str(tmp / "hf"), "--save-dir", str(tmp / "from_peft"), "--lora-load",
                 str(tmp / "peft"), "--lora-target-modules", "linear_qkv", "linear_q_up_proj",
                 "linear_kv_up_proj", "linear_proj", "linear_fc1", "linear_fc2"]) == 0
    got = load_file(str(tmp / "from_peft" / "model.safetensors"))
    want = load_file(str(tmp / "merged" / "model.safetensors"))
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-7, err_msg=k)
