"""Pipeline schedules as data: pure functions from sizes to each stage's ordered list of actions.

The model trunk is cut into ``num_chunks = num_stages * virtual_stages`` consecutive chunks; chunk ``c``
lives on stage ``c % num_stages`` (Megatron's loop placement), so with one virtual stage chunk == stage.
An action is the forward or backward of one (micro-batch, chunk). Communication is implied: the
forward of (i, c) needs the forward output of (i, c-1), the backward of (i, c) needs the backward of
(i, c+1). The runtime derives the sends and receives from that, so a schedule cannot forget one.

- ``gpipe``: all forwards, then all backwards (Huang et al., 2019).
- ``one_f_one_b``: PipeDream-flush / 1F1B; stage s keeps at most ``p - s`` micro-batches in flight
  (Narayanan et al., 2021).
- ``interleaved_one_f_one_b``: virtual stages (Narayanan et al., SC'21, Megatron-LM's interleaved
  schedule): the bubble shrinks by ``v`` for ``v`` times more messages.

``simulate`` executes a schedule on a virtual clock with gloo's semantics as the runtime uses them
(sends never block, receives block until the producer has finished), reporting deadlocks, per-stage
bubble and peak in-flight micro-batches without any process group.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

Kind = Literal["F", "B"]


class Action(NamedTuple):
    kind: Kind
    microbatch: int
    chunk: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


Schedule = dict[int, list[Action]]  # stage -> ordered actions


def _check(num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> None:
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    if virtual_stages < 1:
        raise ValueError(f"virtual_stages must be >= 1, got {virtual_stages}")


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """All forwards in micro-batch order, then all backwards in the same order."""
    _check(num_stages, num_microbatches)
    m = range(num_microbatches)
    return {s: [Action("F", i, s) for i in m] + [Action("B", i, s) for i in m] for s in range(num_stages)}


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """1F1B: ``p - s - 1`` warm-up forwards on stage s, then alternate forward/backward, then drain."""
    _check(num_stages, num_microbatches)
    schedule: Schedule = {}
    for s in range(num_stages):
        warmup = min(num_stages - s - 1, num_microbatches)
        order = [Action("F", i, s) for i in range(warmup)]
        for i in range(num_microbatches - warmup):
            order += [Action("F", warmup + i, s), Action("B", i, s)]
        order += [Action("B", i, s) for i in range(num_microbatches - warmup, num_microbatches)]
        schedule[s] = order
    return schedule


def interleaved_one_f_one_b(num_stages: int, num_microbatches: int, virtual_stages: int) -> Schedule:
    """Megatron's interleaved 1F1B over ``virtual_stages`` chunks per stage.

    Forwards go in rounds of ``p`` micro-batches through chunk 0, then chunk 1, ...; backwards in the
    same rounds through the chunks in reverse. Requires ``num_microbatches % num_stages == 0``.
    """
    _check(num_stages, num_microbatches, virtual_stages)
    p, m, v = num_stages, num_microbatches, virtual_stages
    if m % p:
        raise ValueError(
            f"interleaved 1F1B needs num_microbatches ({m}) to be a multiple of the number of pipeline"
            f" stages ({p}); use num_microbatches={max(p, m - m % p)} or {m + p - m % p}"
        )
    total = m * v

    def forward(k: int, s: int) -> Action:
        return Action("F", (k // (p * v)) * p + k % p, (k // p) % v * p + s)

    def backward(k: int, s: int) -> Action:
        return Action("B", (k // (p * v)) * p + k % p, (v - 1 - (k // p) % v) * p + s)

    schedule: Schedule = {}
    for s in range(p):
        warmup = total if m == p else min((p - s - 1) * 2 + (v - 1) * p, total)
        order = [forward(k, s) for k in range(warmup)]
        for k in range(total - warmup):
            order += [forward(warmup + k, s), backward(k, s)]
        order += [backward(k, s) for k in range(total - warmup, total)]
        schedule[s] = order
    return schedule


SCHEDULES: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved_1f1b": interleaved_one_f_one_b,
}


def build_schedule(name: str, num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """Look a generator up by name and validate the result."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    if name == "interleaved_1f1b":
        schedule = interleaved_one_f_one_b(num_stages, num_microbatches, virtual_stages)
    elif virtual_stages != 1:
        raise ValueError(
            f"schedule {name!r} has one chunk per stage; virtual_stages={virtual_stages} needs 'interleaved_1f1b'"
        )
    else:
        schedule = SCHEDULES[name](num_stages, num_microbatches)
    simulate(schedule, num_stages * virtual_stages, num_microbatches)  # raises on any defect
    return schedule


