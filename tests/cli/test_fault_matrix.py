"""Fault-injection matrix (issue #33): bad inputs walked over the commands the docs show.

For every case: a non-zero exit with exactly one line on stderr and no traceback; no file
outside the case's output changed (inputs are hashed before and after); no output folder left
that looks complete (convert / export publish by renaming a temporary folder, so the output
is absent and no temporary folder is left behind). The CLI runs in-process
(``ms_llm.cli.main``); only the kill-during-convert case needs a subprocess. The documented
fallback (a corrupt newest checkpoint -> resume from the previous one) is
``test_checkpoint_integrity``.

Every checkpoint format (ms-llm's own, ``checkpoint.format torch``, a converted legacy Megatron
folder, torch_dist) meets every damage of ``helpers.checkpoint_damage`` twice: in
``ms-llm checkpoint verify`` (one FAILED line naming the file) and in the command that uses it
(``export``, ``train --training.resume auto``, ``convert`` mg -> hf: one error line, or for a
tracker naming no iteration the documented fallback to the newest ``iter_*``, said in one line).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import time

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from helpers.checkpoint_damage import DAMAGE
from helpers.cli import with_key
from helpers.finetune_fixtures import make_hf_folder
from helpers.hf_fixtures import make_hf_checkpoint
from helpers.parallel_common import TINY_MODEL
from ms_llm.checkpoint.native import dcp
from ms_llm.checkpoint.native.dcp import LocalChunk
from ms_llm.cli import main as cli
from helpers.paths import ROOT

CONFIG = os.path.join(ROOT, "configs", "tiny.yaml")
TO_MG = ["convert", "--load-model-type", "hf", "--save-model-type", "mg"]
TO_HF = ["convert", "--load-model-type", "mg", "--save-model-type", "hf"]
TRAIN = TINY_MODEL + ["--training.micro_batch_size", "2", "--training.global_batch_size", "2",
                      "--training.progress_bar", "false", "--training.jit", "false",
                      "--training.max_steps", "1"]
LOADED = TRAIN[len(TINY_MODEL) - 2:]   # the --checkpoint.load folder defines the model
PEFT_Q = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
PEFT_CFG = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    """Inputs shared by the cases (never modified: a case copies what it damages)."""
    root = tmp_path_factory.mktemp("fault_inputs")
    make_hf_checkpoint(root / "hf", "qwen3", hidden=32, layers=2, heads=4, kv_heads=2, ffn=48,
                       vocab=101, seed=3)
    assert cli(TO_MG + ["--load-dir", str(root / "hf"), "--save-dir", str(root / "mg")]) == 0
    make_hf_folder(root / "hf_tok")   # with a tokenizer: train --checkpoint.load cases
    peft = root / "peft"
    peft.mkdir()
    (peft / "adapter_config.json").write_text(json.dumps(PEFT_CFG))
    rng = np.random.default_rng(0)
    save_file({PEFT_Q.format("A"): rng.standard_normal((2, 32)).astype(np.float32),
               PEFT_Q.format("B"): rng.standard_normal((32, 2)).astype(np.float32)},
              str(peft / "adapter_model.safetensors"))
    from ms_llm.config import load_config
    from ms_llm.training.trainer import Trainer
    Trainer(load_config(CONFIG, TRAIN + ["--training.output_dir", str(root / "run"),
                                         "--checkpoint.save_dir", str(root / "ckpt")])).fit()
    from ms_llm.checkpoint.megatron.train import export_legacy
    from ms_llm.checkpoint.torch_dist.train import export_torch_dist
    kw = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, global_batch_size=2)
    native = dcp.find_latest_complete(str(root / "ckpt"))
    export_legacy(native, str(root / "torch"), **kw)   # what checkpoint.format torch saves
    export_torch_dist(native, str(root / "torch_dist"), **kw)
    return root


def snapshot(root: str, skip: str) -> dict:
    """relative path -> sha1 of every file under ``root`` except under ``skip``."""
    out = {}
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if not os.path.join(d, x).startswith(skip)]
        for f in files:
            p = os.path.join(d, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = hashlib.sha1(fh.read()).hexdigest()
    return out


# ----------------------------------------------------------------------------- damage helpers
def copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def edit_config(folder, **changes):
    path = os.path.join(folder, "config.json")
    cfg = json.load(open(path))
    cfg.update(changes)
    json.dump(cfg, open(path, "w"))


def raw_config(folder, fn):
    path = os.path.join(folder, "config.json")
    text = open(path).read()
    open(path, "w").write(fn(text))


def rewrite_header(path, fn):
    data = open(path, "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    fn(header)
    blob = json.dumps(header).encode()
    blob += b" " * ((-len(blob)) % 8)
    open(path, "wb").write(struct.pack("<Q", len(blob)) + blob + data[8 + n:])


def alias_k_norm_onto_q_norm(header):
    q = header["model.layers.0.self_attn.q_norm.weight"]
    header["model.layers.0.self_attn.k_norm.weight"]["data_offsets"] = list(q["data_offsets"])


def poison(path, name, value=np.nan):
    t = load_file(path)
    t[name] = t[name].copy()
    t[name].reshape(-1)[0] = value
    save_file(t, path)


def add_tensor(path, name):
    t = load_file(path)
    t[name] = np.ones((2, 2), np.float32)
    save_file(t, path)


def flip_byte(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 4)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x01]))


def ckpt_shard(save_dir):
    it = dcp.find_latest_complete(str(save_dir))
    return os.path.join(it, "rank_00000.safetensors")


def tamper_state(save_dir, key, value):
    """Edit iteration 1's saved ``state`` in its ``metadata.json`` (its files stay intact)."""
    path = os.path.join(save_dir, "iter_0000001", "metadata.json")
    meta = json.load(open(path))
    meta["state"][key] = value
    json.dump(meta, open(path, "w"))
    return save_dir


