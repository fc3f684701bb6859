"""One runtime for every schedule: execute one stage's actions, driving the user's own step code.

Per forward action (micro-batch i, chunk c) on the stage that owns chunk c:

1. capture micro-batch i once per step on this stage (``capture.capture``: the user's step runs up to
   the trunk; block arguments are recorded);
2. take the chunk's input: the captured trunk input (chunk 0, graph to the pre-trunk kept) or the
   previous chunk's output, received as a leaf that requires grad;
3. call the chunk's blocks explicitly with their captured arguments (recomputation wraps these calls);
4. send the output on, or, for the last chunk, re-enter the user's step with the trunk output
   substituted (``capture.substitute``) and keep the loss.

Per backward action: back-propagate the loss (scaled by the micro-batch's weight) or the received
output gradient, and send the input's gradient back. Sends are posted without waiting and completed at
the end of the step; only receives block. Every action is recorded in ``timeline`` (start, end, when
its receive started and ended, and the producer's send time carried in the message's header), all in
``time.time()`` so that events of different processes share one clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_parallel import _collectives
from lightning_parallel.pipeline.capture import (
    Capture,
    TrunkCallError,
    _forwards,
    capture,
    probe_output_structure,
    split_hidden,
    substitute,
    unwrap_output,
    wrap_output,
)
from lightning_parallel.pipeline.schedules import Action
from lightning_parallel.trunk import Trunk


def structure_of(output: Any) -> Any:
    """``None`` for a tensor output, else an empty tuple/list of the same length (hidden state first)."""
    return type(output)([None] * len(output)) if isinstance(output, (tuple, list)) else None


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


class PipelineRuntime:
    """Executes schedules for one stage. ``chunk_blocks[c]`` are the blocks of model chunk ``c``;
    chunk ``c`` lives on stage ``c % num_stages``, and ``stage_ranks[s]`` is stage s's global rank."""

    def __init__(
        self,
        trunk: Trunk,
        chunk_blocks: list[range],
        stage: int,
        stage_ranks: list[int],
        group: Any,
        device: torch.device,
    ) -> None:
        self.trunk, self.chunk_blocks, self.stage = trunk, chunk_blocks, stage
        self.stage_ranks, self.group, self.device = stage_ranks, group, device
        self.num_stages, self.num_chunks = len(stage_ranks), len(chunk_blocks)
        self.local_chunks = [c for c in range(self.num_chunks) if c % self.num_stages == stage]
        self.output_like: Any = None  # the blocks' output structure (None: a plain tensor)
        self._like_known = False
        self.phase: str | None = None  # "capture" or "loss" while the user's step runs inside the schedule
        self.timeline: list[TimelineEvent] = []
        local = {j for c in self.local_chunks for j in chunk_blocks[c]}
        self._freed = next((j for j in range(len(trunk)) if j not in local), None)  # a block on meta, if any

    def rank_of(self, chunk: int) -> int:
        return self.stage_ranks[chunk % self.num_stages]

    # ------------------------------------------------------------------------------- training
    def run(
        self,
        actions: list[Action],
        steps: list[Callable[[], Any]],
        loss_of: Callable[[Any], Tensor],
        loss_weights: list[float],
    ) -> dict[int, tuple[Tensor, Any]]:
        """Run one training step's actions; ``steps[i]()`` runs the user's step on micro-batch i.

        Returns, on the stage holding the last chunk, ``{i: (loss_i detached, step output)}``.
        """
        self.timeline = []
        self._steps, self._loss_of, self._weights = steps, loss_of, loss_weights
        self._captures: dict[int, Capture] = {}
        self._pending_chunks = {i: len(self.local_chunks) for i in range(len(steps))}
        self._saved: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}
        self._sends: list[tuple[Any, Tensor]] = []
        results: dict[int, tuple[Tensor, Any]] = {}
        try:
            for a in actions:
                start, self._clock = time.time(), RecvClock()
                self._forward(a, results) if a.kind == "F" else self._backward(a)
                self.timeline.append(self._clock.event(self.stage, a.kind, a.microbatch, a.chunk, start))
            for work, _ in self._sends:
                work.wait()
        finally:
            self._captures, self._saved, self._sends = {}, {}, []
        return results

    def capture_step(self, step: Callable[[], Any], probe: nn.Module | None = None) -> Capture:
        """``capture.capture`` of ``step``; if user code indexed a block's output (``layer(h)[0]``) before its
        structure was known, the structure is learned from a call of ``probe`` (a freed block, or any block
        when ``probe`` is given) on meta tensors and the capture is retried."""
        self.phase = "capture"
        try:
            return capture(self.trunk, step, self.output_like)
        except TrunkCallError as err:
            block = (
                probe if probe is not None else (self.trunk.blocks[self._freed] if self._freed is not None else None)
            )
            if err.first_call is None or block is None or self._like_known:
                raise
            self.output_like = probe_output_structure(block, *err.first_call)
            self._like_known = True
            if self.output_like is None:
                raise
            return capture(self.trunk, step, self.output_like)
        finally:
            self.phase = None

    def _capture(self, i: int) -> Capture:
        if i in self._captures:
            return self._captures[i]
        cap = self.capture_step(self._steps[i])
        if 0 not in self.local_chunks:
            cap.trunk_input = cap.trunk_input.detach()  # only chunk 0 needs the pre-trunk graph
        self._captures[i] = cap
        return cap

    def _run_chunk(self, c: int, hidden: Tensor, cap: Capture) -> Any:
        out: Any = hidden
        for j in self.chunk_blocks[c]:
            args, kwargs = cap.block_args[j]
            out = self.trunk.blocks[j](hidden, *args, **kwargs)  # recomputation, if any, wraps the block itself
            hidden = unwrap_output(out, self.trunk.blocks[j])
        return out

    def _forward(self, a: Action, results: dict) -> None:
        i, c = a.microbatch, a.chunk
        cap = self._capture(i)
        if c == 0:
            x = cap.trunk_input
        else:
            with self._clock as clock:
                x, clock.sent = _collectives.recv_with_header(
                    self.rank_of(c - 1), self._tag("F", i, c), self.group, self.device
                )
            x.requires_grad_(True)
        out = self._run_chunk(c, x, cap)
        y = unwrap_output(out, self.trunk.blocks[-1])
        if c == self.num_chunks - 1:
            self.output_like, self._like_known = structure_of(out), True
            self.phase = "loss"
            try:
                step_out = substitute(self.trunk, self._steps[i], out)
            finally:
                self.phase = None
            loss = self._loss_of(step_out)
            self._saved[(i, c)] = (x, loss)
            results[i] = (loss.detach(), step_out)
        else:
            self._sends += _collectives.isend_with_header(y, self.rank_of(c + 1), self._tag("F", i, c + 1), self.group)
            self._saved[(i, c)] = (x, y)

    def _backward(self, a: Action) -> None:
        i, c = a.microbatch, a.chunk
        x, y = self._saved.pop((i, c))
        retain = self._captures[i].needs_grad and self._pending_chunks[i] > 1
        if c == self.num_chunks - 1:
            torch.autograd.backward(y * self._weights[i], retain_graph=retain)
        else:
            with self._clock as clock:
                grad, clock.sent = _collectives.recv_into_timed(
                    torch.empty_like(y), self.rank_of(c + 1), self._tag("B", i, c), self.group
                )
            torch.autograd.backward(y, grad, retain_graph=retain)
        if c > 0:
            grad_x = x.grad if x.grad is not None else torch.zeros_like(x)
            self._sends += _collectives.isend_timed(grad_x, self.rank_of(c - 1), self._tag("B", i, c - 1), self.group)
        self._pending_chunks[i] -= 1
        if self._pending_chunks[i] == 0:
            del self._captures[i]

    def _tag(self, kind: str, microbatch: int, chunk: int) -> int:
        """The tag of the message consumed by action (kind, microbatch, chunk); unique within a step."""
        return (microbatch * 2 + (kind == "B")) * self.num_chunks + chunk

    # ----------------------------------------------------------------------------- lock-step
    def lockstep(self, step: Callable[[], Any]) -> Any:
        """Run ``step`` on every stage with each trunk pass going through the stages in order.

        Each local chunk receives its input from the previous chunk's stage and sends its output on;
        the last chunk's stage broadcasts the trunk output to every stage, so all stages run the same
        post-trunk code (validation, test, predict, and any number of trunk passes per step).
        """
        blocks = self.trunk.blocks
        last = len(blocks) - 1
        chunk_of = {j: c for c, r in enumerate(self.chunk_blocks) for j in r}
        sends: list[tuple[Any, Tensor]] = []
        state = {"pass": 0}

        def make(j: int, block: nn.Module) -> Callable[..., Any]:
            c = chunk_of[j]
            local = c % self.num_stages == self.stage
            real = block.__dict__.get("forward") or type(block).forward.__get__(block)  # its stack, if composed

            def forward(*a: Any, **kw: Any) -> Any:
                hidden, (args, kwargs) = split_hidden(self.trunk, a, kw)
                tag = (1 << 24) + state["pass"] * self.num_chunks + c
                if local and j == self.chunk_blocks[c].start and c > 0:
                    hidden, _ = _collectives.recv_with_header(self.rank_of(c - 1), tag, self.group, self.device)
                if local:
                    out = real(hidden, *args, **kwargs)
                    self.output_like, self._like_known = structure_of(out), True
                else:
                    if not self._like_known and self._freed is not None:
                        self.output_like = probe_output_structure(blocks[self._freed], hidden, (args, kwargs))
                        self._like_known = True
                    out = wrap_output(hidden, self.output_like)
                if local and j == self.chunk_blocks[c].stop - 1 and c < self.num_chunks - 1:
                    sends.extend(
                        _collectives.isend_with_header(
                            unwrap_output(out, block), self.rank_of(c + 1), tag + 1, self.group
                        )
                    )
                if j == last:
                    state["pass"] += 1
                    mine = unwrap_output(out, block) if local else None
                    final = _collectives.broadcast_with_header(mine, self.rank_of(c), self.group, self.device)
                    out = out if local else wrap_output(final, self.output_like)
                return out

            return forward

        with _forwards(blocks, make):
            result = step()
        for work, _ in sends:
            work.wait()
        return result
