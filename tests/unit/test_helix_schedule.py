"""HelixPipe's two-fold FILO schedule: invariants and the noise-free virtual-clock gate against 1F1B."""

from collections import Counter

import pytest

from lightning_parallel.pipeline.helix_schedule import attention_stage, helix, simulate_helix
from lightning_parallel.pipeline.schedules import format_schedule, one_f_one_b, simulate

SIZES = [
    (p, L, m, F) for p in (2, 3, 4, 8) for L in (p, 2 * p, 4 * p) for F in (1, 2) for m in (p * F, 2 * p * F, 3 * p * F)
]


def unit_cost(a):
    return (1.0 if a.kind[1] == "P" else 2.0) * (1 if a.kind[0] == "F" else 2)


@pytest.mark.parametrize("p,L,m,F", SIZES)
def test_complete_placed_filo_and_deadlock_free(p, L, m, F):
    schedule = helix(p, L, m, F)
    simulate_helix(schedule, L, m, F, unit_cost)  # raises on a missing/duplicate/misplaced op, non-FILO order, deadlock
    attentions = Counter(s for s, actions in schedule.items() for a in actions if a.kind[1] == "A" and a.kind[0] == "F")
    assert all(attentions[s] == L * m // p for s in range(p))  # attention work is spread evenly
    for s, actions in schedule.items():
        for a in actions:
            if a.kind[1] == "A":
                assert attention_stage(a.chunk, a.microbatch, p, F) == s == (a.chunk + (a.microbatch // F) % p) % p


def test_attentions_of_one_group_run_on_all_stages():
    p, F = 4, 2
    stages = {attention_stage(3, b, p, F) for b in range(p * F)}
    assert stages == set(range(p))


def _costs(L, p, t_attn=0.7, t_pre=0.1, t_post=0.2, t_edge=0.02):
    """Per-layer costs with attention at 70% of the block (T=4096 on this CPU); backward = 2 x forward."""

    def helix_cost(a):
        c = (
            t_attn
            if a.kind[1] == "A"
            else t_edge + t_pre
            if a.chunk == 0
            else t_post + t_edge
            if a.chunk == L
            else t_post + t_pre
        )
        return c if a.kind[0] == "F" else 2 * c

    def one_f_one_b_cost(a):
        c = (L // p) * (t_attn + t_pre + t_post) + t_edge * ((a.chunk == 0) + (a.chunk == p - 1))
        return c if a.kind == "F" else 2 * c

    return helix_cost, one_f_one_b_cost


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("F", [1, 2])
def test_virtual_clock_helix_bubble_below_one_f_one_b(p, F):
    L, m = 2 * p, 2 * p * F
    helix_cost, f1b_cost = _costs(L, p)
    h = simulate_helix(helix(p, L, m, F), L, m, F, helix_cost, latency=0.01)
    o = simulate(one_f_one_b(p, m), p, m, cost=f1b_cost, latency=0.01)
    mean_bubble = lambda sim: 1 - sum(sim.busy.values()) / (p * sim.makespan)  # noqa: E731
    assert sum(h.busy.values()) == pytest.approx(sum(o.busy.values()))  # same work on both sides
    assert mean_bubble(h) < mean_bubble(o)
    assert h.makespan < o.makespan


def test_two_folds_hide_communication_latency():
    p, L, m = 4, 8, 8
    helix_cost, _ = _costs(L, p)
    one = simulate_helix(helix(p, L, m, 1), L, m, 1, helix_cost, latency=0.3)
    two = simulate_helix(helix(p, L, m, 2), L, m, 2, helix_cost, latency=0.3)
    assert two.makespan < one.makespan


def test_size_errors():
    with pytest.raises(
        ValueError, match=r"number of blocks \(6\) to be a multiple of the number of pipeline stages \(4\)"
    ):
        helix(4, 6, 8)
    with pytest.raises(
        ValueError, match=r"num_microbatches \(6\) to be a multiple of pipeline stages x folds \(2 x 2 = 4\)"
    ):
        helix(2, 4, 6, 2)
    with pytest.raises(ValueError, match="folds must be 1 or 2, got 3"):
        helix(2, 4, 6, 3)
    with pytest.raises(ValueError, match="at least 2 pipeline stages"):
        helix(1, 4, 4, 1)


def test_format_grid():
    grid = format_schedule(helix(2, 4, 4, 1)).splitlines()
    assert grid[0].split()[:3] == ["stage", "0:", "FP0"] and "BA0.1" in grid[1]  # kind, micro-batch . index
