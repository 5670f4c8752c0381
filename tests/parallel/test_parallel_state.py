"""Mesh layout (Megatron order, tensor fastest), size validation and single-process behaviour."""
import itertools
import os
import subprocess
import sys

import numpy as np
import pytest
from mindspore import Tensor

from ms_llm.parallel import comm
from ms_llm.parallel.state import ParallelSizes, ParallelState


def test_rank_layout_matches_megatron_order():
    sizes = ParallelSizes(tp=2, cp=1, pp=2, ep=2, world=16)   # dp = 4
    # Independent statement: rank = tp + 2 * (dp + 4 * pp)
    for r in range(16):
        st = ParallelState(sizes, rank=r)
        tp, dp, pp = r % 2, (r // 2) % 4, r // 8
        assert (st.tp_rank, st.dp_rank, st.pp_rank) == (tp, dp, pp)
        assert st.ranks_along("tp") == [t + 2 * (dp + 4 * pp) for t in range(2)]
        assert st.ranks_along("dp") == [tp + 2 * (d + 4 * pp) for d in range(4)]
        assert st.ranks_along("pp") == [tp + 2 * (dp + 4 * p) for p in range(2)]
        ep_base = dp - dp % 2
        assert st.ranks_along("ep") == [tp + 2 * (d + 4 * pp) for d in (ep_base, ep_base + 1)]
        assert st.ranks_along("edp") == [tp + 2 * (d + 4 * pp) for d in (dp % 2, dp % 2 + 2)]
    # every rank is in exactly one group per dimension
    for dim in ("tp", "dp", "pp", "ep", "edp"):
        groups = {tuple(ParallelState(sizes, rank=r).ranks_along(dim)) for r in range(16)}
        assert sorted(itertools.chain(*groups)) == list(range(16)), dim


@pytest.mark.parametrize("kw,needle", [
    (dict(tp=3, world=4), "not divisible"),
    (dict(tp=2, pp=2, world=6), "not divisible"),
    (dict(tp=1, ep=3, world=4), "expert_model_parallel_size 3"),
])
def test_bad_sizes_are_rejected(kw, needle):
    with pytest.raises(ValueError, match=needle):
        ParallelSizes(**kw).validate()


def test_single_process_collectives_are_local():
    t = Tensor(np.arange(4, dtype=np.float32))
    comm.all_reduce(t)
    np.testing.assert_array_equal(t.asnumpy(), np.arange(4))
    out = Tensor(np.zeros(4, np.float32))
    comm.all_gather_into_tensor(out, t)
    np.testing.assert_array_equal(out.asnumpy(), np.arange(4))
    assert comm.get_world_size() == 1 and comm.world_group().size == 1


def test_multi_rank_without_msrun_is_a_clear_error():
    code = ("from ms_llm.parallel.runtime import init_distributed\n"
            "try:\n    init_distributed()\nexcept RuntimeError as e:\n    print('ERR', e)\n")
    env = dict(os.environ, RANK_SIZE="2")
    env.pop("MS_ROLE", None)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=120)
    assert "ERR RANK_SIZE > 1 but not launched by msrun" in r.stdout


@pytest.mark.parametrize("tp,etp,ep,pp,world", [
    (2, 2, 2, 1, 8),     # Megatron's default etp = tp: ep subdivides dp
    (2, 1, 4, 1, 8),     # etp 1: the expert grid cuts across the tensor ranks
    (2, 1, 2, 2, 8),     # (moe_tp_extend_ep at ep 1 x tp 2), two pipeline stages
    (4, 2, 2, 1, 8),
    (2, 4, 1, 1, 8),     # etp larger than tp
])
def test_expert_grid_matches_megatron_core(tp, etp, ep, pp, world):
    """The expert groups (etp, ep, edp, tp x ep) equal megatron-core's expert rank generator
    (order tp-ep-dp-pp over the same ranks; context parallel 1)."""
    from megatron.core.parallel_state import RankGenerator
    edp = world // (etp * ep * pp)
    gen = RankGenerator(tp=etp, ep=ep, dp=edp, pp=pp, cp=1, order="tp-ep-dp-pp")
    want = {"etp": gen.get_ranks("tp"), "ep": gen.get_ranks("ep"), "edp": gen.get_ranks("dp"),
            "tp_ep": gen.get_ranks("tp-ep")}
    sizes = ParallelSizes(tp=tp, pp=pp, ep=ep, etp=etp, world=world)
    for r in range(world):
        st = ParallelState(sizes, rank=r)
        for dim, groups in want.items():
            mine = next(g for g in groups if r in g)
            assert st.ranks_along(dim) == sorted(mine), (dim, r)
        assert st.ranks_along("edp_cp") == st.ranks_along("edp")
