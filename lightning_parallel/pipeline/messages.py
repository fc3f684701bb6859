"""The order of one step's point-to-point messages, as NCCL needs it.

NCCL ignores tags: between two ranks the i-th send meets the i-th receive (``lightning_parallel._collectives``,
"p2p"). Every action of a schedule receives at most one message, from a stage every rank can name
(``source_of``), so the whole step's message order per pair of stages is known before it starts:

- the **receiver** posts its receives from one stage in the order of its own actions (:class:`Inbox`: a
  receive posted ahead of its action, as helix does, only after every earlier one from that stage);
- the **sender** issues its messages to one stage in that receiver's order (:class:`Outbox`): a message
  produced early waits until every message its receiver consumes before it has gone.

Holding a message back never delays its receiver, which consumes the earlier ones first, so a schedule that
finishes with blocking receives on gloo (matching by tag) finishes under NCCL's order too. ZB-V's
"activation of micro-batch 2 before the input gradient of micro-batch 0" from stage 0 to stage 1 is the case
this exists for: stage 1 consumes the gradient first, so the activation waits.
"""

from __future__ import annotations

from collections.abc import Callable

from lightning_parallel.pipeline.schedules import Action

Key = tuple  # the consuming action: (kind, microbatch, chunk)
SourceOf = Callable[[Action, int], "int | None"]  # (action, its stage) -> the stage it receives from, if any


def message_orders(
    schedule: dict[int, list[Action]], stage: int, source_of: SourceOf
) -> tuple[dict[int, list[Key]], dict[int, list[Key]]]:
    """``(outgoing, incoming)`` for ``stage``: ``outgoing[s]``, the actions of stage s that receive from this one,
    in s's order; ``incoming[s]``, this stage's actions that receive from stage s, in this stage's order.
    Messages between a stage and itself are handed over locally and appear in neither."""
    outgoing: dict[int, list[Key]] = {}
    incoming: dict[int, list[Key]] = {}
    for s, actions in schedule.items():
        for a in actions:
            src = source_of(a, s)
            if src is None or src == s:
                continue
            if src == stage:
                outgoing.setdefault(s, []).append(tuple(a))
            if s == stage:
                incoming.setdefault(src, []).append(tuple(a))
    return outgoing, incoming


class Outbox:
    """Issues a stage's messages to each stage in that stage's order of consumption (module docstring)."""

    def __init__(self, outgoing: dict[int, list[Key]], posted: Callable[[int, list], None]) -> None:
        self.order, self.posted = outgoing, posted  # posted(microbatch, works): keep the sends until complete
        self.next = {s: 0 for s in outgoing}
        self.ready: dict[Key, Callable[[], list]] = {}

    def put(self, dst: int, key: Key, send: Callable[[], list]) -> None:
        """``send()`` issues the message that action ``key`` on stage ``dst`` consumes: now, or once every message
        ``dst`` consumes from this stage before it has been issued."""
        order = self.order.get(dst)
        if order is None or key not in order[self.next[dst] :]:
            raise RuntimeError(f"a message for {key} on stage {dst}, which the schedule does not expect from here")
        self.ready[key] = send
        while self.next[dst] < len(order) and order[self.next[dst]] in self.ready:
            head = order[self.next[dst]]
            self.posted(head[1], self.ready.pop(head)())
            self.next[dst] += 1

    def check_empty(self) -> None:
        """At the end of a step every message has gone."""
        if self.ready or any(self.next[s] != len(o) for s, o in self.order.items()):
            waiting = {s: o[self.next[s] :] for s, o in self.order.items() if self.next[s] != len(o)}
            raise RuntimeError(f"the step ended with messages not sent: {waiting} (held: {sorted(self.ready)})")


class Inbox:
    """Which of a stage's receives may be posted: from each stage, strictly in this stage's action order."""

    def __init__(self, incoming: dict[int, list[Key]]) -> None:
        self.order = incoming
        self.next = {s: 0 for s in incoming}

    def is_next(self, src: int, key: Key) -> bool:
        order = self.order.get(src, [])
        return self.next.get(src, 0) < len(order) and order[self.next[src]] == key

    def take(self, src: int, key: Key) -> None:
        """Record that the receive of ``key`` from ``src`` is posted; it must be the next one from ``src``."""
        if not self.is_next(src, key):
            expected = self.order.get(src, [])[self.next.get(src, 0) :][:1]
            raise RuntimeError(f"receive of {key} from stage {src} posted out of order (next expected: {expected})")
        self.next[src] += 1
