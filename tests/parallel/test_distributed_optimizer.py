"""The distributed optimizer (``parallel.use_distributed_optimizer``): shard layout, checkpoint
regions, per-rank state size, and training under msrun equal to plain data parallel.

Tolerance of the msrun comparisons: rtol 1e-5 on loss and grad norm (as
tests/parallel/test_parallel_training.py): the distributed optimizer sums the same gradients in
another
order (a reduce-scatter composed of scatters and a rank-ordered sum instead of an all-reduce,
norms summed shard by shard), i.e. fp32 rounding (~1e-7 relative per step) that Adam's
normalised update can amplify a little. Single-process comparisons are exact (same kernels,
same order).
"""
import os
import shutil

import numpy as np
import pytest
from mindspore import Parameter, Tensor

from helpers.msrun import run_spec as spec, run_worker_job
from helpers.parallel_common import BASE, CONFIG, MOE, run_record

from ms_llm.config import ConfigError, load_config
from ms_llm.parallel.distributed_optimizer import row_shape, shard_rows
from ms_llm.parallel.fsdp.flat import FlatLayout
from ms_llm.parallel.placement import (Mesh, Placement, RowShard, add_shard, checkpoint_regions,
                                       set_placement, stored_view, writes_checkpoint)
from ms_llm.training.trainer import Trainer

RTOL = 1e-5
DO = ["--parallel.use_distributed_optimizer", "true"]
# Five steps with the LR schedule of five, so 3 saved + 2 resumed steps continue one curve.
STEPS = ["--training.max_steps", "5", "--training.lr_decay_steps", "5", "--training.jit", "false"]
SAVE_AT_3 = ["--training.max_steps", "3"]
MB2 = ["--training.micro_batch_size", "2"]
GROUPED = ["--model.moe_grouped_gemm", "true"]     # dp=4: 8 samples = 4 ranks x 1 micro-batch of 2


# ------------------------------------------------------------------ fast, single process
AWKWARD_SHAPES = [(257, 96), (200,), (5, 3), (2, 7), (1,), (96, 200), (3, 4, 5)]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_shard_layout_uneven_reduce_scatter_all_gather(world):
    """Simulated ranks: reduce-scatter (pack each rank's gradients, sum, cut) and all-gather
    (pack each rank's shard, unpack) through ``FlatLayout`` give every rank the chunk rule's
    rows of the summed gradient and every rank the full parameters; per-rank state is at most
    total / world plus one shard's padding."""
    rng = np.random.default_rng(world)
    full = [rng.standard_normal(s).astype(np.float32) for s in AWKWARD_SHAPES]
    grads = [[rng.standard_normal(s).astype(np.float32) for s in AWKWARD_SHAPES]
             for _ in range(world)]
    layouts = [FlatLayout(AWKWARD_SHAPES, world, r) for r in range(world)]
    flat_in = sum(layouts[r].pack_grads([Tensor(g) for g in grads[r]], Tensor(full[0]).dtype)
                  .asnumpy() for r in range(world))
    n = layouts[0].numel
    total = sum(int(np.prod(s)) for s in AWKWARD_SHAPES)
    held, pads = [], []
    for r in range(world):
        views = layouts[r].shard_views(Tensor(flat_in[r * n:(r + 1) * n]))
        real = 0
        for i, s in enumerate(AWKWARD_SHAPES):
            rs = RowShard(s[0], world, r)
            want = sum(g[i] for g in grads)[rs.start:rs.start + rs.length]
            np.testing.assert_allclose(views[i].asnumpy(), want, rtol=1e-6, atol=1e-6)
            real += want.size
        held.append(real)
        pads.append(n - real)
    assert sum(held) == total
    assert max(held) <= total / world + max(pads)       # total/dp + at most one shard's padding
    parts = [layouts[r].pack_shards(
        [Tensor(f[RowShard(f.shape[0], world, r).start:][:RowShard(f.shape[0], world, r).length])
         for f in full], Tensor(full[0]).dtype) for r in range(world)]
    for r in range(world):
        for got, want in zip(layouts[r].unpack_full(parts), full):
            np.testing.assert_array_equal(got.asnumpy(), want)


def _tile(global_arrays, pieces):
    """Write every (name, offsets, data) piece into zeros shaped like ``global_arrays``; check
    each element is written exactly once and the result equals the global arrays."""
    out = {k: np.zeros_like(v) for k, v in global_arrays.items()}
    count = {k: np.zeros(v.shape, np.int64) for k, v in global_arrays.items()}
    for name, off, data in pieces:
        sl = tuple(slice(o, o + s) for o, s in zip(off, data.shape))
        out[name][sl] = data
        count[name][sl] += 1
    for k in global_arrays:
        assert (count[k] == 1).all(), k
        np.testing.assert_array_equal(out[k], global_arrays[k])


