"""Placement records: checkpoint regions, writers, gradient groups and norm dims.

Each layout is checked by simulating every rank of a mesh with plain NumPy: the global tensor is
split the way the parallel code splits it (tensor parallel's even chunks or ``[gate_r; up_r]``
rows, expert blocks of memory, then FSDP's ``torch.chunk`` rows), each simulated rank writes its
regions into the stored global arrays, and the result must equal the global tensor exactly
(every element written once by the ranks marked as writers)."""
import itertools

import numpy as np
import pytest

from ms_llm.parallel.placement import (Mesh, Placement, RowShard, checkpoint_name,
                                       checkpoint_regions, grad_replica_dim, norm_dims,
                                       stored_view, writes_checkpoint)


def _meshes(**sizes):
    dims = ("tp", "cp", "dp", "ep", "pp")
    full = {d: sizes.get(d, 1) for d in dims}
    for coords in itertools.product(*[range(full[d]) for d in ("tp", "dp", "cp")]):
        rank = dict(zip(("tp", "dp", "cp"), coords), pp=0)
        rank["ep"] = rank["dp"] % full["ep"]
        rank["edp"] = rank["dp"] // full["ep"]
        size = dict(full, edp=full["dp"] // full["ep"])
        yield Mesh(rank, size)


def _chunk(a, n, r, axis=0):
    rs = RowShard(a.shape[axis], n, r)
    return np.take(a, np.arange(rs.start, rs.start + rs.length), axis=axis)


def _assemble(local_of, pl, meshes, stored_shapes):
    """Write every simulated rank's regions; return the stored arrays and the write counts."""
    out = {k: np.full(s, np.nan) for k, s in stored_shapes.items()}
    count = {k: np.zeros(s, int) for k, s in stored_shapes.items()}
    for mesh in meshes:
        local = local_of(mesh)
        data = stored_view(local, pl)
        regions = checkpoint_regions("w", local.shape, pl, mesh)
        if not writes_checkpoint(pl, mesh):
            continue
        for r in regions:
            assert r.gshape == stored_shapes[r.name]
            piece = data[r.lstart:r.lstart + r.length]
            assert piece.shape == r.sizes
            sl = tuple(slice(o, o + n) for o, n in zip(r.offsets, r.sizes))
            out[r.name][sl] = piece
            count[r.name][sl] += 1
    return out, count


@pytest.mark.parametrize("tp,dp,dim", [(2, 1, 0), (2, 3, 0), (2, 3, 1), (1, 4, 0), (4, 3, 1)])
def test_plain_tp_then_fsdp_reassembles(tp, dp, dim):
    g = np.arange(8 * 10, dtype=np.float64).reshape(8, 10) if dim == 0 else \
        np.arange(7 * 8, dtype=np.float64).reshape(7, 8)
    shards = ((("tp", dim),) if tp > 1 else ()) + ((("dp", 0),) if dp > 1 else ())
    pl = Placement(shards=shards, global_shape=g.shape)

    def local(mesh):
        a = np.split(g, tp, axis=dim)[mesh.rank["tp"]] if tp > 1 else g
        return _chunk(a, dp, mesh.rank["dp"]) if dp > 1 else a
    out, count = _assemble(local, pl, _meshes(tp=tp, dp=dp), {"w": g.shape})
    np.testing.assert_array_equal(out["w"], g)
    assert (count["w"] == 1).all()


@pytest.mark.parametrize("tp,dp", [(1, 1), (2, 1), (1, 3), (2, 3), (2, 4)])
def test_glu_halves_reassemble_gate_and_up(tp, dp):
    f, h = 6, 4                                            # fc1 = [gate (6 rows); up (6 rows)]
    g = np.arange(2 * f * h, dtype=np.float64).reshape(2 * f, h)
    shards = ((("tp", 0),) if tp > 1 else ()) + ((("dp", 0),) if dp > 1 else ())
    pl = Placement(shards=shards, layout="glu_halves", global_shape=g.shape)

    def local(mesh):
        n, r = f // tp, mesh.rank["tp"]
        a = np.concatenate([g[r * n:(r + 1) * n], g[f + r * n:f + (r + 1) * n]])
        return _chunk(a, dp, mesh.rank["dp"]) if dp > 1 else a
    out, count = _assemble(local, pl, _meshes(tp=tp, dp=dp),
                           {"w:gate": (f, h), "w:up": (f, h)})
    np.testing.assert_array_equal(out["w:gate"], g[:f])
    np.testing.assert_array_equal(out["w:up"], g[f:])
    assert (count["w:gate"] == 1).all() and (count["w:up"] == 1).all()


@pytest.mark.parametrize("ep,dp", [(1, 1), (1, 3), (2, 2), (4, 4)])
def test_row_blocks_grouped_weight1(ep, dp):
    """weight1 [H, E*2F] viewed [E, H, 2F]: an ep rank keeps a block of memory; FSDP (only
    without ep here, as in training) cuts dim 0 of what the rank holds."""
    e, hdim, f2 = 4, 3, 4
    g = np.arange(hdim * e * f2, dtype=np.float64).reshape(hdim, e * f2)
    shards = ((("ep", 1),) if ep > 1 else ()) + ((("dp", 0),) if ep == 1 and dp > 1 else ())
    pl = Placement(shards=shards, layout="row_blocks", row_width=f2, global_shape=g.shape)

    def local(mesh):
        a = g
        if ep > 1:
            n = e // ep
            a = g.reshape(e, -1)[mesh.rank["ep"] * n:(mesh.rank["ep"] + 1) * n].reshape(
                hdim, n * f2)
        return _chunk(a, dp, mesh.rank["dp"]) if ep == 1 and dp > 1 else a
    out, count = _assemble(local, pl, _meshes(dp=dp, ep=ep), {"w": (e * hdim, f2)})
    np.testing.assert_array_equal(out["w"], g.reshape(-1, f2))
    assert (count["w"] == 1).all()


def test_derived_groups_and_writers():
    dense, tp = Placement(), Placement(shards=(("tp", 0),), global_shape=(4, 4))
    fsdp = Placement(shards=(("tp", 1), ("dp", 0)), global_shape=(4, 4))
    expert = Placement(shards=(("ep", None),), global_index=(("local_experts", 1, 3),))
    assert grad_replica_dim(dense) == "dp" and grad_replica_dim(tp) == "dp"
    assert grad_replica_dim(fsdp) is None and grad_replica_dim(expert) == "edp"
    assert norm_dims(dense) == () and norm_dims(fsdp) == ("tp", "dp")
    assert norm_dims(expert) == ("ep",)
    mesh = Mesh({"tp": 1, "cp": 0, "dp": 3, "ep": 1, "edp": 1, "pp": 0},
                {"tp": 2, "cp": 1, "dp": 4, "ep": 2, "edp": 2, "pp": 1})
    assert not writes_checkpoint(dense, mesh)          # tp rank 1 and dp rank 3: a replica
    assert not writes_checkpoint(tp, mesh)             # dp rank 3 replicates the tp shard
    assert writes_checkpoint(fsdp, mesh)               # every (tp, dp) piece is distinct
    assert not writes_checkpoint(expert, mesh)         # edp rank 1 replicates the experts
    assert checkpoint_name("mlp.experts.local_experts.1.linear_fc1.weight", expert) == \
        "mlp.experts.local_experts.3.linear_fc1.weight"


def test_typos_are_errors():
    with pytest.raises(ValueError, match="unknown mesh dim 'pd'"):
        Placement(shards=(("pd", 0),))
    with pytest.raises(ValueError, match="unknown layout"):
        Placement(layout="glu")
    with pytest.raises(ValueError, match="row_width"):
        Placement(layout="row_blocks")
    with pytest.raises(ValueError, match="no 'local_experts.2.' component"):
        checkpoint_name("mlp.experts.local_experts.1.w",
                        Placement(global_index=(("local_experts", 2, 5),)))
