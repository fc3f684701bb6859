"""Where a pipeline step's time goes, from the runtime's per-action timeline (pure functions).

Every ``TimelineEvent`` bounds one action and, if it received a message, its blocking receive
``[recv_start, recv_end]`` and the producer's send time carried in the message. Per stage, over the
step's window (first action start to last action end on any stage of the pipeline replica):

- compute: time in actions outside their receives;
- wait: time in a receive *before* the producer had sent: the stage idles on the schedule (bubble);
- transfer: time in a receive *after* the producer had sent: communication. gloo's sends are rendezvous,
  so "blocked in recv" alone mixes the two; the producer's time splits them;
- idle = window - compute - transfer (waits plus gaps between actions); bubble fraction = idle / window.

The theoretical bubble replays the schedule on a virtual clock (``schedules.simulate_dag``) with each
action's cost set to its measured mean compute time and no latency: what the schedule itself costs,
with the overheads and the transfer removed. For GPipe with equal costs that is (p-1)/(m+p-1).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from lightning_parallel.pipeline.context import TimelineEvent


@dataclass
class StageTimes:
    """Seconds a stage spent in one step, and the fractions the profiler logs."""

    stage: int
    window: float
    compute: float
    wait: float
    transfer: float

    @property
    def idle(self) -> float:
        return max(0.0, self.window - self.compute - self.transfer)

    @property
    def bubble(self) -> float:
        return self.idle / self.window if self.window > 0 else 0.0

    @property
    def comm(self) -> float:
        return self.transfer / self.window if self.window > 0 else 0.0


def split_receive(e: TimelineEvent) -> tuple[float, float]:
    """(wait, transfer) seconds of the event's receive: before and after the producer sent."""
    if e.recv_start is None or e.recv_end is None:
        return 0.0, 0.0
    blocked = e.recv_end - e.recv_start
    if e.producer_sent is None:
        return 0.0, blocked
    wait = min(max(e.producer_sent - e.recv_start, 0.0), blocked)
    return wait, blocked - wait


def stage_times(events: Iterable[TimelineEvent], window: tuple[float, float]) -> StageTimes:
    events = list(events)
    compute = wait = transfer = 0.0
    for e in events:
        w, t = split_receive(e)
        compute += e.end - e.start - e.blocked
        wait, transfer = wait + w, transfer + t
    return StageTimes(events[0].stage if events else -1, window[1] - window[0], compute, wait, transfer)


def analyze(events_by_rank: dict[int, list[TimelineEvent]]) -> dict[int, StageTimes]:
    """Per rank: its stage's times over the window spanned by all the given ranks (one pipeline replica)."""
    spans = [(e.start, e.end) for events in events_by_rank.values() for e in events]
    if not spans:
        return {}
    window = (min(s for s, _ in spans), max(e for _, e in spans))
    return {rank: stage_times(events, window) for rank, events in events_by_rank.items() if events}


def mean_costs(events: Iterable[TimelineEvent]) -> dict[tuple[str, int], float]:
    """Mean compute seconds per (kind, chunk) over micro-batches and ranks: the simulator's op costs."""
    total: dict[tuple[str, int], list[float]] = defaultdict(lambda: [0.0, 0])
    for e in events:
        acc = total[(e.kind, e.chunk)]
        acc[0] += e.end - e.start - e.blocked
        acc[1] += 1
    return {key: s / n for key, (s, n) in total.items()}


def step_span(by_rank: dict[int, list[TimelineEvent]]) -> float:
    """Seconds from a step's first action start to its last action end, over the given ranks."""
    events = [e for events in by_rank.values() for e in events]
    return max(e.end for e in events) - min(e.start for e in events) if events else 0.0


def median_step(
    steps: list[tuple[int, dict[int, list[TimelineEvent]]]],
) -> tuple[int, dict[int, list[TimelineEvent]]]:
    """The step of median duration (the lower median for an even count): one noisy step does not decide
    the picture."""
    ranked = sorted(steps, key=lambda s: step_span(s[1]))
    return ranked[(len(ranked) - 1) // 2]


def legend_labels(kinds: Iterable[str]) -> list[str]:
    """``"FA: forward attention"`` for each action kind drawn (the letters on the timeline's bars)."""
    return [f"{k}: {KIND_NAMES.get(k, k)}" for k in kinds]


# --------------------------------------------------------------------------------- Chrome trace
KIND_NAMES = {"F": "forward", "B": "backward", "I": "input gradient", "W": "weight gradient",
              "FP": "forward param chunk", "FA": "forward attention", "BP": "backward param chunk",
              "BA": "backward attention"}  # fmt: skip


def chrome_trace(steps: list[tuple[int, dict[int, list[TimelineEvent]]]], stage_of: dict[int, int]) -> dict[str, Any]:
    """A Chrome/Perfetto trace (JSON object format) of ``[(global_step, {rank: events})]``: one process per
    rank (named with its stage), one complete ("X") slice per action, and nested slices for the part of
    its receive spent waiting for the producer ("wait") and transferring ("transfer")."""
    starts = [e.start for _, by_rank in steps for events in by_rank.values() for e in events]
    t0 = min(starts) if starts else 0.0
    us = lambda t: round((t - t0) * 1e6, 3)  # noqa: E731
    out: list[dict[str, Any]] = []
    for rank in sorted(stage_of):
        out.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                    "args": {"name": f"rank {rank} (stage {stage_of[rank]})"}})  # fmt: skip
        out.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
    for step, by_rank in steps:
        for rank, events in by_rank.items():
            for e in events:
                name = f"{e.kind}{e.chunk}.{e.microbatch}"
                args = {"step": step, "stage": e.stage, "microbatch": e.microbatch, "chunk": e.chunk}
                out.append({"name": name, "cat": KIND_NAMES.get(e.kind, e.kind), "ph": "X", "pid": rank, "tid": 0,
                            "ts": us(e.start), "dur": max(round(us(e.end) - us(e.start), 3), 0.0),
                            "args": args})  # fmt: skip
                wait, transfer = split_receive(e)
                if e.recv_start is None:
                    continue
                for label, begin, length in (("wait", e.recv_start, wait), ("transfer", e.recv_start + wait, transfer)):
                    if length > 0:  # both ends on the same rounded grid: adjacent slices touch, never overlap
                        ts, end = us(begin), us(begin + length)
                        out.append({"name": label, "cat": "communication", "ph": "X", "pid": rank, "tid": 0,
                                    "ts": ts, "dur": round(end - ts, 3), "args": {"step": step}})  # fmt: skip
    return {"traceEvents": out, "displayTimeUnit": "ms"}
