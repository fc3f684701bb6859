"""One runtime for every schedule: execute one stage's actions, driving the user's own step code.

``run`` is the only training loop: for each action of the stage's list it calls the handler its kind
names in ``handlers`` (as torch's ``_PipelineScheduleRuntime`` dispatches on computation types), with the
step's state in a :class:`StepContext`, and records the action in the timeline. This class registers the
handlers of chunked pipelines (GPipe, 1F1B, interleaved, zero bubble: ``F``, ``B``, ``I``, ``W``);
``HelixRuntime`` registers HelixPipe's (``FP``, ``FA``, ``BP``, ``BA``). Messages follow NCCL's rules
(``pipeline.messages``): each direction between two stages on its own process group (``_p2p.Lanes``),
sent in the order their receiver consumes them, received in action order. Every message is also tagged by
:meth:`tag` from the action that consumes it (gloo matches by tag).

Per forward action (micro-batch i, chunk c) on the stage that owns chunk c:

1. capture micro-batch i once per step on this stage (``capture.capture``: the user's step runs up to
   the trunk; block arguments are recorded);
2. take the chunk's input: the captured trunk input (chunk 0, graph to the pre-trunk kept) or the
   previous chunk's output, received as a leaf that requires grad;
3. call the chunk's blocks explicitly with their captured arguments (recomputation wraps these calls);
4. send the output on, or, for the last chunk, re-enter the user's step with the trunk output
   substituted (``capture.substitute``) and keep the loss (with a mixture's balancing loss, at the *turn*
   between the stage's forward and backward actions, once every stage's router sums are known:
   ``pipeline.balancing``, whose gradient each backward action then adds as a second root).

Per backward action ``B``: back-propagate the loss (scaled by the micro-batch's weight) or the received
output gradient, and send the input's gradient back. A zero-bubble schedule splits it
(``split_backward``): ``I`` computes and sends the input's gradient only, ``W`` the weights' later.
Sends are posted without waiting (held back while an earlier message to the same stage is still to come);
only receives block. A stage's sends of a micro-batch are completed
when its next message from another stage arrives (received by then: ``StepContext.received``), the
rest at the end of the step. Every
action is recorded in ``timeline`` (start, end, when its receive started and ended, and the producer's
send time carried in the message's header), all in ``time.time()`` so that events of different
processes share one clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from torch import Tensor, nn

from lightning_parallel import _p2p
from lightning_parallel.pipeline.balancing import RouterSums
from lightning_parallel.pipeline.capture import (
    Capture,
    _forwards,
    capture,
    probe_output_structure,
    refuse_not_carried,
    split_hidden,
    structure_of,
    substitute,
    unwrap_output,
    wrap_output,
)
from lightning_parallel.pipeline.context import EvalContext, RecvClock, StepContext, TimelineEvent, UserStep, detached
from lightning_parallel.pipeline.messages import Inbox, Outbox, message_orders
from lightning_parallel.pipeline.schedules import Action
from lightning_parallel.pipeline.split_backward import backward_input
from lightning_parallel.trunk import Trunk

# the port of a message: what kind of action consumes it (``I`` takes what ``B`` would; ``E``: evaluation)
_PORTS = {"F": 0, "B": 1, "I": 1, "FP": 0, "BP": 1, "FA": 2, "BA": 3, "E": 4}


class PipelineRuntime:
    """Executes schedules for one stage. ``chunk_blocks[c]`` are the blocks of model chunk ``c``;
    chunk ``c`` lives on stage ``chunk_stages[c]`` (default ``c % num_stages``), and ``stage_ranks[s]`` is
    stage s's global rank."""

    def __init__(
        self,
        trunk: Trunk,
        chunk_blocks: list[range],
        stage: int,
        stage_ranks: list[int],
        lanes: _p2p.Lanes,
        device: torch.device,
        chunk_stages: list[int] | None = None,
    ) -> None:
        self.trunk, self.chunk_blocks, self.stage = trunk, chunk_blocks, stage
        self.stage_ranks, self.lanes, self.group, self.device = stage_ranks, lanes, lanes.group, device
        self.num_stages, self.num_chunks = len(stage_ranks), len(chunk_blocks)
        self.chunk_stages = chunk_stages or [c % self.num_stages for c in range(self.num_chunks)]
        self.local_chunks = [c for c in range(self.num_chunks) if self.chunk_stages[c] == stage]
        self.num_indices = self.num_chunks  # chunk indices a tag must tell apart
        self.output_like: Any = None  # the blocks' output structure (None: a plain tensor)
        self._like_known = False
        self.gradients: Any = None  # this step's gradient buckets (strategies/_overlap.py), or None
        self.balancing: RouterSums | None = None  # this step's router sums (a mixture's balancing loss), or None
        self.timeline: list[TimelineEvent] = []
        local = {j for c in self.local_chunks for j in chunk_blocks[c]}
        self._freed = next((j for j in range(len(trunk)) if j not in local), None)  # a block on meta, if any
        self.handlers: dict[str, Callable[[StepContext, Action], None]] = {
            "F": self._forward,
            "B": self._backward,
            "I": self._backward_input,
            "W": self._backward_weight,
        }

    def rank_of(self, chunk: int) -> int:
        return self.stage_ranks[self.chunk_stages[chunk]]

    def rank_of_stage(self, stage: int) -> int:
        return self.stage_ranks[stage]

    def tag(self, kind: str, microbatch: int, index: int) -> int:
        """The tag of the message that action (``kind``, ``microbatch``, ``index``) consumes; unique within a
        step (and, with ``kind="E"`` and the pass as ``microbatch``, within an evaluation call)."""
        return (microbatch * self.num_indices + index) * len(_PORTS) + _PORTS[kind]

    # ------------------------------------------------------------------------------- training
    def run(
        self,
        schedule: dict[int, list[Action]],
        user: UserStep,
        loss_of: Callable[[Any], Tensor],
        loss_weights: list[float],
    ) -> dict[int, tuple[Tensor, Any]]:
        """Run this stage's actions of one training step's ``schedule`` (every stage's, for the order of the
        messages); ``user`` runs the user's step on each micro-batch.

        Returns, on the stage that runs the loss, ``{i: (loss_i detached, step output)}``.
        """
        self.timeline = []
        actions = schedule[self.stage]
        ctx = StepContext(user, loss_of, loss_weights, split=any(a.kind == "I" for a in actions))
        outgoing, incoming = message_orders(schedule, self.stage, self.source_of)
        ctx.outbox, ctx.inbox = Outbox(outgoing, ctx.posted), Inbox(incoming)
        ctx.backwards_left = {i: 0 for i in range(len(user))}
        for a in actions:
            if a.kind in ("B", "I", "BP", "BA"):
                ctx.backwards_left[a.microbatch] += 1
        last = self.last_weight_actions(actions) if self.gradients is not None else {}
        turn = next((i for i, a in enumerate(actions) if a.kind[0] in "BIW"), len(actions))
        with self.balancing.installed() if self.balancing is not None else nullcontext():
            for i, a in enumerate(actions):
                if i == turn and self.balancing is not None:
                    self._turn(ctx)
                start, ctx.clock = time.time(), RecvClock()
                self._ahead(ctx, actions, i)
                if i in last:  # the unit's weights get their last gradient in this action: its buckets may go
                    self.gradients.open(last[i])
                self.handlers[a.kind](ctx, a)
                if i in last:
                    self.gradients.close(last[i])
                self.timeline.append(ctx.clock.event(self.stage, a.kind, a.microbatch, a.chunk, start))
        ctx.outbox.check_empty()
        ctx.complete_all()
        return ctx.results

    #: the actions that accumulate weight gradients into ``.grad`` (``I`` computes the input's only)
    WEIGHT_KINDS: tuple[str, ...] = ("B", "W")

    def last_weight_actions(self, actions: list[Action]) -> dict[int, int]:
        """Index in ``actions`` of each gradient unit's last weight-gradient action -> the unit (``Action.chunk``:
        a model chunk here, a param chunk ``P_j`` under helix)."""
        last = {a.chunk: i for i, a in enumerate(actions) if a.kind in self.WEIGHT_KINDS}
        return {i: unit for unit, i in last.items()}

    def gradient_units(self, actions: list[Action]) -> list[tuple[int, list[int]]]:
        """This stage's gradient units in the order their last weight-gradient actions come in ``actions``, each
        with the trunk blocks whose parameters it may touch."""
        order = [unit for _, unit in sorted(self.last_weight_actions(actions).items())]
        return [(unit, self.blocks_of_unit(unit)) for unit in order]

    def blocks_of_unit(self, unit: int) -> list[int]:
        """The trunk blocks whose parameters gradient unit ``unit`` (a model chunk) may touch."""
        return list(self.chunk_blocks[unit])

    def source_of(self, a: Action, stage: int) -> int | None:
        """The stage that action ``a`` (run by ``stage``) receives its message from; ``None``: it receives none."""
        if a.kind == "F" and a.chunk > 0:
            return self.chunk_stages[a.chunk - 1]
        if a.kind in ("B", "I") and a.chunk < self.num_chunks - 1:
            return self.chunk_stages[a.chunk + 1]
        return None

    def _turn(self, ctx: StepContext) -> None:
        """Between this stage's forward and backward actions, with a balancing loss (``pipeline.balancing``): the
        batch's router sums; on the loss stage the losses its forward actions deferred."""
        assert self.balancing is not None

        def losses() -> dict[int, Tensor]:
            with self.balancing.losses():  # type: ignore[union-attr]
                for i, c, x, out in ctx.pending:
                    with self.balancing.loss_of(i):  # type: ignore[union-attr]
                        self._loss(ctx, i, c, x, out)
            return {i: self._weighted_loss(ctx, i, c) for i, c, _, _ in ctx.pending}

        self.balancing.turn(self.stage == self._output_stage(), losses)

    def _ahead(self, ctx: StepContext, actions: list[Action], i: int) -> None:
        """Before action ``i`` runs: post receives of later actions ahead (HelixPipe)."""

    def capture_step(self, step: Callable[[], Any], probe: nn.Module | None = None) -> Capture:
        """``capture.capture`` of ``step``; until the blocks' output structure is known, it is learned at the first
        block's call from ``probe`` (a freed block, or any block when ``probe`` is given) called on meta tensors."""
        block = probe if probe is not None else (self.trunk.blocks[self._freed] if self._freed is not None else None)
        learn = None if self._like_known or block is None else (lambda: block)
        cap, like = capture(self.trunk, step, self.output_like, learn)
        if learn is not None and like is not self.output_like:
            self.output_like, self._like_known = like, True
        return cap

    def _capture(self, ctx: StepContext, i: int) -> Capture:
        if i in ctx.captures:
            return ctx.captures[i]
        with self.balancing.capturing(i) if self.balancing is not None else nullcontext():
            cap = self.capture_step(lambda: ctx.user.capture(i))
        if 0 not in self.local_chunks:
            cap.trunk_input = cap.trunk_input.detach()  # only chunk 0 needs the pre-trunk graph
        ctx.captures[i] = cap
        return cap

    def _send_to(self, ctx: StepContext, tensor: Tensor, consumer: Action) -> None:
        """Send ``tensor`` to the action that consumes it: a forward's activation (with its shape in a header)
        or a gradient (the receiver knows the shape). A consumer on this same stage (two chunks of a V)
        gets it handed over, detached, as a receive would give it."""
        stage = self.chunk_stages[consumer.chunk]
        if stage == self.stage:
            ctx.local[tuple(consumer)] = [tensor.detach()]
            return
        dst, tag = self.rank_of(consumer.chunk), self.tag(consumer.kind, consumer.microbatch, consumer.chunk)
        send = _p2p.isend_with_header if consumer.kind == "F" else _p2p.isend_timed
        ctx.outbox.put(stage, tuple(consumer), lambda: send(tensor, dst, tag, self.lanes.to(dst)))

    def _receive(self, ctx: StepContext, src_chunk: int, a: Action, like: Tensor | None = None) -> Tensor:
        """What chunk ``src_chunk`` sent to action ``a`` (a gradient shaped ``like``, else an activation)."""
        if self.chunk_stages[src_chunk] == self.stage:
            return ctx.local.pop(tuple(a))[0]
        ctx.inbox.take(self.chunk_stages[src_chunk], tuple(a))
        src, tag = self.rank_of(src_chunk), self.tag(a.kind, a.microbatch, a.chunk)
        with ctx.clock as clock:
            if like is None:
                out, clock.sent = _p2p.recv_with_header(src, tag, self.lanes.source(src), self.device)
            else:
                out, clock.sent = _p2p.recv_into_timed(torch.empty_like(like), src, tag, self.lanes.source(src))
        ctx.received(a.microbatch)
        return out

    def _backward_done(self, ctx: StepContext, i: int) -> None:
        ctx.backwards_left[i] -= 1
        if ctx.backwards_left[i] == 0:
            ctx.captures.pop(i, None)

    def _run_chunk(self, c: int, hidden: Tensor, cap: Capture) -> Any:
        out: Any = hidden
        for j in self.chunk_blocks[c]:
            args, kwargs = cap.block_args[j]
            out = self.trunk.blocks[j](hidden, *args, **kwargs)  # recomputation, if any, wraps the block itself
            hidden = unwrap_output(out, self.trunk.blocks[j])
        return out

    def _forward(self, ctx: StepContext, a: Action) -> None:
        i, c = a.microbatch, a.chunk
        cap = self._capture(ctx, i)
        if c == 0:
            x = cap.trunk_input
            if ctx.split and x.requires_grad:  # I stops at a leaf; W carries the gradient into the pre-trunk
                ctx.saved[("leaf", i)] = x = x.detach().requires_grad_(True)
        else:
            x = self._receive(ctx, c - 1, a)
            x.requires_grad_(True)
        with self.balancing.running(i, c) if self.balancing is not None else nullcontext():
            out = self._run_chunk(c, x, cap)
        x = cap.trunk_input if c == 0 else x
        y = unwrap_output(out, self.trunk.blocks[-1])
        if c == self.num_chunks - 1 and self.balancing is not None:
            ctx.pending.append((i, c, x, out))  # the loss needs every micro-batch's router sums: at the turn
        elif c == self.num_chunks - 1:
            self._loss(ctx, i, c, x, out)
        else:
            self._send_to(ctx, y, Action("F", i, c + 1))
            ctx.saved[(i, c)] = (x, y)

    def _loss(self, ctx: StepContext, i: int, c: int, x: Tensor, out: Any) -> None:
        """The user's step from the trunk's output ``out`` on to micro-batch i's loss."""
        self.output_like, self._like_known = structure_of(out), True
        step_out = substitute(self.trunk, lambda: ctx.user.loss(i), out)
        loss = ctx.loss_of(step_out)
        ctx.saved[(i, c)] = (x, loss)
        ctx.results[i] = (loss.detach(), detached(step_out))  # the graph is the actions' alone

    def _weighted_loss(self, ctx: StepContext, i: int, c: int) -> Tensor:
        """Micro-batch i's loss (chunk c is the last) times its weight, as its backward will be seeded."""
        return ctx.saved[(i, c)][1] * ctx.weights[i]

    def _roots(self, a: Action) -> tuple[list[Tensor], list[Tensor]]:
        """What a backward action back-propagates besides the chunk's output: its router sums' gradient."""
        return self.balancing.roots(a.microbatch, a.chunk) if self.balancing is not None else ([], [])

    def _output_and_grad(self, ctx: StepContext, a: Action) -> tuple[Tensor, Tensor, Tensor | None]:
        """The chunk's saved input and output (the weighted loss on the last chunk) and the output's
        gradient, received from the next chunk's stage (``None`` for the loss)."""
        i, c = a.microbatch, a.chunk
        x, y = ctx.saved.pop((i, c))
        if c == self.num_chunks - 1:
            return x, y * ctx.weights[i], None
        return x, y, self._receive(ctx, c + 1, a, like=y)

    def _send_input_grad(self, ctx: StepContext, a: Action, grad_x: Tensor | None, x: Tensor) -> None:
        if a.chunk > 0:
            grad_x = grad_x if grad_x is not None else torch.zeros_like(x)
            self._send_to(ctx, grad_x, Action(a.kind, a.microbatch, a.chunk - 1))

    def _backward(self, ctx: StepContext, a: Action) -> None:
        i = a.microbatch
        x, y, grad = self._output_and_grad(ctx, a)
        retain = ctx.captures[i].needs_grad and ctx.backwards_left[i] > 1
        extra, extra_grads = self._roots(a)
        torch.autograd.backward([y, *extra], [grad, *extra_grads], retain_graph=retain)
        self._send_input_grad(ctx, a, x.grad if a.chunk > 0 else None, x)
        self._backward_done(ctx, i)

    def _backward_input(self, ctx: StepContext, a: Action) -> None:
        """``I``: the input's gradient only, sent at once; the weights' gradients wait for ``W``. Chunk 0's
        input is the captured trunk input: its gradient goes on into the pre-trunk code in ``W``."""
        i, c = a.microbatch, a.chunk
        if ctx.captures[i].needs_grad:
            raise RuntimeError(
                f"schedule with a split backward: the arguments of trunk {self.trunk.path!r}'s blocks carry gradients"
                " (computed from parameters in the step), which a weight-gradient action would have to share with"
                " the other chunks; use schedule='1f1b' or 'interleaved_1f1b'"
            )
        x, y, grad = self._output_and_grad(ctx, a)
        leaf = ctx.saved.pop(("leaf", i), None) if c == 0 else None
        target = leaf if leaf is not None else x
        extra, extra_grads = self._roots(a)
        grads, work = backward_input([y, *extra], [grad, *extra_grads], [target] if target.requires_grad else [])
        grad_x = grads[0] if grads else None
        if leaf is not None and grad_x is not None:  # the pre-trunk's backward, after the weights'
            work.then.append((x, grad_x))
        ctx.weight_work[(i, c)] = work
        self._send_input_grad(ctx, a, grad_x, x)

    def _backward_weight(self, ctx: StepContext, a: Action) -> None:
        ctx.weight_work.pop((a.microbatch, a.chunk)).run()
        self._backward_done(ctx, a.microbatch)

    # ----------------------------------------------------------------------------- lock-step
    def lockstep(self, step: Callable[[], Any]) -> Any:
        """Run ``step`` on every stage with each trunk pass going through the stages in order.

        Each block call runs this stage's part of it (:meth:`_evaluate_block`); the last block's result is
        broadcast from the stage that computed it (:meth:`_output_stage`), so all stages run the same
        post-trunk code (validation, test, predict, and any number of trunk passes per step).
        """
        if not self._evaluates_in_parts():
            return step()
        blocks, last = self.trunk.blocks, len(self.trunk.blocks) - 1
        ev = EvalContext()

        def make(j: int, block: nn.Module) -> Callable[..., Any]:
            real = block.__dict__.get("forward") or type(block).forward.__get__(block)  # its stack, if composed

            def forward(*a: Any, **kw: Any) -> Any:
                hidden, (args, kwargs) = split_hidden(self.trunk, a, kw)
                refuse_not_carried(self.trunk, j, args, kwargs)
                out, mine = self._evaluate_block(ev, j, block, real, hidden, args, kwargs)
                if j < last:
                    return out if out is not None else wrap_output(hidden, self.output_like)
                src = self._output_stage()
                final = _p2p.broadcast_with_header(
                    mine if self.stage == src else None, self.rank_of_stage(src), self.group, self.device
                )
                ev.passes += 1
                return out if out is not None and self.stage == src else wrap_output(final, self.output_like)

            return forward

        with _forwards(blocks, make):
            result = step()
        for work, _ in ev.sends:
            work.wait()
        return result

    def _evaluates_in_parts(self) -> bool:
        return True

    def _output_stage(self) -> int:
        return self.chunk_stages[-1]

    def _evaluate_block(
        self,
        ev: EvalContext,
        j: int,
        block: nn.Module,
        real: Callable[..., Any],
        hidden: Tensor,
        args: tuple,
        kwargs: dict,
    ) -> tuple[Any, Tensor | None]:
        """This stage's part of block j's call: (the block's output if it ran here, else ``None``; the hidden
        state it produced here, else ``None``). A chunk's first block receives, its last block sends on."""
        c = next(c for c, r in enumerate(self.chunk_blocks) if j in r)
        if self.chunk_stages[c] != self.stage:
            if not self._like_known and self._freed is not None:
                self.output_like = probe_output_structure(self.trunk.blocks[self._freed], hidden, (args, kwargs))
                self._like_known = True
            return None, None
        if j == self.chunk_blocks[c].start and c > 0 and self.chunk_stages[c - 1] != self.stage:
            src = self.rank_of(c - 1)
            hidden, _ = _p2p.recv_with_header(src, self.tag("E", ev.passes, c), self.lanes.source(src), self.device)
        out = real(hidden, *args, **kwargs)
        self.output_like, self._like_known = structure_of(out), True
        y = unwrap_output(out, block)
        last_of_chunk = j == self.chunk_blocks[c].stop - 1 and c < self.num_chunks - 1
        if last_of_chunk and self.chunk_stages[c + 1] != self.stage:  # (the next chunk here takes it as it is)
            dst = self.rank_of(c + 1)
            ev.sends += _p2p.isend_with_header(y, dst, self.tag("E", ev.passes, c + 1), self.lanes.to(dst))
        return out, y