# --------------------------------------------------------------------------------- validation
@dataclass
class Simulation:
    """What a virtual-clock run of a schedule observed."""

    makespan: float
    busy: dict[int, float]
    peak_in_flight: dict[int, int]
    start: dict[tuple[int, Any], float] = field(default_factory=dict)

    def bubble(self, stage: int) -> float:
        """Idle fraction of ``stage`` over the whole step."""
        return 1.0 - self.busy[stage] / self.makespan


def _dependency(a: Action, num_chunks: int) -> tuple[str, int, int] | None:
    if a.kind == "F":
        return ("F", a.microbatch, a.chunk - 1) if a.chunk > 0 else None
    return ("B", a.microbatch, a.chunk + 1) if a.chunk < num_chunks - 1 else None


def simulate(
    schedule: Schedule,
    num_chunks: int,
    num_microbatches: int,
    cost: Callable[[Action], float] = lambda a: 1.0 if a.kind == "F" else 2.0,
    latency: float = 0.0,
) -> Simulation:
    """Run ``schedule`` on a virtual clock; raise ``ValueError`` on any structural defect or deadlock.

    Checks: every (micro-batch, chunk) has exactly one forward and one backward, on the stage that owns
    the chunk; each backward follows its forward on that stage; no cyclic wait when sends never block
    and receives block until the producing action finished (+ ``latency``).
    """
    p = len(schedule)
    want = {(k, i, c) for k in "FB" for i in range(num_microbatches) for c in range(num_chunks)}
    seen: set[tuple[str, int, int]] = set()
    for s, actions in schedule.items():
        for a in actions:
            if a.chunk % p != s:
                raise ValueError(f"{a} is on stage {s} but chunk {a.chunk} belongs to stage {a.chunk % p}")
            key = (a.kind, a.microbatch, a.chunk)
            if key in seen or key not in want:
                raise ValueError(f"{a} on stage {s} is duplicated or out of range")
            if a.kind == "B" and ("F", a.microbatch, a.chunk) not in seen:
                raise ValueError(f"{a} on stage {s} comes before its forward")
            seen.add(key)
    if seen != want:
        raise ValueError(f"schedule misses {sorted(want - seen)[:5]}")

    return simulate_dag(
        schedule, lambda a: [d] if (d := _dependency(a, num_chunks)) else [], cost, latency, lambda a: a.kind == "F"
    )


def simulate_dag(
    schedule: dict[int, list],
    dependencies: Callable[[Any], list[tuple]],
    cost: Callable[[Any], float],
    latency: float,
    is_forward: Callable[[Any], bool],
) -> Simulation:
    """Execute per-stage action lists on a virtual clock: an action starts when its stage is free and
    every action it depends on has finished (+ ``latency`` when that ran on another stage; sends never
    block). Raise ``ValueError`` if no stage can move (a deadlock)."""
    done: dict[tuple, tuple[float, int]] = {}
    clock, busy = dict.fromkeys(schedule, 0.0), dict.fromkeys(schedule, 0.0)
    pos, live, peak = dict.fromkeys(schedule, 0), dict.fromkeys(schedule, 0), dict.fromkeys(schedule, 0)
    start: dict[tuple[int, Any], float] = {}
    while any(pos[s] < len(schedule[s]) for s in schedule):
        progressed = False
        for s, actions in schedule.items():
            while pos[s] < len(actions):
                a = actions[pos[s]]
                deps = dependencies(a)
                if any(d not in done for d in deps):
                    break
                ready = [done[d][0] + (latency if done[d][1] != s else 0.0) for d in deps]
                t0 = max([clock[s], *ready])
                start[(s, a)] = t0
                clock[s] = t0 + cost(a)
                busy[s] += cost(a)
                done[tuple(a)] = (clock[s], s)
                live[s] += 1 if is_forward(a) else -1
                peak[s] = max(peak[s], live[s])
                pos[s] += 1
                progressed = True
        if not progressed:
            blocked = {s: str(schedule[s][pos[s]]) for s in schedule if pos[s] < len(schedule[s])}
            raise ValueError(f"schedule deadlocks; stages blocked at {blocked}\n{format_schedule(schedule)}")
    return Simulation(makespan=max(clock.values()), busy=busy, peak_in_flight=peak, start=start)


def format_schedule(schedule: Schedule) -> str:
    """A step x stage grid: one row per stage, one column per action slot."""
    width = max(len(str(a)) for actions in schedule.values() for a in actions) + 1
    rows = [f"stage {s}: " + "".join(str(a).ljust(width) for a in schedule[s]) for s in sorted(schedule)]
    return "\n".join(rows)
