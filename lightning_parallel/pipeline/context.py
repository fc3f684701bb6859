"""What one training step (:class:`StepContext`) or one lock-step evaluation call (:class:`EvalContext`) of the
pipeline runtime carries, the one interface through which the runtime runs the user's step (:class:`UserStep`),
and the per-action timeline the profiling callbacks read (:class:`TimelineEvent`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import Tensor

from lightning_parallel.pipeline.capture import Capture
from lightning_parallel.pipeline.split_backward import WeightWork


def detached(output: Any) -> Any:
    """``output`` with every tensor detached: a step output kept for Lightning must not hold the graph (a
    split backward retains the graph's saved tensors for as long as anything references it)."""
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.detach() if isinstance(t, Tensor) else t, output)


@dataclass
class TimelineEvent:
    """One executed action, wall times (``time.time()``, seconds). ``recv_start``/``recv_end`` bound the
    action's blocking receive, if it had one; ``producer_sent`` is when the producer posted that message."""

    stage: int
    kind: str
    microbatch: int
    chunk: int
    start: float
    end: float
    recv_start: float | None = None
    recv_end: float | None = None
    producer_sent: float | None = None

    @property
    def blocked(self) -> float:
        """Seconds spent blocked in the receive."""
        return 0.0 if self.recv_start is None or self.recv_end is None else self.recv_end - self.recv_start


class RecvClock:
    """Times one action's blocking receive for its ``TimelineEvent``."""

    def __init__(self) -> None:
        self.start: float | None = None
        self.end: float | None = None
        self.sent: float | None = None

    def __enter__(self) -> RecvClock:
        self.start = time.time()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.end = time.time()

    def event(self, stage: int, kind: str, microbatch: int, chunk: int, start: float) -> TimelineEvent:
        return TimelineEvent(stage, kind, microbatch, chunk, start, time.time(), self.start, self.end, self.sent)


class UserStep(Protocol):
    """The user's ``training_step`` on each micro-batch, the one way the runtime calls it: ``capture(i)`` runs it up
    to the trunk (``capture.capture`` stops it there: the pre-trunk graph and the blocks' arguments), ``loss(i)``
    from the trunk's output on to its loss (its logs and token count are this micro-batch's), ``replay(i)`` the
    loss again inside a backward action (HelixPipe's recomputation: no logs, metric states left as they were).
    Under ``capture.substitute`` the trunk returns the schedule's output instead of running."""

    def __len__(self) -> int: ...

    def capture(self, i: int) -> Any: ...

    def loss(self, i: int) -> Any: ...

    def replay(self, i: int) -> Any: ...


@dataclass(frozen=True)
class PlainSteps:
    """A :class:`UserStep` whose three passes call the same ``steps[i]()`` (no Lightning: benchmarks, tests)."""

    steps: list[Callable[[], Any]]

    def __len__(self) -> int:
        return len(self.steps)

    def capture(self, i: int) -> Any:
        return self.steps[i]()

    loss = replay = capture


@dataclass
class StepContext:
    """The state of one training step on one stage, dropped when the step ends."""

    user: UserStep
    loss_of: Callable[[Any], Tensor]
    weights: list[float]
    captures: dict[int, Capture] = field(default_factory=dict)
    backwards_left: dict[int, int] = field(default_factory=dict)  # per micro-batch; its capture lives until 0
    saved: dict[tuple, Any] = field(default_factory=dict)  # what a forward leaves for its backward
    weight_work: dict[tuple[int, int], WeightWork] = field(default_factory=dict)  # I -> W
    local: dict[tuple, list[Tensor]] = field(default_factory=dict)  # messages to this same stage (helix)
    sends: dict[int, list[tuple[Any, Tensor]]] = field(default_factory=dict)  # per micro-batch, until complete
    results: dict[int, tuple[Tensor, Any]] = field(default_factory=dict)
    shards: dict[int, Any] = field(default_factory=dict)  # per micro-batch, its sequence shard (helix x sp)
    ahead: dict[tuple, Any] = field(default_factory=dict)  # receives posted ahead, by consuming action
    clock: RecvClock = field(default_factory=RecvClock)
    split: bool = False  # the schedule splits the backward into I and W
    pending: list[tuple[int, int, Any, Any]] = field(default_factory=list)  # losses deferred to the turn
    outbox: Any = None  # messages.Outbox: sends in their receivers' order
    inbox: Any = None  # messages.Inbox: receives in this stage's order

    def posted(self, microbatch: int, sends: list[tuple[Any, Tensor]]) -> None:
        """Keep a message's sends (and their payload) until they are known to be complete."""
        self.sends.setdefault(microbatch, []).extend(sends)

    def received(self, microbatch: int) -> None:
        """After a message of ``microbatch`` came from another stage: complete and drop this stage's earlier
        sends of the micro-batch. A micro-batch's actions form one chain (forward chunk by chunk, or helix's
        P_0 -> A_1 -> P_1 -> ... -> P_L, then the same in reverse), so the message just received was produced
        after every earlier message of the chain had been received: the waits return at once, and a payload
        (helix's packed q, k, v and residual are copies) is freed here, not at the end of the step (gloo's
        ``is_completed`` never turns true for p2p, so a send cannot be polled)."""
        for work, _ in self.sends.pop(microbatch, []):
            work.wait()

    def complete_all(self) -> None:
        for sends in self.sends.values():
            for work, _ in sends:
                work.wait()
        self.sends = {}


@dataclass
class EvalContext:
    """The state of one lock-step evaluation call: trunk passes so far, sends to complete, carried state."""

    passes: int = 0
    sends: list[tuple[Any, Tensor]] = field(default_factory=list)
    carry: Any = None
    shard: Any = None  # the trunk pass's sequence shard (helix x sp)
