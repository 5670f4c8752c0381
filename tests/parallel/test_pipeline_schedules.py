"""Pipeline schedules as data: every registered schedule, then Megatron's 1F1B and interleaved
orders, ZB-H1, GPipe and DualPipe-V one by one, checked by simulation.

Every schedule is replayed in lockstep rounds (``plan_rounds``): a rank runs its next action once
its inputs exist. The simulation must finish (no deadlock), keep each rank's order, produce and
consume every activation/gradient exactly once, and give the bubble the closed forms derived
below. Pure Python; no MindSpore."""
import itertools

import pytest

from ms_llm.parallel.pipeline.schedules import (
    ROUND_ROBIN,
    V_SHAPE,
    Action,
    Round,
    all_schedules,
    bubble_fraction,
    describe_rounds,
    format_schedule,
    get_schedule,
    kept_backwards,
    plan_rounds,
    transfers_after,
)
from ms_llm.parallel.pipeline.schedules.gpipe import gpipe
from ms_llm.parallel.pipeline.schedules.interleaved import interleaved_1f1b
from ms_llm.parallel.pipeline.schedules.one_f_one_b import one_f_one_b

PLAIN = [(pp, m) for pp in range(1, 5) for m in range(1, 9)]
INTERLEAVED = [(pp, m, vpp) for pp in range(1, 5) for m in range(pp, 9) for vpp in (2, 3)]


def _build(pp, m, vpp=1, method=None):
    """Every rank's actions of the schedule ``parallel.schedules_method`` and ``vpp`` select."""
    return get_schedule(method, vpp).build(pp, m, vpp)


def _ids(cases):
    return ["-".join(f"{k}{v}" for k, v in zip(("pp", "m", "vpp"), c)) for c in cases]


def test_action_str_and_stage_mapping():
    assert str(Action("F", 3, 1)) == "F3.1" and str(Action("B", 0)) == "B0.0"
    for pp, vpp in itertools.product(range(1, 5), range(1, 4)):
        stages = [ROUND_ROBIN.virtual_stage(r, c, pp) for c in range(vpp) for r in range(pp)]
        assert stages == list(range(pp * vpp))  # Megatron: chunk-major, rank-minor
        assert all(ROUND_ROBIN.stage_of(ROUND_ROBIN.virtual_stage(r, c, pp), pp) == (r, c)
                   for r in range(pp) for c in range(vpp))


def _blocking_p2p_completes(transfers) -> bool:
    """Each rank walks its part of the shared list; a send and a receive finish only together."""
    queues: dict[int, list] = {}
    for t in transfers:
        src, dst = t[0], t[1]
        if src != dst:  # self-transfers are local hand-overs
            queues.setdefault(src, []).append(("send", t))
            queues.setdefault(dst, []).append(("recv", t))
    while any(queues.values()):
        progressed = False
        for q in queues.values():
            if q and q[0][0] == "send":
                peer = queues[q[0][1][1]]
                if peer and peer[0] == ("recv", q[0][1]):
                    q.pop(0), peer.pop(0)
                    progressed = True
        if not progressed:
            return False
    return True


def _grid(spec):
    """(pp, m, vpp) the schedule runs: up to 5 ranks, every chunk count it takes up to 3, and
    8 micro-batch counts from its least (below pp where it allows that)."""
    chunk_counts = range(spec.min_chunks, (spec.max_chunks or 3) + 1)
    return [(pp, m, vpp) for pp in range(1, 6) for vpp in chunk_counts
            for m in range(max(1, spec.microbatches_per_rank * pp),
                           max(1, spec.microbatches_per_rank * pp) + 8)]


