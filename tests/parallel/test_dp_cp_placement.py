"""Sharding over data x context parallel (Megatron's dp-cp group): the ``dp_cp`` / ``edp_cp`` mesh
dims FSDP and the distributed optimizer cut over when cp > 1. Pure bookkeeping, checked against
the ranks ``ParallelState`` puts in those groups and against NumPy slicing (exact). Training
under msrun: tests/parallel/test_context_parallel_training.py (cp2_fsdp2, cp2_distopt)."""
import numpy as np
import pytest

from ms_llm.config import ConfigError, load_config
from ms_llm.parallel import comm
from ms_llm.parallel.fsdp import fsdp_group
from ms_llm.parallel.placement import (Mesh, Placement, checkpoint_regions, grad_replica_dims,
                                       norm_dims, writes_checkpoint)
from ms_llm.parallel.state import ParallelSizes, ParallelState


def _states(**sizes):
    s = ParallelSizes(**sizes)
    return [ParallelState(s, rank=r) for r in range(s.world)]


def test_mesh_index_is_the_rank_order_of_the_group():
    """A rank's ``dp_cp`` / ``edp_cp`` coordinate is its index in the sorted group of ranks
    that ``ParallelState`` builds (what the collectives use), on tp2 x cp2 x dp4 (ep2)."""
    for st in _states(tp=2, cp=2, ep=2, world=16):
        mesh = Mesh.of(st)
        for dim in ("dp_cp", "edp_cp"):
            ranks = st.ranks_along(dim)
            assert mesh.size[dim] == len(ranks), dim
            assert ranks[mesh.rank[dim]] == st.rank, (dim, st.rank)


@pytest.mark.parametrize("rows", [8, 7, 2])
def test_dp_cp_shards_tile_the_global_tensor_once(rows):
    """FSDP's dp_cp cut (chunk rule over dp x cp, uneven included) of a plain and a
    tensor-parallel ``[gate; up]`` weight (each half 2 x rows rows over tp 2): every rank writes
    its own rows, and the regions of all ranks cover each global tensor's rows exactly once."""
    w = np.zeros((rows, 3))
    seen = {"w": np.zeros(rows), "fc1:gate": np.zeros(2 * rows), "fc1:up": np.zeros(2 * rows)}
    for st in _states(tp=2, cp=2, world=8):
        mesh = Mesh.of(st)
        t = st.tp_rank
        cases = [("w", w.shape, Placement(shards=(("dp_cp", 0),), global_shape=w.shape)),
                 ("fc1", (2 * rows, 4),
                  Placement(shards=(("tp", 0), ("dp_cp", 0)), layout="glu_halves",
                            global_shape=(4 * rows, 4)))]
        for name, local_shape, pl in cases:
            assert grad_replica_dims(pl) == ()
            # w is replicated over tp: one tp rank writes it; fc1 is tp-sharded: every rank
            assert writes_checkpoint(pl, mesh) == (name == "fc1" or t == 0)
            if not writes_checkpoint(pl, mesh):
                continue
            for r in checkpoint_regions(name, local_shape, pl, mesh):
                if r.sizes[0]:
                    seen[r.name][r.offsets[0]:r.offsets[0] + r.sizes[0]] += 1
    for name, count in seen.items():
        assert (count == 1).all(), (name, count)


def test_gradient_and_norm_dims():
    assert grad_replica_dims(Placement()) == ("dp", "cp")
    assert grad_replica_dims(Placement(shards=(("dp", 0),))) == ("cp",)     # cp = 1
    assert grad_replica_dims(Placement(shards=(("dp_cp", 0),))) == ()
    expert = Placement(shards=(("ep", None),))
    assert grad_replica_dims(expert) == ("edp", "cp")
    # the global norm sums a dp_cp shard's squares over dp, then over cp
    assert norm_dims(Placement(shards=(("tp", 0), ("dp_cp", 0)))) == ("tp", "dp", "cp")
    assert norm_dims(Placement(shards=(("ep", None), ("edp_cp", 0)))) == ("ep", "edp", "cp")


def test_fsdp_size_is_dp_times_cp():
    st = ParallelState(ParallelSizes(cp=2, world=4), rank=0)
    st.groups = {d: comm.ProcessGroup(tuple(st.ranks_along(d))) for d in ("dp", "dp_cp")}
    group, dim = fsdp_group(st, 4)
    assert dim == "dp_cp" and group.ranks == (0, 1, 2, 3)
    with pytest.raises(ValueError, match=r"parallel.fsdp_size \(2\) must equal data parallel x "
                                         r"context parallel \(4 = 2 x 2"):
        fsdp_group(st, 2)
    with pytest.raises(ConfigError, match=r"parallel.fsdp_size \(3\) must be a multiple of "
                                          r"parallel.context_parallel_size \(2\)") as e:
        load_config(None, ["--parallel.context_parallel_size", "2", "--parallel.fsdp_size", "3"])
    assert "\n" not in str(e.value)


def test_distributed_optimizer_expert_shards_over_edp_cp_tile_the_tensor():
    """The distributed optimizer's cut of a grouped expert weight (``row_blocks``: rows of its
    stored view) over expert-data x context parallel, on ep2 x dp2 x cp2 (world 8): the main
    shards' checkpoint regions of all ranks cover the global tensor once (one tp rank: tp=1)."""
    from ms_llm.parallel.distributed_optimizer import shard_rows
    w1 = np.random.default_rng(0).standard_normal((3, 24))    # [H, E=4 x 2F=6]
    blocks = w1.reshape(4, -1)
    seen = np.zeros(12)                                        # 3 x 24 / 6 stored rows
    for st in _states(cp=2, ep=2, world=8):
        mesh = Mesh.of(st)
        e = st.ep_rank
        local = np.ascontiguousarray(blocks[e * 2:(e + 1) * 2]).reshape(3, 12)
        pl = Placement(shards=(("ep", 1),), layout="row_blocks", row_width=6,
                       global_shape=(3, 24))
        rows, rs = shard_rows(local.shape, pl, "edp_cp", mesh.size["edp_cp"],
                              mesh.rank["edp_cp"])
        assert rows == (6, 6) and mesh.size["edp_cp"] == 4    # edp (dp 4 / ep 2) x cp 2
        spl = Placement(shards=pl.shards + (("edp_cp", 0),), layout="row_blocks", row_width=6,
                        global_shape=(3, 24))
        assert writes_checkpoint(spl, mesh)
        shard = local.reshape(rows)[rs.start:rs.start + rs.length]
        for r in checkpoint_regions("w1", shard.shape, spl, mesh):
            want = w1.reshape(-1, 6)[r.offsets[0]:r.offsets[0] + r.sizes[0]]
            np.testing.assert_array_equal(shard[r.lstart:r.lstart + r.length], want)
            seen[r.offsets[0]:r.offsets[0] + r.sizes[0]] += 1
    assert (seen == 1).all(), seen
