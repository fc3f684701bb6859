"""Schedule generators: invariants checked by simulation, without any process group."""

import pytest

from lightning_parallel.pipeline.schedules import (
    Action,
    build_schedule,
    chunk_stages,
    format_schedule,
    gpipe,
    interleaved_one_f_one_b,
    one_f_one_b,
    simulate,
    zb_h1,
    zbv,
)

SIZES = [(p, m) for p in (1, 2, 3, 4, 8) for m in (1, 2, 3, 4, 8, 16)]


@pytest.mark.parametrize("p,m", SIZES)
def test_gpipe_holds_all_microbatches(p, m):
    sim = simulate(gpipe(p, m), p, m)
    assert all(sim.peak_in_flight[s] == m for s in range(p))


@pytest.mark.parametrize("p,m", SIZES)
def test_one_f_one_b_in_flight_is_p_minus_s(p, m):
    sim = simulate(one_f_one_b(p, m), p, m)
    assert [sim.peak_in_flight[s] for s in range(p)] == [min(p - s, m) for s in range(p)]


@pytest.mark.parametrize("p,m", SIZES)
def test_bubble_matches_theory_with_equal_costs(p, m):
    # F=1, B=2 per stage: bubble fraction (p-1)/(m+p-1) for both GPipe and 1F1B
    for schedule in (gpipe(p, m), one_f_one_b(p, m)):
        sim = simulate(schedule, p, m)
        assert sim.makespan == pytest.approx(3 * (m + p - 1))
        for s in range(p):
            assert sim.bubble(s) == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize(
    "p,v,m", [(2, 2, 2), (2, 2, 4), (2, 2, 8), (4, 2, 4), (4, 2, 8), (2, 3, 6), (4, 3, 16), (3, 2, 9)]
)
def test_interleaved_is_valid_and_shrinks_the_bubble(p, v, m):
    schedule = interleaved_one_f_one_b(p, m, v)
    sim = simulate(schedule, p * v, m, cost=lambda a: (1.0 if a.kind == "F" else 2.0) / v)
    plain = simulate(one_f_one_b(p, m), p, m)
    assert sim.makespan <= plain.makespan + 1e-9
    if m >= 2 * p:
        assert sim.makespan < plain.makespan
    # every stage keeps chunk c of micro-batch i until its backward: in flight counted per chunk
    assert max(sim.peak_in_flight.values()) <= m * v


def test_interleaved_needs_multiple_of_stages():
    with pytest.raises(
        ValueError, match=r"num_microbatches \(3\) to be a multiple of the number of pipeline stages \(2\)"
    ):
        interleaved_one_f_one_b(2, 3, 2)


def test_forward_precedes_backward_and_each_action_once():
    bad = {0: [Action("B", 0, 0), Action("F", 0, 0)], 1: [Action("F", 0, 1), Action("B", 0, 1)]}
    with pytest.raises(ValueError, match="comes before its forward"):
        simulate(bad, 2, 1)
    dup = {0: [Action("F", 0, 0), Action("F", 0, 0), Action("B", 0, 0)], 1: one_f_one_b(2, 1)[1]}
    with pytest.raises(ValueError, match="duplicated"):
        simulate(dup, 2, 1)
    missing = {0: [Action("F", 0, 0)], 1: one_f_one_b(2, 1)[1]}
    with pytest.raises(ValueError, match="misses"):
        simulate(missing, 2, 1)


def test_deadlock_is_detected():
    # stage 0 needs B0 from stage 1 before it sends F1; stage 1 needs F1 before it runs B0: a cyclic wait
    bad = {
        0: [Action("F", 0, 0), Action("B", 0, 0), Action("F", 1, 0), Action("B", 1, 0)],
        1: [Action("F", 1, 1), Action("B", 1, 1), Action("F", 0, 1), Action("B", 0, 1)],
    }
    with pytest.raises(ValueError, match="deadlocks"):
        simulate(bad, 2, 2)