def _mesh(**ranks_sizes):
    rank = {d: 0 for d in ("tp", "cp", "dp", "ep", "edp", "pp", "emb")}
    size = {d: 1 for d in rank}
    for d, (r, s) in ranks_sizes.items():
        rank[d], size[d] = r, s
    return Mesh(rank, size)


def _regions_of_shard(name, local: np.ndarray, pl: Placement, dim: str, mesh: Mesh):
    """The distributed optimizer's shard of a (tp/ep-local) tensor and its checkpoint pieces."""
    p = Parameter(Tensor(local), name=name)
    set_placement(p, pl)
    rows, rs = shard_rows(local.shape, pl, dim, mesh.size[dim], mesh.rank[dim])
    shard = local.reshape(rows)[rs.start:rs.start + rs.length]
    spl = add_shard(p, local.shape, dim, 0)
    if not rs.length:
        return []
    assert writes_checkpoint(spl, mesh)
    data = stored_view(shard, spl)
    return [(r.name, r.offsets, data[r.lstart:r.lstart + r.length])
            for r in checkpoint_regions(name, shard.shape, spl, mesh)]


@pytest.mark.parametrize("dp", [1, 2, 3, 4])
def test_checkpoint_regions_of_shards_tile_the_global_tensor(dp):
    """The moments' checkpoint regions (derived from the shard placements) of all dp ranks tile
    each global tensor exactly once: a plain tensor, a tensor-parallel ``[gate; up]`` weight
    (glu_halves, cut over dp after tp) and an expert-parallel grouped weight (row_blocks, cut
    along its stored rows over edp)."""
    rng = np.random.default_rng(dp)
    # plain, 7 uneven rows
    w = rng.standard_normal((7, 3)).astype(np.float32)
    pieces = []
    for d in range(dp):
        pieces += _regions_of_shard("w", w, Placement(), "dp", _mesh(dp=(d, dp)))
    _tile({"w": w}, pieces)
    # [gate; up] 2 x 5 rows, tp=2 (rank t holds [gate_t; up_t]), then cut over dp
    gate, up = (rng.standard_normal((10, 4)).astype(np.float32) for _ in range(2))
    pieces = []
    for t in range(2):
        local = np.concatenate([gate[t * 5:(t + 1) * 5], up[t * 5:(t + 1) * 5]])
        pl = Placement(shards=(("tp", 0),), layout="glu_halves", global_shape=(20, 4))
        for d in range(dp):
            pieces += _regions_of_shard("fc1", local, pl, "dp", _mesh(tp=(t, 2), dp=(d, dp)))
    _tile({"fc1:gate": gate, "fc1:up": up}, pieces)
    # an expert's [gate; up] (whole tensor on its ep rank), cut over expert-data parallel
    pieces = []
    local = np.concatenate([gate, up])
    pl = Placement(shards=(("ep", None),), layout="glu_halves", global_shape=(20, 4))
    for d in range(dp):
        pieces += _regions_of_shard("x_fc1", local, pl, "edp", _mesh(ep=(1, 2), edp=(d, dp)))
    _tile({"x_fc1:gate": gate, "x_fc1:up": up}, pieces)
    # grouped weight1 [H=3, E=4 experts x 2F=6], ep=2: rank e holds experts' memory blocks;
    # expert-data parallel = dp / ep ranks cut its stored rows (of width 2F)
    w1 = rng.standard_normal((3, 24)).astype(np.float32)
    blocks = w1.reshape(4, -1)
    pieces = []
    for e in range(2):
        local = np.ascontiguousarray(blocks[e * 2:(e + 1) * 2]).reshape(3, 12)
        pl = Placement(shards=(("ep", 1),), layout="row_blocks", row_width=6,
                       global_shape=(3, 24))
        assert row_shape(local.shape, pl, "edp") == (6, 6)
        for d in range(dp):
            pieces += _regions_of_shard("w1", local, pl, "edp",
                                        _mesh(ep=(e, 2), edp=(d, dp)))
    _tile({"w1": w1.reshape(-1, 6)}, pieces)


def test_config_refuses_fsdp_accepts_cp():
    """With FSDP: refused (FSDP already shards the state). With context parallel: accepted,
    the shards are cut over dp x cp (trained in
    tests/parallel/test_context_parallel_training.py)."""
    with pytest.raises(ConfigError, match="parallel.use_distributed_optimizer with "
                                          "parallel.fsdp_size > 1") as e:
        load_config(CONFIG, BASE + DO + ["--parallel.fsdp_size", "2"])
    assert "\n" not in str(e.value)
    cfg = load_config(CONFIG, BASE + DO + ["--parallel.context_parallel_size", "2"])
    assert cfg.parallel.use_distributed_optimizer and cfg.parallel.context_parallel_size == 2