def lora_ckpt_without_fingerprint(d, hf):
    a = np.ones((2, 32), np.float32)
    b = np.ones((32, 2), np.float32)
    pre = "decoder.layers.0.self_attention.linear_proj.lora_"
    dcp.save_checkpoint(str(d), 1, {pre + "A.weight": LocalChunk(a, a.shape),
                                    pre + "B.weight": LocalChunk(b, b.shape)},
                        {"step": 1, "lora": {"r": 2, "alpha": 4.0, "base": str(hf)}},
                        rank=0, world_size=1, barrier=lambda: None)
    return d


def peft(fx, t, cfg=None, tensors=None):
    d = copy(fx / "peft", t / "peft")
    if cfg is not None:
        (d / "adapter_config.json").write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
    if tensors:
        tensors(str(d / "adapter_model.safetensors"))
    return d


def blocked(t):
    """A regular file where a folder is wanted (root writes anywhere, so no chmod)."""
    (t / "blocker").write_text("a file, not a folder")
    return t / "blocker"


def yaml_file(t, text):
    p = t / "run.yaml"
    p.write_text(text)
    return p


# ----------------------------------------------------------------------------- the matrix
# id -> builder(fx, case_dir, out) -> (argv, pattern the one error line must match)
def _hf(fx, t, fn=None, src="hf"):
    d = copy(fx / src, t / "hf")
    if fn:
        fn(d)
    return d


