"""Megatron-Core ``torch_dist`` checkpoints read and written without torch, against megatron-core's
own ``dist_checkpointing`` (``tests/helpers/mcore_dist_ckpt.py``, a one-process gloo group on CPU):
a checkpoint megatron-core saves reads here tensor-equal to its model's state_dict, and one
written here loads in megatron-core tensor-equal to what was written. The layout-free part:
a tensor saved as several chunks (as tensor-parallel ranks save it) reads back whole.
"""
import os

import numpy as np
import pytest

from helpers.mcore_run import mcore
from ms_llm.checkpoint.torch_dist.io import TorchDistReader, TorchDistWriter, is_torch_dist_dir
from ms_llm.checkpoint.torch_dist.model import (read_state, read_training_state, write_state,
                                                write_training_state)

pytest.importorskip("megatron.core")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("torch_dist")
    return root, mcore("save", root / "mcore", root / "mcore.npz")


def test_megatron_core_checkpoint_reads_here(saved):
    root, want = saved
    assert is_torch_dist_dir(str(root / "mcore"))
    reader = TorchDistReader(str(root / "mcore"))
    got = read_state(reader)
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    assert reader.common["iteration"] == 7


def test_checkpoint_written_here_loads_in_megatron_core(saved, tmp_path):
    _, ref = saved
    rng = np.random.default_rng(0)
    state = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in ref.items()}
    w = TorchDistWriter(str(tmp_path / "ours"))
    write_state(w, state)
    w.close({"iteration": 3})
    got = mcore("load", tmp_path / "ours", tmp_path / "loaded.npz")
    assert sorted(got) == sorted(state)
    for k in state:
        np.testing.assert_array_equal(got[k], state[k], err_msg=k)
    assert TorchDistReader(str(tmp_path / "ours")).common == {"iteration": 3}


def test_a_tensor_saved_in_chunks_reads_whole(tmp_path):
    full = np.arange(2 * 6 * 4, dtype=np.float32).reshape(2, 6, 4)
    w = TorchDistWriter(str(tmp_path / "c"))
    for layer in range(2):            # per layer, rows in two halves (as tp=2 ranks write them)
        for half in range(2):
            w.add("decoder.layers.mlp.linear_fc2.weight", full.shape, (layer, 3 * half, 0),
                  full[layer:layer + 1, 3 * half:3 * half + 3])
    w.close({})
    got = read_state(TorchDistReader(str(tmp_path / "c")))
    np.testing.assert_array_equal(got["decoder.layers.1.mlp.linear_fc2.weight"], full[1])


def test_training_checkpoint_with_adam_state_both_ways(tmp_path):
    """Model, Adam moments and the step: megatron-core's save reads here; written here, they
    load in megatron-core (moments keyed by the model's Megatron names)."""
    want = mcore("save_train", tmp_path / "mc", tmp_path / "mc.npz")
    got = read_training_state(TorchDistReader(str(tmp_path / "mc")))
    assert got["iteration"] == 2 and int(got["optimizer"]["step"]) == int(want["step"]) == 2
    for k, v in want.items():
        if k == "step":
            continue
        have = got["optimizer"][k] if k.startswith("exp_avg") else got["model"][k]
        np.testing.assert_array_equal(have, v, err_msg=k)
    rng = np.random.default_rng(1)
    model = {k: v + 1 for k, v in got["model"].items()}
    optim = {k: rng.random(np.shape(v)).astype(np.float32) if k != "step" else np.int64(5)
             for k, v in got["optimizer"].items()}
    write_training_state(TorchDistWriter(str(tmp_path / "ours")), model, optim, iteration=5,
                         scheduler={"num_steps": 20, "max_lr": 1e-3})
    back = mcore("load_train", tmp_path / "ours", tmp_path / "back.npz")
    assert float(back["step"]) == 5
    for k, v in {**model, **{k: v for k, v in optim.items() if k != "step"}}.items():
        np.testing.assert_array_equal(back[k], v, err_msg=k)
    again = read_training_state(TorchDistReader(str(tmp_path / "ours")))
    assert again["opt_param_scheduler"] == {"num_steps": 20, "max_lr": 1e-3}


@pytest.fixture(scope="module")
def legacy_saved(tmp_path_factory):
    """megatron-core's model after 2 AdamW steps, saved as Megatron-LM's legacy file."""
    root = tmp_path_factory.mktemp("legacy")
    return root / "mc", mcore("save_legacy", root / "mc", root / "mc.npz")


