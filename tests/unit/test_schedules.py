"""Schedule generators: invariants checked by simulation, without any process group."""

import pytest

from lightning_parallel.pipeline.schedules import (
    Action,
    build_schedule,
    format_schedule,
    gpipe,
    interleaved_one_f_one_b,
    one_f_one_b,
    simulate,
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
    with pytest.raises(ValueError, match="virtual_stages=2 needs 'interleaved_1f1b'"):
        build_schedule("gpipe", 2, 4, virtual_stages=2)


def test_format_schedule_grid():
    grid = format_schedule(one_f_one_b(2, 3))
    assert grid.splitlines()[0].split()[:3] == ["stage", "0:", "F0"]
    assert "B2" in grid.splitlines()[1]