def test_wrong_stage_is_rejected():
    bad = {0: [Action("F", 0, 1), Action("B", 0, 1)], 1: [Action("F", 0, 0), Action("B", 0, 0)]}
    with pytest.raises(ValueError, match="belongs to stage 1"):
        simulate(bad, 2, 1)


def test_build_schedule_names_and_errors():
    assert build_schedule("1f1b", 2, 4) == one_f_one_b(2, 4)
    with pytest.raises(ValueError, match="unknown schedule 'zb'"):
        build_schedule("zb", 2, 4)
    assert build_schedule("zb_h1", 2, 4) == zb_h1(2, 4)
    with pytest.raises(ValueError, match="virtual_stages=2 needs 'interleaved_1f1b'"):
        build_schedule("gpipe", 2, 4, virtual_stages=2)


def test_format_schedule_grid():
    grid = format_schedule(one_f_one_b(2, 3))
    assert grid.splitlines()[0].split()[:3] == ["stage", "0:", "F0"]
    assert "B2" in grid.splitlines()[1]


@pytest.mark.parametrize("p,m", [(p, m) for p in (2, 3, 4, 8) for m in (1, 2, 4, 8, 16)])
def test_zb_h1_keeps_one_f_one_b_memory_and_cuts_the_bubble_to_a_third(p, m):
    unit = lambda a: 1.0  # noqa: E731  (F = I = W: 1F1B's B costs 2)
    zb = simulate(zb_h1(p, m), p, m, cost=unit)
    plain = simulate(one_f_one_b(p, m), p, m)
    assert max(zb.peak_in_flight.values()) <= min(p, m)  # 1F1B's peak (stage 0 holds p)
    assert plain.makespan == pytest.approx(3 * m + 3 * (p - 1))
    if m >= p:  # a steady state: bubble (p-1)(F + I - W) against 1F1B's 3(p-1)
        assert zb.makespan == pytest.approx(3 * m + (p - 1))
    else:
        assert zb.makespan < plain.makespan


@pytest.mark.parametrize("p,m", [(p, m) for p in (2, 3, 4, 8) for m in (1, 2, 4, 8, 16, 32)])
def test_zbv_places_chunks_in_a_v_and_nearly_removes_the_bubble(p, m):
    stages = chunk_stages(p, 2, "v")
    assert stages[0] == stages[-1] == 0 and stages[p - 1] == stages[p] == p - 1
    sim = simulate(zbv(p, m), 2 * p, m, cost=lambda a: 0.5, stages=stages)  # a chunk is half a stage's blocks
    assert max(sim.peak_in_flight.values()) <= 2 * p  # chunks of half size: p micro-batches' worth
    if m >= 2 * p:
        assert sim.makespan <= 3 * m + (p - 1) / 2 + 1e-9  # against ZB-H1's 3m + (p - 1)


def test_split_backward_is_checked():
    good = zb_h1(2, 2)
    simulate(good, 2, 2, cost=lambda a: 1.0)
    early = {0: [Action("F", 0, 0), Action("W", 0, 0), Action("I", 0, 0)] + good[0][3:], 1: good[1]}
    with pytest.raises(ValueError, match="comes before its I"):
        simulate(early, 2, 2)
    mixed = {0: good[0], 1: one_f_one_b(2, 2)[1]}
    with pytest.raises(ValueError, match="duplicated or out of range|misses"):
        simulate(mixed, 2, 2)
    with pytest.raises(ValueError, match="F0.3 is on stage 0 but chunk 3 belongs to stage 1"):
        simulate(zbv(2, 2), 4, 2)  # the V placement, checked against the loop placement
    assert build_schedule("zbv", 2, 4, 2) == zbv(2, 4)
    with pytest.raises(ValueError, match="'zbv' has two chunks per stage"):
        build_schedule("zbv", 2, 4, 1)