def test_single_process_equals_adamw():
    """One rank: the distributed optimizer is AdamW on the model's own parameters (no copy)."""
    two = ["--training.max_steps", "2"]
    plain = Trainer(load_config(CONFIG, BASE + STEPS + two))
    dist = Trainer(load_config(CONFIG, BASE + STEPS + two + DO))
    assert dist.optimizer.state_bytes() == plain.optimizer.state_bytes()
    assert run_record(dist)["loss"] == run_record(plain)["loss"]


# ------------------------------------------------------------------ msrun: 4 workers
@pytest.fixture(scope="module")
def reference():
    dense = Trainer(load_config(CONFIG, BASE + STEPS))
    return {"moments": dense.optimizer.state_bytes()["exp_avg+exp_avg_sq"],
            "dense": run_record(dense),
            "moe": run_record(Trainer(load_config(CONFIG, BASE + MOE + GROUPED + STEPS)))}


def _match(run, ref, name, steps=slice(None)):
    for k in ("loss", "grad_norm"):
        np.testing.assert_allclose(run[k], ref[k][steps], rtol=RTOL, err_msg=f"{name} {k}")


def _state_bytes(trainer) -> int:
    return sum(trainer.optimizer.state_bytes().values())


@pytest.mark.msrun
def test_four_workers(tmp_path, reference):
    ck_do, ck_plain = str(tmp_path / "ck_do"), str(tmp_path / "ck_plain")
    tp2 = ["--parallel.tensor_model_parallel_size", "2"]
    resume = ["--training.resume", "auto"]
    res = run_worker_job("train_parallel.py", tmp_path, 4, [
        spec("dp4", STEPS, MB2, DO),
        spec("dp4_save", STEPS, MB2, DO, SAVE_AT_3, ["--checkpoint.save_dir", ck_do]),
        # saved at dp=4, resumed at tp=2 x dp=2
        spec("tp2_dp2_resume", STEPS, DO, tp2, resume, ["--checkpoint.save_dir", ck_do]),
        # a plain data-parallel checkpoint resumed with the distributed optimizer
        spec("dp4_plain_save", STEPS, MB2, SAVE_AT_3, ["--checkpoint.save_dir", ck_plain]),
        spec("dp4_from_plain", STEPS, MB2, DO, resume, ["--checkpoint.save_dir", ck_plain]),
        spec("tp2_sp_dp2", STEPS, DO, tp2, ["--parallel.sequence_parallel", "true"]),
        spec("pp2_dp2", STEPS, DO, ["--parallel.pipeline_model_parallel_size", "2"]),
        # grouped experts: weight1's shards are rows of its stored view over edp=2
        spec("ep2_edp2", MOE, GROUPED, STEPS, DO, ["--parallel.expert_model_parallel_size", "2"]),
    ])
    ref = reference["dense"]
    for name in ("dp4", "tp2_sp_dp2", "pp2_dp2"):
        _match(res[name], ref, name)
    for name in ("dp4_save", "dp4_plain_save"):
        _match(res[name], ref, name, slice(0, 3))
    for name in ("tp2_dp2_resume", "dp4_from_plain"):
        _match(res[name], ref, name, slice(3, 5))
    _match(res["ep2_edp2"], reference["moe"], "ep2_edp2")

    # Per-rank optimizer state: the single-process AdamW's moments split four ways (the tiny
    # model's row counts divide by 4, so no padding; the uneven bound is tested above), plus
    # the fp32 main-parameter shards (half the moments' bytes).
    moments = reference["moments"]
    assert res["dp4"]["optimizer_bytes"] == [moments * 3 // 2 // 4] * 4
    # tp=2 x dp=2: the two tensor-parallel ranks of one data-parallel rank together hold the
    # state of one dp=2 replica; each dp rank holds the same share
    tp_dp = res["tp2_sp_dp2"]["optimizer_bytes"]       # ranks: tp fastest
    assert tp_dp[0] == tp_dp[2] and tp_dp[1] == tp_dp[3]
    log0 = (tmp_path / "logs" / "worker_0.log").read_text(errors="replace")   # said at start
    assert "optimizer state per rank (moments + fp32 main-param shards): " + ", ".join(
        f"{b / 2 ** 20:.2f}" for b in res["dp4"]["optimizer_bytes"]) + " MiB" in log0
    # The dp=4 checkpoint (step 3) resumes in one process with plain AdamW (dp=1), continuing
    # the same curve.
    one = str(tmp_path / "ck_one")
    shutil.copytree(os.path.join(ck_do, "iter_0000003"), os.path.join(one, "iter_0000003"))
    run = run_record(Trainer(load_config(CONFIG, BASE + STEPS + resume + [
        "--checkpoint.save_dir", one])))
    _match(run, ref, "dp1 resume", slice(3, 5))