def test_legacy_training_checkpoint_both_ways(tmp_path, legacy_saved):
    """``--ckpt-format torch`` (tp = pp = 1, non-distributed optimizer): the file Megatron-LM
    writes (torch AdamW over megatron-core's ``_get_param_groups``) reads here with each moment
    on its parameter; written here, ``torch.load`` + ``load_state_dict`` of the model and the
    torch optimizer built from megatron-core's param groups take it, tensors equal."""
    from ms_llm.checkpoint.native import dcp
    from ms_llm.checkpoint.megatron.train import export_legacy, import_legacy, latest_legacy
    from ms_llm.checkpoint.torch_dist.train import read_training_dcp, write_training_dcp
    folder, want = legacy_saved
    found = latest_legacy(str(folder))
    assert found == (str(folder / "iter_0000002"), 2)
    path, state = import_legacy(found[0], str(tmp_path / "ms"), {}, gated=True,
                                global_batch_size=4)
    assert state["step"] == 2 and state["data"] == {"consumed_samples": 8}
    assert state["opt_param_scheduler"]["num_steps"] == 8 and state["optimizer_step"] == 2
    model, optim, _, step = read_training_dcp(path)
    assert step == 2
    for k, v in want.items():
        if k in ("step", "group_sizes", "group_names"):
            continue
        np.testing.assert_array_equal(optim[k] if k.startswith("exp_avg") else model[k], v,
                                      err_msg=k)
    rng = np.random.default_rng(3)
    model = {k: v - 1 for k, v in model.items()}
    optim = {k: rng.random(np.shape(v)).astype(np.float32) if k != "step" else np.int64(7)
             for k, v in optim.items()}
    mine, _ = write_training_dcp(str(tmp_path / "ms2"), model, optim, 7,
                                 {"num_steps": 28}, 28, {}, True, 4, "test")
    export_legacy(mine, str(tmp_path / "back"), lr=1e-3, betas=(0.9, 0.95), eps=1e-8,
                  weight_decay=0.1, global_batch_size=4)
    os.rename(tmp_path / "back" / "iter_0000007", tmp_path / "back" / "iter_0000002")
    back = mcore("load_legacy", tmp_path / "back", tmp_path / "back.npz")
    assert float(back["step"]) == 7 and list(back["group_sizes"]) == list(want["group_sizes"])
    for k, v in {**model, **{k: v for k, v in optim.items() if k != "step"}}.items():
        np.testing.assert_array_equal(back[k], v, err_msg=k)
    assert dcp.DCPReader(mine).state["data"] == {"consumed_samples": 28}


def _tp2(name: str, x: np.ndarray) -> list:
    """Tensor-parallel rank shards of a Megatron tensor (the rules Megatron's ranks hold):
    vocab and ``linear_qkv`` rows (whole KV groups) split, ``linear_proj`` / ``linear_fc2``
    columns split, ``linear_fc1`` as ``[gate_r; up_r]``, 1-D tensors replicated."""
    if x.ndim == 1:
        return [x, x]
    if name.endswith("linear_fc1.weight"):
        gate, up = np.split(x, 2)
        return [np.concatenate([g, u]) for g, u in zip(np.split(gate, 2), np.split(up, 2))]
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return np.split(x, 2, axis=1)
    return np.split(x, 2)


def test_legacy_tp2_training_checkpoint_reads_whole(tmp_path, legacy_saved):
    """A tp=2 legacy training checkpoint (Megatron-LM's per-rank files: each rank's shards and
    its torch AdamW state in megatron-core's param-group order, written with ``torch.save``)
    reads here as the tp=1 state it was split from, weights and moments exactly."""
    import argparse
    import torch
    from ms_llm.checkpoint.megatron.train import import_legacy
    from ms_llm.checkpoint.torch_dist.train import read_training_dcp
    want = legacy_saved[1]
    order, sizes = [str(n) for n in want["group_names"]], list(want["group_sizes"])
    args = argparse.Namespace(
        num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
        group_query_attention=True, num_query_groups=2, kv_channels=16, vocab_size=64,
        padded_vocab_size=64, max_position_embeddings=128, norm_epsilon=1e-6,
        rotary_base=1e6, untie_embeddings_and_output_weights=True, qk_layernorm=True,
        tensor_model_parallel_size=2, pipeline_model_parallel_size=1, model_type_hf="qwen3",
        consumed_train_samples=8, iteration=2)
    it = tmp_path / "tp2" / "iter_0000002"
    for r in range(2):
        model = {k: torch.from_numpy(_tp2(k, want[k])[r].copy()) for k in order}
        state = {i: {"step": torch.tensor(float(want["step"])),
                     **{m: torch.from_numpy(_tp2(k, want[f"{m}.{k}"])[r].copy())
                        for m in ("exp_avg", "exp_avg_sq")}} for i, k in enumerate(order)}
        groups = [{"lr": 1e-3, "params": list(range(sum(sizes[:g]), sum(sizes[:g + 1])))}
                  for g in range(len(sizes))]
        (it / f"mp_rank_{r:02d}").mkdir(parents=True)
        torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 2, "model": model,
                    "optimizer": {"state": state, "param_groups": groups}},
                   str(it / f"mp_rank_{r:02d}" / "model_optim_rng.pt"))
    (tmp_path / "tp2" / "latest_checkpointed_iteration.txt").write_text("2")
    path, state = import_legacy(str(it), str(tmp_path / "ms"), {}, gated=True,
                                global_batch_size=4)
    model, optim, _, step = read_training_dcp(path)
    assert step == 2 and state["optimizer_step"] == 2 and sorted(model) == sorted(order)
    for k in order:
        np.testing.assert_array_equal(model[k], want[k], err_msg=k)
        for m in ("exp_avg", "exp_avg_sq"):
            np.testing.assert_array_equal(optim[f"{m}.{k}"], want[f"{m}.{k}"], err_msg=k)
