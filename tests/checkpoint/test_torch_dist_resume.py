"""``checkpoint.format: torch_dist``: a run that saves Megatron-Core's torch_dist training
checkpoints resumes from its own (``training.resume auto``) exactly as from ms-llm's format, and
the torch_dist checkpoints it cannot take are refused in one line. The cross-lane direction
(megatron-core saves, ms-llm resumes, and back) is tests/training/test_cross_lane_curve.py."""
import os

import numpy as np
import pytest

from ms_llm.checkpoint.torch_dist.io import TorchDistWriter, is_torch_dist_dir
from ms_llm.checkpoint.torch_dist.train import import_torch_dist
from ms_llm.config import ConfigError, load_config
from helpers.parallel_common import CONFIG, TINY
from ms_llm.training.trainer import Trainer


def cfg(tmp_path, *extra):
    return load_config(CONFIG, TINY + ["--training.output_dir", str(tmp_path / "out"),
                                       "--training.lr_decay_steps", "4", *extra])


def losses(c):
    return [r["loss"] for r in Trainer(c).fit()]


def test_megatron_format_save_dirs_resume_exactly(tmp_path):
    """Steps 1-2 then a save, steps 3-4 resumed from it == 4 uninterrupted steps, for a
    torch_dist and a legacy torch save_dir (no dropout: the RNG they cannot carry does not
    matter; the tiny model ties its embedding, so the legacy order has no output layer)."""
    full = losses(cfg(tmp_path, "--training.max_steps", "4"))
    for fmt in ("torch_dist", "torch"):
        save = str(tmp_path / fmt)
        first = losses(cfg(tmp_path, "--training.max_steps", "2", "--checkpoint.save_dir", save,
                           "--checkpoint.format", fmt))
        assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read() == "2"
        it = os.path.join(save, "iter_0000002")
        assert is_torch_dist_dir(it) if fmt == "torch_dist" else \
            os.path.isfile(os.path.join(it, "mp_rank_00", "model_optim_rng.pt"))
        rest = losses(cfg(tmp_path, "--training.max_steps", "4", "--checkpoint.save_dir", save,
                          "--checkpoint.format", fmt, "--training.resume", "auto"))
        assert len(rest) == 2
        np.testing.assert_allclose(first + rest, full, rtol=1e-6, err_msg=fmt)


def test_a_distributed_optimizer_run_saves_the_layout_its_lane_loads(tmp_path):
    """``parallel.use_distributed_optimizer`` with ``checkpoint.format torch_dist``: the save is
    the DistributedOptimizer's ``fully_reshardable`` layout
    (tests/checkpoint/test_torch_dist_distopt.py
    loads that layout in megatron-core), and the run resumes from it exactly."""
    from ms_llm.checkpoint.torch_dist.io import TorchDistReader
    from ms_llm.checkpoint.torch_dist.distopt import sharding_type
    dist = ("--parallel.use_distributed_optimizer", "true")
    full = losses(cfg(tmp_path, "--training.max_steps", "4", *dist))
    save = str(tmp_path / "distopt")
    first = losses(cfg(tmp_path, "--training.max_steps", "2", "--checkpoint.save_dir", save,
                       "--checkpoint.format", "torch_dist", *dist))
    reader = TorchDistReader(os.path.join(save, "iter_0000002"))
    assert sharding_type(reader) == "fully_reshardable"
    assert reader.common["args"].use_distributed_optimizer
    assert "optimizer.state.param.output_layer.weight" in reader.tensors or \
        "optimizer.state.param.embedding.word_embeddings.weight" in reader.tensors
    rest = losses(cfg(tmp_path, "--training.max_steps", "4", "--checkpoint.save_dir", save,
                      "--checkpoint.format", "torch_dist", "--training.resume", "auto", *dist))
    np.testing.assert_allclose(first + rest, full, rtol=1e-6)


def _folder(tmp_path, keys):
    w = TorchDistWriter(str(tmp_path / "ck" / "iter_0000003"))
    for k in keys:
        w.add(k, (2, 2), (0, 0), np.zeros((2, 2), np.float32))
    w.close({"iteration": 3})
    return str(tmp_path / "ck" / "iter_0000003")


def test_what_cannot_be_resumed_is_one_line(tmp_path):
    path = _folder(tmp_path, ["output_layer.weight",
                              "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.param"])
    with pytest.raises(ValueError, match=r"iter_0000003: holds the distributed optimizer's "
                                         r"flat buffers \(optimizer.distributed"):
        import_torch_dist(path, str(tmp_path / "s"), {}, gated=True, global_batch_size=4)
    path = _folder(tmp_path, ["output_layer.weight"])
    with pytest.raises(ValueError, match=r"holds no Adam moments .*weights-only checkpoint"):
        import_torch_dist(path, str(tmp_path / "s"), {}, gated=True, global_batch_size=4)
    # a hybrid model's DeltaNet layers have no torch_dist names: refused before training, not
    # at its first save
    from ms_llm.models.families.qwen35.spec import QUALIFY_ARGS
    with pytest.raises(ConfigError, match=r"checkpoint.format torch_dist .*Gated DeltaNet "
                                          r"layers \(model.layer_types\) are not built"):
        Trainer(cfg(tmp_path, *QUALIFY_ARGS, "--checkpoint.format", "torch_dist",
                    "--checkpoint.save_dir", str(tmp_path / "hybrid")))
    os.makedirs(tmp_path / "empty")
    with pytest.raises(ConfigError, match=r"checkpoint.resume_from .*empty: not a Megatron "
                                          r"training checkpoint"):
        Trainer(cfg(tmp_path, "--training.max_steps", "1", "--checkpoint.resume_from",
                    str(tmp_path / "empty")))


def test_a_relaunch_resumes_its_own_save_not_the_lane_checkpoint(tmp_path):
    """``--load X --save X`` over the lane's torch_dist folder, saving ms-llm's format: once the
    run has saved there, a relaunch resumes its own newest checkpoint, not the lane's."""
    from ms_llm.checkpoint.native import dcp
    from ms_llm.checkpoint.native.format import LocalChunk
    from ms_llm.training.megatron_checkpoint import resume_source
    lane = _folder(tmp_path, ["output_layer.weight"])
    root = os.path.dirname(lane)
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("3")
    c = cfg(tmp_path, "--checkpoint.save_dir", root, "--checkpoint.resume_from", root,
            "--training.resume", "auto")
    assert resume_source(c) == lane
    dcp.save_checkpoint(root, 5, {"w": LocalChunk(np.zeros(2, np.float32), (2,))}, {},
                        rank=0, world_size=1, barrier=lambda: None)
    assert resume_source(c) is None