@pytest.mark.parametrize("spec", all_schedules(), ids=lambda s: s.name)
def test_every_schedule_runs_each_action_once_without_deadlock(spec):
    """Every registered schedule, over its grid: the lockstep replay finishes (no deadlock)
    keeping each rank's order; every (micro-batch, chunk) has its F, its B and, where the record
    says it splits the backward, its W once per rank; every input is there before its action
    runs; every round's exchange completes under blocking p2p; one act and one grad cross each
    stage boundary per micro-batch, between the stages the record's placement puts next."""
    place = spec.placement
    for pp, m, vpp in _grid(spec):
        assert get_schedule(spec.method, vpp) is spec
        schedule = spec.build(pp, m, vpp)
        rounds = plan_rounds(schedule, pp, vpp, placement=place)
        kinds = "FBW" if spec.splits_backward else "FB"
        for rank, actions in enumerate(schedule):
            assert [row[rank] for row in rounds if row[rank] is not None] == actions
            assert sorted(map(str, actions)) == sorted(
                f"{k}{mb}.{c}" for k in kinds for mb in range(m) for c in range(vpp))
        assert sorted({place.virtual_stage(r, c, pp) for r in range(pp) for c in range(vpp)}) \
            == list(range(pp * vpp))
        assert all(place.stage_of(place.virtual_stage(r, c, pp), pp) == (r, c)
                   for r in range(pp) for c in range(vpp))
        sent: dict[tuple[int, str, int, int], int] = {}   # (dst, kind, mb, dst_chunk) -> round
        for r in describe_rounds(rounds, pp, vpp, placement=place):
            for rank, a in enumerate(r.actions):
                if a is None:
                    continue
                vs = place.virtual_stage(rank, a.chunk, pp)
                if a.kind == "F" and vs > 0:
                    assert sent[(rank, "act", a.microbatch, a.chunk)] < r.index
                if a.kind == "B" and vs < pp * vpp - 1:
                    assert sent[(rank, "grad", a.microbatch, a.chunk)] < r.index
            for src, dst, kind, mb, chunk in r.transfers:
                assert (dst, kind, mb, chunk) not in sent
                src_vs = place.virtual_stage(src, r.actions[src].chunk, pp)
                assert place.virtual_stage(dst, chunk, pp) == \
                    src_vs + (1 if kind == "act" else -1)
                sent[(dst, kind, mb, chunk)] = r.index
            assert _blocking_p2p_completes(r.transfers)
        assert len(sent) == 2 * m * (pp * vpp - 1)
        assert "\n" not in spec.bubble_note(rounds, pp, m)


@pytest.mark.parametrize("spec", all_schedules(), ids=lambda s: s.name)
def test_every_schedule_refuses_what_it_cannot_run_in_one_line(spec):
    """Too few micro-batches or a chunk count outside the record's rule: one line naming the
    config keys to change."""
    for vpp in (spec.min_chunks - 1, (spec.max_chunks or 0) + 1):
        if vpp >= 1 and not spec.runs_chunks(vpp):
            with pytest.raises(ValueError) as e:
                spec.build(2, 8, vpp)
            assert "\n" not in str(e.value)
            assert "parallel.virtual_pipeline_model_parallel_size" in str(e.value)
    if spec.microbatches_per_rank:
        with pytest.raises(ValueError) as e:
            spec.build(3, 3 * spec.microbatches_per_rank - 1, spec.min_chunks)
        assert "\n" not in str(e.value) and "training.global_batch_size" in str(e.value)


def test_the_registry_selects_one_schedule_per_method_and_chunk_count():
    """Names and labels are unique; a ``parallel.schedules_method`` value and a chunk count
    select at most one record; a MindSpeed ``--schedules-method`` value fixes its chunk count
    (the flag sets the virtual pipeline size from it)."""
    specs = all_schedules()
    assert len({s.name for s in specs}) == len({s.label for s in specs}) == len(specs) >= 5
    for method in {s.method for s in specs}:
        for vpp in range(1, 6):
            assert len([s for s in specs if s.method == method and s.runs_chunks(vpp)]) <= 1
    assert all(s.method and s.min_chunks == s.max_chunks for s in specs if s.mindspeed)
    assert get_schedule(None, 1).label == "1F1B"
    assert get_schedule(None, 3).label == "interleaved 1F1B"