CASES = {
    # convert: HF config.json
    "config-not-object": lambda fx, t, o: (
        TO_MG + ["--load-dir", _hf(fx, t, lambda d: (d / "config.json").write_text("[1, 2]"))],
        "config.json: expected a JSON object"),
    "layers-string": lambda fx, t, o: (
        TO_MG + ["--load-dir", _hf(fx, t, lambda d: edit_config(d, num_hidden_layers="4"))],
        "num_hidden_layers must be an integer, got '4'"),
    "hidden-fraction": lambda fx, t, o: (
        TO_MG + ["--load-dir", _hf(fx, t, lambda d: edit_config(d, hidden_size=64.5))],
        "hidden_size must be an integer, got 64.5"),
    "layers-1e9": lambda fx, t, o: (
        TO_MG + ["--load-dir", _hf(fx, t, lambda d: raw_config(d, lambda s: re.sub(
            r'"num_hidden_layers": \d+', '"num_hidden_layers": 1e9', s)))],
        "num_hidden_layers must be an integer, got 1000000000.0"),
    "layers-huge": lambda fx, t, o: (
        TO_MG + ["--load-dir", _hf(fx, t, lambda d: edit_config(d, num_hidden_layers=10 ** 9))],
        r"num_hidden_layers = 1000000000 is outside \[1, 4096\]"),
    "config-duplicate-key": lambda fx, t, o: (
        TO_MG + ["--load-dir", _hf(fx, t, lambda d: raw_config(
            d, lambda s: s.replace("{", '{"hidden_size": 64, ', 1)))],
        "key 'hidden_size' given twice"),
    "config-nan-literal": lambda fx, t, o: (
        TO_MG + ["--load-dir", _hf(fx, t, lambda d: raw_config(
            d, lambda s: s.replace("{", '{"rms_norm_eps": NaN, ', 1)))],
        "NaN is not valid JSON"),
    # convert: weights
    "truncated-shard": lambda fx, t, o: (
        TO_MG + ["--load-dir", _hf(fx, t, lambda d: os.truncate(
            d / "model.safetensors", os.path.getsize(d / "model.safetensors") - 64))],
        "truncated"),
    "overlapping-ranges": lambda fx, t, o: (
        TO_MG + ["--load-dir", _hf(fx, t, lambda d: rewrite_header(
            d / "model.safetensors", alias_k_norm_onto_q_norm))],
        r"_norm.weight' bytes \[\d+, \d+\) overlap tensor '.*_norm.weight'"),
    "only-pytorch-bin": lambda fx, t, o: (
        TO_MG + ["--load-dir", _hf(fx, t, lambda d: (
            os.remove(d / "model.safetensors"), (d / "pytorch_model.bin").write_bytes(b"PK")))],
        "only pytorch_model.bin weights"),
    "nan-weight": lambda fx, t, o: (
        TO_MG + ["--load-dir", _hf(fx, t, lambda d: poison(
            str(d / "model.safetensors"), "model.layers.1.mlp.down_proj.weight"))],
        "decoder layer 1 mlp.linear_fc2.weight holds a non-finite value"),
    "missing-load-dir": lambda fx, t, o: (
        TO_MG + ["--load-dir", t / "nope"], "no such directory"),
    "mg-to-hf-fewer-layers": lambda fx, t, o: (
        TO_HF + ["--load-dir", (lambda d: (edit_config(d, num_hidden_layers=1), d)[1])(
            copy(fx / "mg", t / "mg"))],
        r"stored tensor\(s\) were not converted, e.g. .*decoder.layers.1"),
    # convert --lora-load: adapters
    "adapter-config-not-object": lambda fx, t, o: (
        TO_MG + ["--load-dir", fx / "hf", "--lora-load", peft(fx, t, "[]")],
        "adapter_config.json: expected a JSON object"),
    "adapter-r-zero": lambda fx, t, o: (
        TO_MG + ["--load-dir", fx / "hf", "--lora-load", peft(
            fx, t, {"peft_type": "LORA", "r": 0, "lora_alpha": 4})],
        r"r = 0 is outside \[1, 65536\]"),
    "adapter-alpha-inf": lambda fx, t, o: (
        TO_MG + ["--load-dir", fx / "hf", "--lora-load", peft(
            fx, t, '{"peft_type": "LORA", "r": 2, "lora_alpha": 1e999}')],
        "lora_alpha = inf is outside"),
    "adapter-rank-mismatch": lambda fx, t, o: (
        TO_MG + ["--load-dir", fx / "hf", "--lora-load", peft(
            fx, t, {"peft_type": "LORA", "r": 4, "lora_alpha": 4})],
        r"do not have rank r = 4"),
    "adapter-nan-tensor": lambda fx, t, o: (
        TO_MG + ["--load-dir", fx / "hf", "--lora-load", peft(
            fx, t, tensors=lambda p: poison(p, PEFT_Q.format("B"), np.inf))],
        "lora_B holds a non-finite value"),
    "adapter-layers-to-transform": lambda fx, t, o: (
        TO_MG + ["--load-dir", fx / "hf", "--lora-load", peft(
            fx, t, dict(PEFT_CFG, layers_to_transform=[1]))],
        r"the adapters hold layer 0 self_attn.q_proj, but layers_to_transform is \[1\]"),
    "adapter-layers-pattern": lambda fx, t, o: (
        TO_MG + ["--load-dir", fx / "hf", "--lora-load", peft(
            fx, t, dict(PEFT_CFG, layers_to_transform=[0], layers_pattern="h"))],
        "layers_pattern = 'h' is not supported"),
    "adapter-target-modules": lambda fx, t, o: (
        TO_MG + ["--load-dir", fx / "hf", "--lora-load", peft(
            fx, t, dict(PEFT_CFG, target_modules=["v_proj"]))],
        r"hold model.layers.0.self_attn.q_proj, which target_modules \['v_proj'\] does not"),
    **{f"adapter-{key}": (lambda key, value: lambda fx, t, o: (
        TO_MG + ["--load-dir", fx / "hf", "--lora-load", peft(
            fx, t, dict(PEFT_CFG, **{key: value}))],
        rf"adapter_config.json: {key} = .* is not supported \("))(key, value)
       for key, value in [("modules_to_save", ["lm_head"]), ("use_dora", True),
                          ("rank_pattern", {"q_proj": 4}), ("alpha_pattern", {"q_proj": 8}),
                          ("fan_in_fan_out", True), ("bias", "all"),
                          ("layer_replication", [[0, 1]])]},
    "adapter-unknown-field": lambda fx, t, o: (
        TO_MG + ["--load-dir", fx / "hf", "--lora-load", peft(
            fx, t, dict(PEFT_CFG, use_new_thing=True))],
        "use_new_thing = True is not a field ms-llm knows"),
    "adapter-huge-finite-tensor": lambda fx, t, o: (
        TO_MG + ["--load-dir", fx / "hf", "--lora-load", peft(
            fx, t, tensors=lambda p: poison(p, PEFT_Q.format("B"), 3e38))],
        r"lora_B holds 3e\+38, above the bound 10000 for a LoRA factor"),
    "adapter-alpha-overflows-merge": lambda fx, t, o: (
        TO_MG + ["--load-dir", fx / "hf", "--lora-load", peft(
            fx, t, dict(PEFT_CFG, lora_alpha=1e300))],
        r"layer 0 self_attention.linear_qkv.weight: the merged weight overflows float32"),
    "adapter-checkpoint-without-base-fingerprint": lambda fx, t, o: (
        TO_MG + ["--load-dir", fx / "hf", "--lora-load",
                 lora_ckpt_without_fingerprint(t / "lora_ckpt", fx / "hf") / "iter_0000001"],
        "records no base fingerprint"),
    # export: training checkpoints
    "export-corrupt-shard": lambda fx, t, o: (
        ["export", (lambda d: (flip_byte(ckpt_shard(d)), dcp.find_latest_complete(
            str(d), verify="size"))[1])(copy(fx / "ckpt", t / "ckpt")), o],
        "crc32 differs from the metadata"),
    "export-garbage-metadata": lambda fx, t, o: (
        ["export", (lambda d: ((d / "iter_0000001" / "metadata.json").write_bytes(b"\xff{"),
                               d)[1])(copy(fx / "ckpt", t / "ckpt")), o],
        "no complete checkpoint found"),
    # train: run YAML and save_dir
    "yaml-duplicate-key": lambda fx, t, o: (
        ["train", yaml_file(t, "training:\n  max_steps: 1\n  max_steps: 2\n")],
        r"key 'max_steps' given twice \(lines 2 and 3\)"),
    "yaml-duplicate-section": lambda fx, t, o: (
        ["train", yaml_file(t, "training:\n  max_steps: 1\nmodel: {}\ntraining: {}\n")],
        "key 'training' given twice"),
    "yaml-layers-huge": lambda fx, t, o: (
        ["train", yaml_file(t, "model:\n  num_layers: 1000000000\n")],
        r"config error: .*model.num_layers = 1000000000 is above the bound 4096"),
    "train-into-unverified-checkpoints": lambda fx, t, o: (
        ["train", CONFIG, *TRAIN, "--training.output_dir", o, "--training.resume", "auto",
         "--checkpoint.save_dir", (lambda d: (flip_byte(ckpt_shard(d)), d)[1])(
             copy(fx / "ckpt", t / "ckpt"))],
        "do not verify and none to resume from"),
    "train-resume-tampered-consumed-samples": lambda fx, t, o: (
        ["train", CONFIG, *TRAIN, "--training.output_dir", o, "--training.resume", "auto",
         "--checkpoint.save_dir", tamper_state(copy(fx / "ckpt", t / "ckpt"), "data",
                                               {"consumed_samples": -16})],
        r"iter_0000001/metadata.json: state.data.consumed_samples must be a non-negative "
        r"integer, got -16"),
    "train-resume-other-shape": lambda fx, t, o: (
        ["train", CONFIG, *with_key(TRAIN, "model.ffn_hidden_size", "96"),
         "--training.output_dir", o, "--training.resume", "auto", "--checkpoint.save_dir",
         copy(fx / "ckpt", t / "ckpt")],
        r"checkpoint error: .*has global shape \[\d+, \d+\], the model wants"),
    "train-fresh-into-other-model": lambda fx, t, o: (
        ["train", CONFIG, *with_key(TRAIN, "model.ffn_hidden_size", "96"),
         "--training.output_dir", o, "--checkpoint.save_dir", copy(fx / "ckpt", t / "ckpt")],
        r"belongs to another model \(model.ffn_hidden_size 128 there, 96 in this run\)"),
    "train-fresh-into-other-run": lambda fx, t, o: (
        ["train", CONFIG, *TRAIN, "--training.seed", "7", "--training.output_dir", o,
         "--checkpoint.save_dir", copy(fx / "ckpt", t / "ckpt")],
        r"checkpoint error: checkpoint.save_dir .*ckpt: holds the checkpoints of run [0-9a-f]{32} "
        r"\(newest iter_0000001\) and this run resumes nothing; continue it with "
        r"--training.resume auto, or give this run a new --checkpoint.save_dir"),
    "train-output-dir-unwritable": lambda fx, t, o: (
        ["train", CONFIG, *TRAIN, "--training.output_dir", blocked(t) / "out"],
        r"config error: training.output_dir .*blocker/out: cannot write there \(Not a directory\)"),
    "train-save-dir-unwritable": lambda fx, t, o: (
        ["train", CONFIG, *TRAIN, "--training.output_dir", o,
         "--checkpoint.save_dir", blocked(t) / "ckpt"],
        r"config error: checkpoint.save_dir .*blocker/ckpt: cannot write there"),
    "train-load-truncated-hf": lambda fx, t, o: (
        ["train", CONFIG, *LOADED, "--training.output_dir", o, "--data.tokenizer",
         fx / "hf_tok" / "tokenizer.json", "--checkpoint.load",
         _hf(fx, t, lambda d: os.truncate(d / "model.safetensors",
                                          os.path.getsize(d / "model.safetensors") - 64),
             "hf_tok")],
        r"config error: checkpoint.load .*model.safetensors: cannot read safetensors .*truncated"),
    "train-load-only-pytorch-bin": lambda fx, t, o: (
        ["train", CONFIG, *LOADED, "--training.output_dir", o, "--data.tokenizer",
         fx / "hf_tok" / "tokenizer.json", "--checkpoint.load",
         _hf(fx, t, lambda d: (os.remove(d / "model.safetensors"),
                               (d / "pytorch_model.bin").write_bytes(b"PK")), "hf_tok")],
        r"config error: checkpoint.load .*only pytorch_model.bin weights"),
    "train-load-extra-tensors": lambda fx, t, o: (
        ["train", CONFIG, *LOADED, "--training.output_dir", o, "--data.tokenizer",
         fx / "hf_tok" / "tokenizer.json", "--checkpoint.load",
         _hf(fx, t, lambda d: add_tensor(str(d / "model.safetensors"),
                                         "model.layers.9.mlp.extra.weight"), "hf_tok")],
        r"config error: checkpoint.load .*model.layers.9.mlp.extra.weight"),
    "train-key-given-twice": lambda fx, t, o: (
        ["train", CONFIG, *TRAIN, "--training.max_steps", "3", "--training.output_dir", o],
        r"config error: command line: key 'training.max_steps' given twice "
        r"\(--training.max_steps 1 and --training.max_steps 3\)"),
    # generate / chat flags (checked before any model is loaded)
    **{f"{cmd}{flag}{value}": (lambda cmd, flag, value: lambda fx, t, o: (
        [cmd, "--load", fx / "hf", *(["--prompt", "hi"] if cmd == "generate" else []),
         flag, value], rf"^ms-llm {cmd}: {flag} = {value}(\.0)? is outside"))(cmd, flag, value)
       for cmd, flag, value in [("generate", "--top-p", "5"), ("generate", "--temperature", "-1"),
                                ("generate", "--max-context", "-3"),
                                ("generate", "--max-new-tokens", "-1"),
                                ("chat", "--max-new-tokens", "-1"), ("chat", "--top-k", "-2")]},
    # other commands the docs show
    "plan-yaml-duplicate-key": lambda fx, t, o: (
        ["plan", yaml_file(t, "training:\n  max_steps: 1\n  max_steps: 2\n"), "--nproc", "2"],
        r"^ms-llm plan: .*key 'max_steps' given twice"),
    "schedule-yaml-duplicate-key": lambda fx, t, o: (
        ["schedule", yaml_file(t, "parallel: {}\nparallel: {}\n")],
        r"^ms-llm schedule: .*key 'parallel' given twice"),
    "preprocess-missing-input": lambda fx, t, o: (
        ["preprocess", "--input", t / "nope.jsonl", "--tokenizer-name-or-path", t / "tok",
         "--output-prefix", t / "out" / "ds"], "^ms-llm preprocess: --input not found"),
    "qualify-unknown-cell": lambda fx, t, o: (
        ["qualify", "--cells", "qwen3:nope", "--out", o], "unknown cell 'qwen3:nope'"),
    "checkpoint-verify-missing": lambda fx, t, o: (
        ["checkpoint", "verify", t / "nope"], "no such directory"),
    "plot-missing": lambda fx, t, o: (["plot", t / "nope"], "ms-llm plot: "),
}


