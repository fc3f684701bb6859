"""Pipeline schedules as data: pure functions from sizes to each stage's ordered list of actions.

The model trunk is cut into ``num_chunks = num_stages * virtual_stages`` consecutive chunks; chunk ``c``
lives on stage ``c % num_stages`` (Megatron's loop placement), so with one virtual stage chunk == stage.
An action is one unit of work of one (micro-batch, chunk): ``F`` its forward, ``B`` its whole
backward, or the backward split in two (Qi et al., ICLR 2024, "Zero Bubble Pipeline Parallelism"):
``I`` the gradient of the chunk's input (what the previous stage waits for) and ``W`` the gradient of
its weights (which nobody waits for, so a schedule may put it in a bubble). Communication is implied:
the forward of (i, c) needs the forward output of (i, c-1), the backward of (i, c) (``B`` or ``I``)
needs the input gradient of (i, c+1). The runtime derives the sends and receives from that, so a
schedule cannot forget one. HelixPipe's schedule (``helix_schedule``) uses the same action type with
its own kinds (``FP``/``BP`` param chunks, ``FA``/``BA`` attention).

- ``gpipe``: all forwards, then all backwards (Huang et al., 2019).
- ``one_f_one_b``: PipeDream-flush / 1F1B; stage s keeps at most ``p - s`` micro-batches in flight
  (Narayanan et al., 2021).
- ``interleaved_one_f_one_b``: virtual stages (Narayanan et al., SC'21, Megatron-LM's interleaved
  schedule): the bubble shrinks by ``v`` for ``v`` times more messages.
- ``zb_h1``: 1F1B's order with the backward split; stage s defers ``s`` weight gradients into the
  cool-down, where 1F1B idles, so every stage keeps at most p micro-batches (1F1B's peak) and the bubble
  falls from (p-1)(F+B) to (p-1)(F+I-W) (Qi et al., §3.1, ZB-H1).
- ``zbv``: two chunks per stage placed in a V (stage s holds chunks s and 2p-1-s, so the first and the
  last chunk share stage 0) with split backwards (Qi et al., §6, ZB-V): about zero bubble when F, I
  and W cost the same, at 1F1B's peak activation memory.

``simulate`` executes a schedule on a virtual clock with gloo's semantics as the runtime uses them
(sends never block, receives block until the producer has finished), reporting deadlocks, per-stage
bubble and peak in-flight micro-batches without any process group.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

Kind = Literal["F", "B", "I", "W", "FP", "BP", "FA", "BA"]


class Action(NamedTuple):
    """One unit of work: ``kind`` of ``microbatch`` on ``chunk`` (helix: the param chunk or layer index)."""

    kind: Kind
    microbatch: int
    chunk: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


Schedule = dict[int, list[Action]]  # stage -> ordered actions


def chunk_stages(num_stages: int, virtual_stages: int, style: Literal["loop", "v"] = "loop") -> list[int]:
    """The stage of each chunk: ``"loop"`` puts chunk c on stage c mod p (Megatron's interleaving);
    ``"v"`` (two chunks per stage) puts chunk c < p on stage c and chunk c >= p on stage 2p-1-c."""
    p, n = num_stages, num_stages * virtual_stages
    if style == "v":
        if virtual_stages != 2:
            raise ValueError(f"the V placement has two chunks per stage, got virtual_stages={virtual_stages}")
        return [c if c < p else 2 * p - 1 - c for c in range(n)]
    return [c % p for c in range(n)]


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


def zb_h1(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-H1: 1F1B's warm-up and steady state with ``I`` in place of ``B``; stage s runs a ``W`` after each
    ``I`` except that it holds back its first ``s`` of them, which fill the idle time of its cool-down
    (stage s's last input gradient leaves s action-times before stage 0's). In flight (forward done,
    ``W`` not): at most ``(p - s - 1) + 1 + s = p`` on every stage."""
    _check(num_stages, num_microbatches)
    return {s: _zb_h1_stage(s, num_stages, num_microbatches) for s in range(num_stages)}


def _zb_h1_stage(s: int, p: int, m: int) -> list[Action]:
    warmup = min(p - s - 1, m)
    order = [Action("F", i, s) for i in range(warmup)]
    weights = 0
    for i in range(m):  # one I per micro-batch, after the forward that keeps the 1F1B shape
        if warmup + i < m:
            order.append(Action("F", warmup + i, s))
        order.append(Action("I", i, s))
        if i >= s:  # the first s weight gradients wait for the cool-down
            order.append(Action("W", weights, s))
            weights += 1
    return order + [Action("W", i, s) for i in range(weights, m)]


def zbv(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-V (Qi et al., §6): stage s holds chunks ``s`` (going down the V) and ``2p-1-s`` (coming back).
    Warm-up: ``2(p-s)-1`` forwards of the first chunk, ``s`` pairs of forwards of both, then ``p-s`` rounds
    of the second chunk's F, I, W; steady state: F, I, W of each chunk in turn; cool-down: ``s`` pairs of
    input gradients, then ``p-s`` of the first chunk's I and W; the weights left last. Built for
    ``max(m, 2p-1)`` micro-batches and the ones beyond ``m`` dropped (the shape needs at least 2p-1)."""
    _check(num_stages, num_microbatches)
    n = max(num_microbatches, 2 * num_stages - 1)
    schedule = {s: _ZbvStage(s, num_stages).build(n) for s in range(num_stages)}
    return {s: [a for a in actions if a.microbatch < num_microbatches] for s, actions in schedule.items()}


class _ZbvStage:
    """One stage's ZB-V order, appended action by action with a micro-batch counter per (kind, chunk)."""

    def __init__(self, s: int, p: int) -> None:
        self.s, self.p, self.down, self.up = s, p, s, 2 * p - 1 - s
        self.count = {(k, c): 0 for k in "FIW" for c in (self.down, self.up)}
        self.order: list[Action] = []

    def act(self, *steps: tuple[str, int]) -> None:
        for kind, chunk in steps:
            self.order.append(Action(kind, self.count[(kind, chunk)], chunk))  # type: ignore[arg-type]
            self.count[(kind, chunk)] += 1

    def build(self, n: int) -> list[Action]:
        s, p, down, up, count = self.s, self.p, self.down, self.up, self.count
        for _ in range(2 * (p - s) - 1):
            self.act(("F", down))
        for _ in range(s):
            self.act(("F", up), ("F", down))
        for _ in range(p - s):
            self.act(("F", up), ("I", up), ("W", up))
        while count[("F", up)] < count[("F", down)] or count[("F", down)] < n:
            if count[("F", down)] < n:
                self.act(("F", down))
            self.act(("I", down), ("W", down), ("F", up), ("I", up), ("W", up))
        for _ in range(s):
            self.act(("I", down), ("I", up))
        for _ in range(p - s):
            self.act(("I", down), ("W", down))
        for chunk in (up, down):
            while count[("W", chunk)] < count[("I", chunk)]:
                self.act(("W", chunk))
        return self.order


SCHEDULES: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved_1f1b": interleaved_one_f_one_b,
    "zb_h1": zb_h1,
    "zbv": zbv,
}
SPLIT_BACKWARD = frozenset({"zb_h1", "zbv"})  # schedules whose backward is split into I and W
VIRTUAL_STAGES = {"interleaved_1f1b": None, "zbv": 2}  # chunks per stage where not 1 (None: any, default 2)


@dataclass(frozen=True)
class PipelineSettings:
    """A pipeline strategy's schedule settings, validated when the strategy is built (the arguments of
    ``PipelineParallelStrategy`` of the same names; ``virtual_stages`` resolved: 2 for the interleaved and V
    schedules unless given, else 1)."""

    schedule: str = "1f1b"
    num_microbatches: int | None = None
    virtual_stages: int | None = None
    layers_per_stage: list[int] | None = None
    loss_reduction: str = "mean"
    check_batches: int = 2

    def __post_init__(self) -> None:
        name, virtual, m = self.schedule, self.virtual_stages, self.num_microbatches
        if name not in SCHEDULES:
            raise ValueError(f"schedule={name!r}; choose one of {sorted(SCHEDULES)}")
        virtual = virtual or (2 if name in VIRTUAL_STAGES else 1)
        if name == "zbv" and virtual != 2:
            raise ValueError(f"schedule='zbv' runs two chunks per stage (a V); got virtual_stages={virtual}")
        if virtual != 1 and name not in VIRTUAL_STAGES:
            raise ValueError(f"virtual_stages={virtual} needs schedule='interleaved_1f1b' (got {name!r})")
        if m is not None and (isinstance(m, bool) or m < 1):
            raise ValueError(f"num_microbatches must be a positive int, got {m!r}")
        if self.loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {self.loss_reduction!r}")
        object.__setattr__(self, "virtual_stages", virtual)

    @property
    def virtual(self) -> int:
        return self.virtual_stages or 1


def placement_style(name: str) -> Literal["loop", "v"]:
    return "v" if name == "zbv" else "loop"


def forwards_first(schedule: dict[int, list[Any]]) -> bool:
    """Whether every stage runs all its forward actions before its first backward action."""
    for actions in schedule.values():
        kinds = [a.kind[0] for a in actions]
        if "B" in kinds and "F" in kinds[kinds.index("B") :]:
            return False
        if "I" in kinds and "F" in kinds[kinds.index("I") :]:
            return False
    return True


def build_schedule(name: str, num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """Look a generator up by name and validate the result."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    if name == "interleaved_1f1b":
        schedule = interleaved_one_f_one_b(num_stages, num_microbatches, virtual_stages)
    elif name == "zbv":
        if virtual_stages != 2:
            raise ValueError(f"schedule 'zbv' has two chunks per stage (a V); got virtual_stages={virtual_stages}")
        schedule = zbv(num_stages, num_microbatches)
    elif virtual_stages != 1:
        raise ValueError(
            f"schedule {name!r} has one chunk per stage; virtual_stages={virtual_stages} needs 'interleaved_1f1b'"
        )
    else:
        schedule = SCHEDULES[name](num_stages, num_microbatches)
    stages = chunk_stages(num_stages, virtual_stages, placement_style(name))
    simulate(schedule, num_stages * virtual_stages, num_microbatches, stages=stages)  # raises on any defect
    return schedule


# --------------------------------------------------------------------------------- validation
@dataclass
class Simulation:
    """What a virtual-clock run of a schedule observed."""

    makespan: float
    busy: dict[int, float]
    peak_in_flight: dict[int, float]
    start: dict[tuple[int, Any], float] = field(default_factory=dict)

    def bubble(self, stage: int) -> float:
        """Idle fraction of ``stage`` over the whole step."""
        return 1.0 - self.busy[stage] / self.makespan


def _dependencies(a: Action, num_chunks: int, split: bool) -> list[tuple[str, int, int]]:
    if a.kind == "F":
        return [("F", a.microbatch, a.chunk - 1)] if a.chunk > 0 else []
    if a.kind == "W":
        return [("I", a.microbatch, a.chunk)]
    return [("I" if split else "B", a.microbatch, a.chunk + 1)] if a.chunk < num_chunks - 1 else []


def simulate(
    schedule: Schedule,
    num_chunks: int,
    num_microbatches: int,
    cost: Callable[[Action], float] = lambda a: 1.0 if a.kind == "F" else 2.0,
    latency: float | Callable[[tuple, Action], float] = 0.0,
    stages: list[int] | None = None,
    held: Callable[[Action], float] | None = None,
) -> Simulation:
    """Run ``schedule`` on a virtual clock; raise ``ValueError`` on any structural defect or deadlock.

    ``stages[c]`` is chunk c's stage (default: c mod p). Checks: every (micro-batch, chunk) has exactly
    one forward and either one ``B`` or one ``I`` and one ``W`` (the same split for the whole schedule),
    on the stage that owns the chunk; each backward follows its forward, each ``W`` its ``I``, on that
    stage; no cyclic wait when sends never block and receives block until the producing action finished
    (+ ``latency``, a number or a function of the dependency's key and the consumer). In flight: a
    micro-batch's chunk counts from its forward to its ``B`` or ``W``; ``held(a)`` replaces that count
    by any per-action change (bytes, for the planner's memory).
    """
    p = len(schedule)
    stages = stages if stages is not None else [c % p for c in range(num_chunks)]
    split = any(a.kind == "I" for actions in schedule.values() for a in actions)
    kinds = "FIW" if split else "FB"
    want = {(k, i, c) for k in kinds for i in range(num_microbatches) for c in range(num_chunks)}
    before = {"B": "F", "I": "F", "W": "I"}
    seen: set[tuple[str, int, int]] = set()
    for s, actions in schedule.items():
        for a in actions:
            if not 0 <= a.chunk < num_chunks:
                raise ValueError(f"{a} on stage {s} names chunk {a.chunk}; the model has {num_chunks} chunks")
            if stages[a.chunk] != s:
                raise ValueError(f"{a} is on stage {s} but chunk {a.chunk} belongs to stage {stages[a.chunk]}")
            key = (a.kind, a.microbatch, a.chunk)
            if key in seen or key not in want:
                raise ValueError(f"{a} on stage {s} is duplicated or out of range")
            if a.kind in before and (before[a.kind], a.microbatch, a.chunk) not in seen:
                raise ValueError(f"{a} on stage {s} comes before its {'forward' if a.kind != 'W' else 'I'}")
            seen.add(key)
    if seen != want:
        raise ValueError(f"schedule misses {sorted(want - seen)[:5]}")

    return simulate_dag(
        schedule,
        lambda a: _dependencies(a, num_chunks, split),
        cost,
        latency,
        held or (lambda a: {"F": 1, "B": -1, "W": -1}.get(a.kind, 0)),
    )


def simulate_dag(
    schedule: dict[int, list],
    dependencies: Callable[[Any], list[tuple]],
    cost: Callable[[Any], float],
    latency: float | Callable[[tuple, Any], float],
    held: Callable[[Any], float],
) -> Simulation:
    """Execute per-stage action lists on a virtual clock: an action starts when its stage is free and
    every action it depends on has finished (+ ``latency`` when that ran on another stage; sends never
    block). ``held(a)`` is how the action changes the stage's count of micro-batches in flight (+1 when
    it starts holding one, -1 when it lets one go). Raise ``ValueError`` if no stage can move (a deadlock)."""
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
                delay = latency if callable(latency) else (lambda d, a, x=latency: x)
                ready = [done[d][0] + (delay(d, a) if done[d][1] != s else 0.0) for d in deps]
                t0 = max([clock[s], *ready])
                start[(s, a)] = t0
                clock[s] = t0 + cost(a)
                busy[s] += cost(a)
                done[tuple(a)] = (clock[s], s)
                live[s] += held(a)
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