@pytest.mark.parametrize("pp,m", PLAIN, ids=_ids(PLAIN))
def test_1f1b_phases_match_megatron(pp, m):
    for rank in range(pp):
        acts = one_f_one_b(pp, rank, m)
        warmup = min(pp - rank - 1, m)
        kinds = "".join(a.kind for a in acts)
        assert kinds == "F" * warmup + "FB" * (m - warmup) + "B" * warmup
        assert [a.microbatch for a in acts if a.kind == "F"] == list(range(m))
        assert [a.microbatch for a in acts if a.kind == "B"] == list(range(m))


@pytest.mark.parametrize("pp,m", PLAIN, ids=_ids(PLAIN))
def test_1f1b_in_flight_bound(pp, m):
    """1F1B's reason to exist: rank r holds at most pp - r microbatches' activations (GPipe: m)."""
    for rank in range(pp):
        live = peak = 0
        for a in one_f_one_b(pp, rank, m):
            live += 1 if a.kind == "F" else -1
            peak = max(peak, live)
        assert peak == min(pp - rank, m)


@pytest.mark.parametrize("pp,m,vpp", INTERLEAVED, ids=_ids(INTERLEAVED))
def test_interleaved_warmup_and_chunk_order(pp, m, vpp):
    total = m * vpp
    for rank in range(pp):
        acts = interleaved_1f1b(pp, rank, m, vpp)
        leading_f = next((i for i, a in enumerate(acts) if a.kind == "B"), len(acts))
        if m % pp == 0:  # Megatron's warmup, plus the first steady-state forward
            warmup = total if m == pp else min(2 * (pp - rank - 1) + (vpp - 1) * pp, total)
            assert leading_f == min(warmup + 1, total)
        # each microbatch goes up the chunks forward and down them backward
        for mb in range(m):
            assert [a.chunk for a in acts if a.kind == "F" and a.microbatch == mb] == list(range(vpp))
            assert [a.chunk for a in acts if a.kind == "B" and a.microbatch == mb] == \
                list(reversed(range(vpp)))


def test_interleaved_groups_of_pp():
    acts = interleaved_1f1b(2, 1, 4, 2)
    fwd = [str(a) for a in acts if a.kind == "F"]
    assert fwd == ["F0.0", "F1.0", "F0.1", "F1.1", "F2.0", "F3.0", "F2.1", "F3.1"]


@pytest.mark.parametrize("pp,m", [(2, 1), (3, 2), (4, 3)])
def test_interleaved_needs_pp_microbatches(pp, m):
    with pytest.raises(ValueError) as err:
        _build(pp, m, vpp=2)
    msg = str(err.value)
    assert "\n" not in msg
    assert "parallel.pipeline_model_parallel_size" in msg and "training.global_batch_size" in msg


@pytest.mark.parametrize("pp,m", PLAIN, ids=_ids(PLAIN))
def test_1f1b_bubble_closed_forms(pp, m):
    """Unit costs: a round is one time unit and data produced in a round is usable in the next, so
    the lockstep replay is the ideal zero-latency pipeline: microbatch 0 needs pp rounds to reach
    the last stage and pp - 1 more for its gradient to return, while each rank does 2m actions,
    giving 2(m + pp - 1) rounds and the textbook bubble (pp-1)/(m+pp-1), exactly.

    F=1, B=2: a round lasts as long as its slowest action. For pp >= 2 the first pp rounds hold
    forwards only (the last stage starts B0 in round pp); from then on every round holds a backward
    (the last two ranks alternate B in the steady state, then B[m-1] walks down one rank per round),
    so span = pp * 1 + (2(m + pp - 1) - pp) * 2 = 4m + 3pp - 4 while each rank is busy 3m:
    bubble = 1 - 3m / (4m + 3pp - 4). This exceeds Megatron's (pp-1)/(m+pp-1) because rounds act
    as barriers (a rank doing F beside a rank doing B idles for the difference). For pp = 1 the
    rounds alternate F and B alone, so there is no idle time."""
    rounds = plan_rounds(_build(pp, m), pp)
    assert len(rounds) == 2 * (m + pp - 1)
    assert bubble_fraction(rounds) == pytest.approx((pp - 1) / (m + pp - 1), abs=1e-12)
    expected = 0.0 if pp == 1 else 1 - 3 * m / (4 * m + 3 * pp - 4)
    assert bubble_fraction(rounds, {"F": 1, "B": 2}) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("pp,m,vpp", [c for c in INTERLEAVED if c[1] % c[0] == 0],
                         ids=_ids([c for c in INTERLEAVED if c[1] % c[0] == 0]))