# ----------------------------------------------------------------------------- formats x damage
FOLDER = {"native": "ckpt", "torch": "torch", "legacy": "mg", "torch_dist": "torch_dist"}
# what the one line names, per format and damage
NAMED = {
    "native": {"flipped-tensor-byte": r"rank_00000.safetensors: crc32 differs",
               "truncated": r"rank_00000.safetensors has \d+ bytes, .*truncated",
               "missing-file": r"rank_00000.safetensors is missing",
               "garbage-metadata": r"metadata.json: (unreadable|invalid JSON)"},
    "torch_dist": {"flipped-tensor-byte": r"__0_0.distcp bytes \d+\.\.\d+: entry .*CRC-32",
                   "truncated": r"__0_0.distcp: truncated",
                   "missing-file": r"__0_0.distcp: listed in .metadata but missing",
                   "garbage-metadata": r"/\.metadata: not a torch_dist metadata file"},
}
NAMED["torch"] = NAMED["legacy"] = {
    "flipped-tensor-byte": r"model_optim_rng.pt: entry model_optim_rng/data/\d+: CRC-32",
    "truncated": r"model_optim_rng.pt: not a torch zip checkpoint or truncated",
    "missing-file": r"mp_rank_00/model_optim_rng.pt:? (is )?missing",
    "garbage-metadata": r"model_optim_rng.pt: .*data.pkl.*(CRC|corrupt)"}
