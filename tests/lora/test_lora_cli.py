"""docs/guides/finetuning.md's LoRA commands end to end as a user types them (paths and a few size keys aside): an
HF folder -> ``ms-llm train`` with ``checkpoint.load`` + ``lora`` -> checkpoint ->
``ms-llm export`` (merged HF), ``--lora-only`` (PEFT layout), ``ms-llm convert --lora-load``
(merged Megatron) -> the merged folders compute the trained model's logits (rtol/atol 1e-4: the
merged weight W + s BA rounds once to fp32 where the trained model adds the two products in
fp32), checked with ms-llm and with transformers' own Qwen3 model.
"""
import json
import os

import numpy as np
from mindspore import Tensor

from helpers.cli import run_ms_llm
from helpers.finetune_fixtures import write_tokenizer
from helpers.hf_fixtures import make_hf_checkpoint

from ms_llm.config import load_config
from ms_llm.checkpoint import from_pretrained
from ms_llm.training.trainer import Trainer
from helpers.paths import ROOT

CONFIG = os.path.join(ROOT, "configs", "tiny.yaml")   # what `ms-llm train` uses with no file
SIZE = ["--data.seq_length", "16", "--training.micro_batch_size", "2",
        "--training.global_batch_size", "2", "--training.max_steps", "3",
        "--training.lr_warmup_steps", "1", "--training.lr", "0.01",
        "--training.progress_bar", "false"]


def ms_llm(cwd, *args, timeout=600):
    r = run_ms_llm(*args, cwd=cwd, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


def test_readme_lora_commands(tmp_path, monkeypatch):
    hf = tmp_path / "Qwen3-0.6B"          # a tiny stand-in under the docs' name
    make_hf_checkpoint(hf, "qwen3", hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16,
                       ffn=96, vocab=64, tied=False, seed=3)
    write_tokenizer(hf)
    (tmp_path / "corpus.txt").write_text("\n\n".join(" ".join(f"w{(i * j + j) % 30}"
                                                              for j in range(60))
                                                     for i in range(40)))
    extra = ["--data.corpus", "corpus.txt", "--training.output_dir", "run"] + SIZE
    train = ["--checkpoint.load", "Qwen3-0.6B", "--data.tokenizer", "Qwen3-0.6B",
             "--lora.r", "8", "--lora.alpha", "16", "--checkpoint.save_dir", "ckpt_lora"]
    out = ms_llm(tmp_path, "train", *train, *extra)
    assert "trainable params: " in out and "|| all params: " in out and "trainable%" in out
    ms_llm(tmp_path, "export", "ckpt_lora", "qwen3_lora_merged")
    ms_llm(tmp_path, "export", "ckpt_lora", "qwen3_lora_peft", "--lora-only")
    ms_llm(tmp_path, "convert", "--load-model-type", "hf", "--save-model-type", "mg",
           "--load-dir", "Qwen3-0.6B", "--lora-load", "ckpt_lora", "--save-dir", "qwen3_lora_mg")
    assert sorted(os.listdir(tmp_path / "qwen3_lora_peft")) == ["adapter_config.json",
                                                                "adapter_model.safetensors"]
    assert json.load(open(tmp_path / "qwen3_lora_peft" / "adapter_config.json"))["r"] == 8

    # the trained model: the run's own checkpoint resumed onto the base, in this process
    monkeypatch.chdir(tmp_path)   # restored after the test: later tests run scripts by relative path
    trainer = Trainer(load_config(CONFIG, train + extra + ["--training.resume", "auto"]))
    assert trainer.step == 3
    trainer.model.set_train(False)
    ids = np.arange(24, dtype=np.int32).reshape(2, 12) % 32
    trained = trainer.model(Tensor(ids)).asnumpy()
    for folder in ("qwen3_lora_merged", "qwen3_lora_mg"):
        m = from_pretrained(str(tmp_path / folder))
        m.set_train(False)
        np.testing.assert_allclose(m(Tensor(ids)).asnumpy(), trained, rtol=1e-4, atol=1e-4,
                                   err_msg=folder)
    base = from_pretrained(str(hf))
    base.set_train(False)
    assert not np.allclose(base(Tensor(ids)).asnumpy(), trained, atol=1e-3)   # it trained

    import torch  # test extra (cross-check only)
    import transformers
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "qwen3_lora_merged"), dtype=torch.float32)
    with torch.no_grad():
        logits = ref(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(logits, trained, rtol=1e-4, atol=1e-4)