def test_interleaved_bubble_closed_form(pp, m, vpp):
    """With unit cost per chunk action the fill and drain still take 2(pp - 1) rounds but the
    work is 2 m vpp rounds, so the bubble is Megatron's (pp-1)/(m vpp + pp-1)."""
    rounds = plan_rounds(_build(pp, m, vpp), pp, vpp)
    assert bubble_fraction(rounds) == pytest.approx((pp - 1) / (m * vpp + pp - 1), abs=1e-12)


@pytest.mark.parametrize("pp,m", [(pp, m) for pp in range(2, 5) for m in range(2 * pp, 9)])
@pytest.mark.parametrize("cost", [None, {"F": 1, "B": 2}])
def test_interleaved_bubble_smaller_than_1f1b(pp, m, cost):
    plain = bubble_fraction(plan_rounds(_build(pp, m), pp), cost)
    for vpp in (2, 3):
        inter = bubble_fraction(plan_rounds(_build(pp, m, vpp), pp, vpp), cost)
        assert inter < plain


@pytest.mark.parametrize("pp,m,vpp", [(4, 8, 1), (4, 8, 2), (3, 7, 3), (2, 5, 2)])
def test_round_exchange_is_deadlock_free_with_blocking_p2p(pp, m, vpp):
    rounds = describe_rounds(plan_rounds(_build(pp, m, vpp), pp, vpp), pp, vpp)
    assert all(isinstance(r, Round) for r in rounds)
    assert [r.index for r in rounds] == list(range(len(rounds)))
    assert all(_blocking_p2p_completes(r.transfers) for r in rounds)


def test_single_rank_with_chunks_hands_over_locally():
    rounds = plan_rounds(_build(1, 2, 2), 1, 2)
    transfers = [t for row in rounds for t in transfers_after(row, 1, 2, 2)]
    assert (0, 0, "act", 0, 1) in transfers and (0, 0, "grad", 0, 0) in transfers


def test_cyclic_schedule_reports_deadlock():
    # rank 0 wants B0 before it runs F1; rank 1 runs microbatch 1 first, so B0 waits on F1
    schedule = [[Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1)],
                [Action("F", 1), Action("B", 1), Action("F", 0), Action("B", 0)]]
    with pytest.raises(ValueError, match=r"deadlocks at round 1: rank 0 B0.0 waits for B0.0 on "
                                         r"rank 1; rank 1 F1.0 waits for F1.0 on rank 0"):
        plan_rounds(schedule, 2)


def test_backward_before_forward_is_rejected():
    schedule = [one_f_one_b(2, 0, 2), [Action("B", 0), Action("F", 0), Action("F", 1),
                                       Action("B", 1)]]
    with pytest.raises(ValueError, match="rank 1: B0.0 comes before its forward"):
        plan_rounds(schedule, 2)


@pytest.mark.parametrize("bad,match", [
    ([[Action("F", 0), Action("B", 0)], [Action("F", 0)]], "rank 1 is missing B0.0"),
    ([[Action("F", 0), Action("B", 0), Action("B", 0)], [Action("F", 0), Action("B", 0)]],
     "repeated action B0.0"),
    ([[Action("F", 0, 1), Action("B", 0, 1)], [Action("F", 0), Action("B", 0)]],
     "unexpected or repeated action F0.1"),
    ([[Action("F", 0), Action("B", 0)]], "has 1 ranks, expected pp=2"),
])
def test_malformed_schedules_are_rejected(bad, match):
    with pytest.raises(ValueError, match=match):
        plan_rounds(bad, 2)