for _fmt in NAMED:
    NAMED[_fmt]["tracker-no-iteration"] = \
        r"latest_checkpointed_iteration.txt: .*(names no iteration|expected an iteration)"
GRID = [(f, d) for f in FOLDER for d in DAMAGE]


def damaged(fx, t, fmt, damage):
    d = copy(fx / FOLDER[fmt], t / FOLDER[fmt])
    DAMAGE[damage](str(d), "torch" if fmt == "legacy" else fmt)
    return d


def _use(fmt, damage):
    """The command that uses a damaged checkpoint of ``fmt``, and whether it must fail (else:
    the documented fallback, exit 0 with the damage said on stdout)."""
    def build(fx, t, o):
        d = damaged(fx, t, fmt, damage)
        if fmt == "legacy":
            return TO_HF + ["--load-dir", d, "--save-dir", o]
        if fmt == "native" and damage != "tracker-no-iteration":
            return ["export", d / "iter_0000001", o]
        return ["train", CONFIG, *TRAIN, "--training.output_dir", o, "--training.resume", "auto",
                "--checkpoint.format", "torch_dist" if fmt == "torch_dist" else
                ("torch" if fmt == "torch" else "ms_llm"), "--checkpoint.save_dir", d]
    return build, fmt == "legacy" or damage != "tracker-no-iteration"


for _fmt, _damage in GRID:
    _build, _fails = _use(_fmt, _damage)
    if _fails:
        _why = NAMED[_fmt][_damage]
        if _fmt in ("torch", "torch_dist"):
            _why = r"do not verify and none to resume from \(.*" + _why
        CASES[f"{_fmt}-{_damage}"] = (lambda b, w: lambda fx, t, o: (b(fx, t, o), w))(
            _build, _why)


@pytest.mark.parametrize("fmt,damage", GRID)
def test_checkpoint_verify_names_the_damage(fmt, damage, fx, tmp_path, capsys):
    """``ms-llm checkpoint verify``: exit 1 and one FAILED line naming the damaged file."""
    d = damaged(fx, tmp_path, fmt, damage)
    capsys.readouterr()
    rc = cli(["checkpoint", "verify", str(d)])
    out, err = capsys.readouterr()
    failed = [ln for ln in out.splitlines() if ": FAILED: " in ln]
    assert rc == 1 and "Traceback" not in err, out + err
    assert len(failed) == 1, out
    assert re.search(NAMED[fmt][damage], failed[0]), failed[0]


@pytest.mark.parametrize("fmt", [f for f, d in GRID if not _use(f, d)[1]])
def test_tracker_naming_no_iteration_falls_back_to_the_newest_iteration(fmt, fx, tmp_path,
                                                                       capsys):
    """The documented fallback: resume says the tracker names no iteration and continues from
    the newest ``iter_*`` that verifies (here iteration 1 = max_steps: nothing left to train)."""
    argv = [str(a) for a in _use(fmt, "tracker-no-iteration")[0](fx, tmp_path,
                                                                 str(tmp_path / "out"))]
    capsys.readouterr()
    rc = cli(argv)
    out, err = capsys.readouterr()
    assert rc in (0, None) and "Traceback" not in err, out + err
    said = [ln for ln in out.splitlines() if "latest_checkpointed_iteration.txt" in ln]
    assert len(said) == 1 and re.search("not-an-iteration", said[0]), out
    assert re.search(r"resumed from .*iter_0000001 at step 1", out), out


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input(case, fx, tmp_path, capsys):
    out = str(tmp_path / "out")
    argv, pattern = CASES[case](fx, tmp_path, out)
    argv = [str(a) for a in argv]
    if argv[0] in ("convert",) and "--save-dir" not in argv:
        argv += ["--save-dir", out]
    before = snapshot(str(tmp_path), out), snapshot(str(fx), out)
    capsys.readouterr()
    rc = cli(argv)
    err = capsys.readouterr().err
    lines = [ln for ln in err.strip().splitlines() if ln.strip()
             and not ln.startswith("[WARNING] ME(")]
    assert rc not in (0, None), err
    assert "Traceback" not in err
    assert len(lines) == 1, err
    assert re.search(pattern, lines[0]), lines[0]
    assert (snapshot(str(tmp_path), out), snapshot(str(fx), out)) == before, \
        "an input file changed"
    if argv[0] in ("convert", "export"):
        assert not os.path.exists(out)
        assert not [n for n in os.listdir(tmp_path) if n.startswith("out.tmp")]