def test_bad_cost_is_rejected():
    with pytest.raises(ValueError, match="positive 'F', 'B'"):
        plan_rounds(_build(2, 2), 2, cost={"F": 1})


def test_format_schedule():
    schedule = _build(2, 2)
    assert format_schedule(schedule).splitlines() == ["rank 0: F0.0 F1.0 B0.0 B1.0",
                                                      "rank 1: F0.0 B0.0 F1.0 B1.0"]
    table = format_schedule(schedule, plan_rounds(schedule, 2)).splitlines()
    assert table == ["rank 0: F0.0 F1.0    . B0.0    . B1.0",
                     "rank 1:    . F0.0 B0.0 F1.0 B1.0    ."]


ZB = [(pp, m) for pp in range(1, 7) for m in range(pp, 14)]


@pytest.mark.parametrize("pp,m", ZB, ids=_ids(ZB))
def test_zero_bubble_h1_bubble_and_memory_match_the_paper(pp, m):
    """ZB-H1 (Qi et al. 2024, section 3.1): at unit F, B, W every rank idles (p - 1)(F + B - W)
    = p - 1 slots against 1F1B's (p - 1)(F + B + W) = 3(p - 1) (B and W fused into one 2-unit
    backward), and no rank holds more than 1F1B's first-stage peak of p micro-batches (from F
    until W frees them)."""
    zb = _build(pp, m, method="zbh1")
    rounds = plan_rounds(zb, pp)
    assert len(rounds) - 3 * m == pp - 1
    # 1F1B at the same costs (its B = B + W = 2 units): (m + p - 1) x 3 units, idle 3(p - 1)
    assert bubble_fraction(rounds) == pytest.approx((pp - 1) / (3 * m + pp - 1))
    assert bubble_fraction(rounds) < bubble_fraction(plan_rounds(_build(pp, m), pp)) \
        or pp == 1
    for rank, actions in enumerate(zb):
        assert [row[rank] for row in rounds if row[rank] is not None] == actions
        live = peak = 0
        for a in actions:
            live += {"F": 1, "B": 0, "W": -1}[a.kind]
            peak = max(peak, live)
        assert peak <= pp and live == 0
    # the last rank never waits once its first forward arrived
    assert all(row[pp - 1] is not None for row in rounds[pp - 1:])


@pytest.mark.parametrize("pp,m", PLAIN, ids=_ids(PLAIN))
def test_gpipe_reverses_backwards_with_1f1b_bubble(pp, m):
    sched = _build(pp, m, method="gpipe")
    assert sched[0] == gpipe(pp, 0, m)
    assert [a.microbatch for a in sched[0] if a.kind == "B"] == list(reversed(range(m)))
    assert bubble_fraction(plan_rounds(sched, pp)) == pytest.approx(
        bubble_fraction(plan_rounds(_build(pp, m), pp)))


def test_kept_backwards_nest_like_mindspores_pending_vjp_stack():
    """A pending backward closure can run only from the top of MindSpore's stack, so the kept
    F..B spans must nest: all of GPipe's, every other one of 1F1B's crossing spans (the re-runs
    left to the earliest micro-batches, whose B waits for the next stage anyway), all of the
    last rank's (F and B adjacent)."""
    assert kept_backwards(gpipe(2, 0, 4)) == {(mb, 0) for mb in range(4)}
    assert kept_backwards(one_f_one_b(2, 0, 4)) == {(1, 0), (3, 0)}
    assert kept_backwards(_build(2, 4, method="zbh1")[0]) == {(1, 0), (3, 0)}
    assert kept_backwards(one_f_one_b(2, 1, 4)) == {(mb, 0) for mb in range(4)}
    for pp, m in PLAIN:
        for rank, acts in enumerate(_build(pp, m, method="zbh1")):
            kept = kept_backwards(acts)
            stack = []
            for a in acts:           # replay: a kept B always pops the top
                key = (a.microbatch, a.chunk)
                if a.kind == "F" and key in kept:
                    stack.append(key)
                elif a.kind == "B" and key in kept:
                    assert stack.pop() == key
            assert not stack