def test_kill_during_convert_leaves_no_output_that_looks_complete(tmp_path):
    """SIGKILL while ``ms-llm convert`` writes: ``--save-dir`` is absent (only the temporary
    ``<save-dir>.tmp-<pid>`` exists), or, if the conversion won the race, complete."""
    src = tmp_path / "hf"
    make_hf_checkpoint(src, "llama", hidden=256, layers=8, heads=4, kv_heads=4, ffn=1024,
                       vocab=4000, seed=1)
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ms_llm.cli", *TO_MG, "--load-dir", str(src), "--save-dir",
         str(out), "--target-tensor-parallel-size", "2"],
        env={**os.environ, "PYTHONPATH": ROOT}, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    deadline, killed = time.time() + 120, False
    while time.time() < deadline and proc.poll() is None:
        if [n for n in os.listdir(tmp_path) if n.startswith("out.tmp-")]:
            proc.send_signal(signal.SIGKILL)
            killed = True
            break
        time.sleep(0.002)
    proc.wait(timeout=60)
    if killed and proc.returncode == -signal.SIGKILL:
        assert not out.exists(), "a killed conversion left a --save-dir"
    else:   # finished before the kill: the output is complete
        assert proc.returncode == 0
        assert cli([*TO_HF, "--load-dir", str(out), "--save-dir", str(tmp_path / "back")]) == 0


def test_kill_during_save_leaves_only_checkpoints_that_verify(tmp_path):
    """SIGKILL while ``ms-llm train`` writes a checkpoint (its ``.tmp_iter_*`` folder exists):
    every ``iter_*`` folder left verifies (crc32), so resume and ``ms-llm checkpoint verify``
    see only complete checkpoints."""
    save = tmp_path / "ckpt"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ms_llm.cli", "train", CONFIG, *TRAIN[:-1], "50",
         "--training.output_dir", str(tmp_path / "run"), "--checkpoint.save_dir", str(save),
         "--checkpoint.save_interval", "1"],
        env={**os.environ, "PYTHONPATH": ROOT}, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    deadline, killed = time.time() + 300, False
    while time.time() < deadline and proc.poll() is None:
        done = [n for n in os.listdir(save) if n.startswith("iter_")] if save.exists() else []
        if done and [n for n in os.listdir(save) if n.startswith(".tmp_iter_")]:
            proc.send_signal(signal.SIGKILL)   # a save after the first one is under way
            killed = True
            break
        time.sleep(0.002)
    proc.wait(timeout=60)
    assert killed, "the run ended before a save could be interrupted"
    iters = sorted(n for n in os.listdir(save) if n.startswith("iter_"))
    assert iters
    for n in iters:
        assert dcp.check_complete(str(save / n), verify="crc") is None, n
    assert cli(["checkpoint", "verify", str(save)]) == 0