def test_unknown_schedule_method_is_refused_in_one_line():
    for method, vpp, match in (("dualpipe", 1, "unknown; choose one of"),
                               ("zbh1", 2, "one model chunk per rank")):
        with pytest.raises(ValueError, match=match) as e:
            _build(2, 4, vpp, method=method)
        assert "\n" not in str(e.value) and "parallel.schedules_method" in str(e.value)


DUALPIPEV = [(pp, m) for pp in range(1, 6) for m in range(2 * pp, 2 * pp + 6)]


def test_dualpipev_places_two_chunks_per_rank_in_a_v():
    for pp in range(1, 6):
        stages = {V_SHAPE.virtual_stage(r, c, pp): (r, c) for r in range(pp) for c in (0, 1)}
        assert sorted(stages) == list(range(2 * pp))
        assert all(V_SHAPE.stage_of(v, pp) == rc for v, rc in stages.items())
        assert stages[0] == (0, 0) and stages[2 * pp - 1] == (0, 1)   # embedding and loss
        assert stages[pp - 1] == (pp - 1, 0) and stages[pp] == (pp - 1, 1)   # the turn


@pytest.mark.parametrize("pp,m", DUALPIPEV, ids=_ids(DUALPIPEV))
def test_dualpipev_keeps_chunk_order_and_turns_locally(pp, m):
    """DualPipe-V (DeepSeek's DualPipeV, cut-in-half; the registry test checks it runs every
    action once without deadlock): each chunk's micro-batches in order, and only the last rank's
    turn from chunk 0 to chunk 1 handed over locally."""
    schedule = _build(pp, m, 2, method="dualpipev")
    for actions in schedule:
        for kind, chunk in itertools.product("FBW", (0, 1)):
            assert [a.microbatch for a in actions if (a.kind, a.chunk) == (kind, chunk)] == \
                list(range(m))
    for r in describe_rounds(plan_rounds(schedule, pp, 2, placement=V_SHAPE), pp, 2,
                             placement=V_SHAPE):
        for src, dst, kind, mb, chunk in r.transfers:
            src_vs = V_SHAPE.virtual_stage(src, r.actions[src].chunk, pp)
            assert (src == dst) == (src_vs + (1 if kind == "act" else -1) in (pp - 1, pp)
                                    and src == pp - 1)


@pytest.mark.parametrize("pp,m", DUALPIPEV, ids=_ids(DUALPIPEV))
def test_dualpipev_memory_and_bubble(pp, m):
    """DualPipe's README: 2 pp + 1 chunk activations per rank (held from F until W), and a
    bubble below ZB-H1's on the same ranks (each ZB-H1 action is a whole stage, two chunks; the
    simulator's unit costs: F = B = W per action)."""
    schedule = _build(pp, m, 2, method="dualpipev")
    for actions in schedule:
        live = peak = 0
        for a in actions:
            live += {"F": 1, "B": 0, "W": -1}[a.kind]
            peak = max(peak, live)
        assert peak <= 2 * pp + 1 and live == 0
    ours = bubble_fraction(plan_rounds(schedule, pp, 2, placement=V_SHAPE))
    zb = bubble_fraction(plan_rounds(_build(pp, m, method="zbh1"), pp))
    assert ours < zb or pp == 1


def test_dualpipev_needs_two_chunks_and_2pp_microbatches():
    with pytest.raises(ValueError, match="virtual_pipeline_model_parallel_size 2"):
        _build(2, 4, 1, method="dualpipev")
    with pytest.raises(ValueError, match=r"at least 2 x parallel.pipeline_model_parallel_size \(6\)"):
        _build(3, 5, 2, method="dualpipev")
