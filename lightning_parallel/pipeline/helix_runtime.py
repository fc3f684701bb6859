"""HelixPipe's handlers for the shared runtime loop: execute one stage's helix actions with each layer's verified split
(:class:`lightning_parallel.anatomy.Split`: a hand-written adapter's, or one cut from the block's graph).

``P_j`` (stage j mod p) runs ``post`` of layer j and ``pre`` of layer j+1 with the user's captured block
arguments; ``A_k`` runs the attention core of layer k on stage (k + d) mod p. Messages, per micro-batch:

    P_{k-1} --(q, k, v after RoPE, carried, state)--> A_k --(attention output, state)--> P_k

where ``state`` is what ``post`` needs from before attention (the residual; more for some blocks, e.g. the
normalised input of a parallel-residual block), passed through the attention stage untouched, and ``carried``
the parameters the attention call itself reads (GPT-OSS's sinks, :attr:`Split.carried`; their gradients go back
with q's).
and their gradients back in the exact reverse order. The pre stage sends q, k, v rather than the paper's
LayerNorm output + QKV weights: the attention stage then holds no parameters and returns no weight
gradients (see docs/design.md for the cost). A message to the same stage is handed over locally, as the
same detached leaf a remote receive would produce, so every action back-propagates only its own graph.

With ``recompute=True`` (HelixPipe's default) each ``P`` chunk runs under activation checkpointing, so a
stage keeps only the chunk's inputs (attention output and residual) while attention keeps what SDPA
saves: recomputation without attention (paper §4.1). The loss chunk ``P_L`` then computes the loss under
``no_grad`` in forward (for logging) and re-enters the user's step with gradients in its backward, as the
paper runs the head inside the backward step (docs/design.md, "HelixPipe").
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from typing_extensions import override

from lightning_parallel import _p2p
from lightning_parallel.pipeline.capture import substitute, wrap_output
from lightning_parallel.pipeline.context import EvalContext, StepContext, detached
from lightning_parallel.pipeline.helix_schedule import attention_stage
from lightning_parallel.pipeline.runtime import PipelineRuntime
from lightning_parallel.pipeline.schedules import Action
from lightning_parallel.sequence_parallel import SplitOverSequence


class HelixRuntime(PipelineRuntime):
    """HelixPipe's handlers on the shared loop: ``FP``/``BP`` run param chunk ``P_j`` (``Action.chunk`` = j),
    ``FA``/``BA`` the attention of layer k (``Action.chunk`` = k)."""

    def __init__(self, *args: Any, folds: int, recompute: bool, receives_ahead: int = 2, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.receives_ahead = receives_ahead
        # per layer, set once verified (the strategy's first step): a Split, or under sequence parallelism a
        # SplitOverSequence (its parts take the micro-batch's sequence shard)
        self.splits: list[Any] = []
        self.verdicts: list[Any] = []  # per layer, the call structures its split is verified on (Verdicts)
        self.folds, self.recompute = folds, recompute
        self.specs: dict[tuple, Any] = {}  # (kind, layer, trunk input's shape and dtype) -> the message's spec
        self.num_layers = len(self.trunk)
        self.num_indices = self.num_layers + 2
        self.local_chunks = [0] if self.stage == 0 else []  # stage 0 keeps the capture's pre-trunk graph
        self.handlers = {"FP": self._forward_param, "FA": self._forward_attention,
                         "BP": self._backward_param, "BA": self._backward_attention}  # fmt: skip

    WEIGHT_KINDS = ("BP",)

    @override
    def blocks_of_unit(self, unit: int) -> list[int]:
        """``P_j`` runs the post-attention part of block j-1 and the pre-attention part of block j."""
        return [b for b in (unit - 1, unit) if 0 <= b < self.num_layers]

    # ------------------------------------------------------------------------------ messages
    def _send(self, ctx: StepContext, tensors: list[Tensor], stage: int, consumer: str, index: int, mb: int) -> None:
        """Send to the action (``consumer``, ``mb``, ``index``) on ``stage``; to this stage: handed over as
        the detached leaves a remote receive would make."""
        if stage == self.stage:
            ctx.local[(consumer, index, mb)] = [t.detach() for t in tensors]
            return
        dst, tag = self.rank_of_stage(stage), self.tag(consumer, mb, index)
        send = lambda: _p2p.isend_packed(tensors, dst, tag, self.lanes.to(dst))  # noqa: E731
        ctx.outbox.put(stage, (consumer, mb, index), send)

    def _recv(self, ctx: StepContext, n: int, stage: int, a: Action) -> list[Tensor]:
        if stage == self.stage:
            return [t.requires_grad_(True) for t in ctx.local.pop((a.kind, a.chunk, a.microbatch))]
        # a message's shapes follow from its layer, its kind and the micro-batch's trunk input: once seen, the
        # payload's receive is posted with the header's (one round trip, not two)
        trunk_input = self._capture(ctx, a.microbatch).trunk_input
        key = (a.kind, a.chunk, tuple(trunk_input.shape), trunk_input.dtype)
        with ctx.clock as clock:
            posted = ctx.ahead.pop(tuple(a), None)
            if posted is not None:
                out, clock.sent, self.specs[key] = _p2p.complete_recv_packed(posted)
            else:
                ctx.inbox.take(stage, tuple(a))
                src = self.rank_of_stage(stage)
                out, clock.sent, self.specs[key] = _p2p.recv_packed(
                    src, self.tag(a.kind, a.microbatch, a.chunk), self.lanes.source(src), self.device,
                    self.specs.get(key),
                )  # fmt: skip
        ctx.received(a.microbatch)
        if len(out) < n:
            raise RuntimeError(
                f"expected at least {n} tensors for {a} (layer {a.chunk}, micro-batch {a.microbatch}); got {len(out)}"
            )
        return [t.requires_grad_(True) for t in out]

    def _capture(self, ctx: StepContext, i: int) -> Any:
        known = i in ctx.captures
        cap = super()._capture(ctx, i)
        if not known:  # a micro-batch's block arguments, once: each split verified on calls of their structure
            for j, (args, kwargs) in enumerate(cap.block_args[: len(self.verdicts)]):
                self.verdicts[j].ensure(cap.trunk_input, args, kwargs)
        return cap

    def _attention_stage(self, layer: int, mb: int) -> int:
        return attention_stage(layer, mb, self.num_stages, self.folds)

    def source_of(self, a: Action, stage: int | None = None) -> int | None:
        """The stage action ``a`` receives from (``None``: it receives nothing; the same stage: handed over)."""
        j, mb, p = a.chunk, a.microbatch, self.num_stages
        if a.kind == "FA":
            return (j - 1) % p
        if a.kind == "BA":
            return j % p
        if a.kind == "FP":
            return self._attention_stage(j, mb) if j > 0 else None
        return self._attention_stage(j + 1, mb) if j < self.num_layers else None

    def _ahead(self, ctx: StepContext, actions: list[Action], i: int) -> None:
        """Post the receives of the next ``receives_ahead`` actions whose messages' shapes are known, so their
        bytes move while this action computes (measured at T=4096, m=4, p=2: transfer 0.17 -> 0.03 s per stage
        and step, the step 1.08x faster with 2 ahead; 1 ahead gained nothing; docs/benchmarks.md, "Helix against
        torch's 1F1B at T=4096, m=4, after the transport work"). From each stage only in action order
        (``ctx.inbox``): one that cannot be posted yet (its shapes unknown, its micro-batch not captured) stops
        the later ones from that stage, which NCCL would otherwise match with the earlier message."""
        blocked: set[int] = set()
        for a in actions[i + 1 : i + 1 + self.receives_ahead]:
            src = self.source_of(a)
            if src is None or src == self.stage or src in blocked or tuple(a) in ctx.ahead:
                continue
            spec = None
            if a.microbatch in ctx.captures and ctx.inbox.is_next(src, tuple(a)):
                trunk_input = ctx.captures[a.microbatch].trunk_input
                spec = self.specs.get((a.kind, a.chunk, tuple(trunk_input.shape), trunk_input.dtype))
            if spec is None:
                blocked.add(src)
                continue
            ctx.inbox.take(src, tuple(a))
            rank = self.rank_of_stage(src)
            ctx.ahead[tuple(a)] = _p2p.post_recv_packed(
                rank, self.tag(a.kind, a.microbatch, a.chunk), self.lanes.source(rank), self.device, spec
            )

    # ------------------------------------------------------------------------------- the parts
    # Layer k = i + 1 is block i; under sequence parallelism every part takes the micro-batch's shard (one for
    # the whole trunk: the hidden state enters it at P_0 and leaves it at P_L), otherwise ``shard`` is None.
    @property
    def _sequence_parallel(self) -> bool:
        return bool(self.splits) and isinstance(self.splits[0], SplitOverSequence)

    def _shard(self, ctx: StepContext, mb: int) -> Any:
        if not self._sequence_parallel:
            return None
        if mb not in ctx.shards:
            cap = self._capture(ctx, mb)
            args, kwargs = cap.block_args[0]
            ctx.shards[mb] = self.splits[0].shard(self.trunk.blocks[0], cap.trunk_input, args, kwargs)
        return ctx.shards[mb]

    def _pre(self, i: int, x: Tensor, args: tuple, kwargs: dict, shard: Any) -> Any:
        extra = () if shard is None else (shard,)
        return self.splits[i].pre(self.trunk.blocks[i], x, args, kwargs, *extra)

    def _inputs(self, i: int) -> int:
        """How many of the pre part's outputs the attention of block ``i`` reads: q, k, v and its carried ones."""
        return 3 + getattr(self.splits[i], "carried", 0)

    def _attend(self, i: int, inputs: list[Tensor], args: tuple, kwargs: dict, shard: Any) -> Tensor:
        if shard is None:
            return self.splits[i].attend(self.trunk.blocks[i], tuple(inputs), args, kwargs)
        return self.splits[i].attention(self.trunk.blocks[i], *inputs, args, kwargs, shard)  # no carried (resolve)

    def _post_part(self, i: int, out: Tensor, state: tuple, args: tuple, kwargs: dict, shard: Any) -> Tensor:
        extra = () if shard is None else (shard,)
        y = self.splits[i].post(self.trunk.blocks[i], out, state, args, kwargs, *extra)
        y = y if isinstance(y, Tensor) else y[0]
        if shard is not None and i == self.num_layers - 1:  # the trunk's exit: the whole sequence again
            y = self.splits[i].exit(self.trunk.blocks[i], y, shard)
        return y

    def _enter(self, x: Tensor, shard: Any) -> Tensor:
        return x if shard is None else self.splits[0].enter(self.trunk.blocks[0], x, shard)

    # --------------------------------------------------------------------------------- steps
    def _block_args(self, ctx: StepContext, mb: int, layer: int) -> tuple[tuple, dict]:
        return self._capture(ctx, mb).block_args[layer - 1]

    def _forward_attention(self, ctx: StepContext, a: Action) -> None:
        j, mb, p = a.chunk, a.microbatch, self.num_stages
        n = self._inputs(j - 1)
        inputs = self._recv(ctx, n + 1, (j - 1) % p, a)
        args, kwargs = self._block_args(ctx, mb, j)
        out = self._attend(j - 1, inputs[:n], args, kwargs, self._shard(ctx, mb))
        ctx.saved[a] = (inputs, [out])
        self._send(ctx, [out, *inputs[n:]], j % p, "FP", j, mb)

    def _forward_param(self, ctx: StepContext, a: Action) -> None:
        j, mb = a.chunk, a.microbatch
        cap = self._capture(ctx, mb)
        inputs = self._recv(ctx, 2, self._attention_stage(j, mb), a) if j > 0 else []
        if j == self.num_layers:
            self._loss_forward(ctx, a, inputs)
            return
        with self.balancing.running(mb, j) if self.balancing is not None else nullcontext():
            outputs = self._chunk(ctx, j, mb, cap.trunk_input if j == 0 else None, inputs)
        ctx.saved[a] = (inputs, outputs)
        self._send(ctx, outputs, self._attention_stage(j + 1, mb), "FA", j + 1, mb)

    def _chunk(
        self, ctx: StepContext, j: int, mb: int, trunk_input: Tensor | None, inputs: list[Tensor]
    ) -> list[Tensor]:
        """post-attention of layer j (unless j == 0) then pre-attention of layer j+1: (q, k, v, *carried,
        *state)."""

        shard = self._shard(ctx, mb)

        def run(*tensors: Tensor) -> tuple[Tensor, ...]:
            x = self._enter(trunk_input, shard) if j == 0 else self._post(ctx, j, mb, tensors[0], tensors[1:])
            args, kwargs = self._block_args(ctx, mb, j + 1)
            inputs, state = self._pre(j, x, args, kwargs, shard)
            return (*inputs, *state)

        if self.recompute and j > 0:
            return list(checkpoint(run, *inputs, use_reentrant=False))
        return list(run(*inputs))

    def _post(self, ctx: StepContext, layer: int, mb: int, out: Tensor, state: tuple[Tensor, ...]) -> Tensor:
        args, kwargs = self._block_args(ctx, mb, layer)
        return self._post_part(layer - 1, out, tuple(state), args, kwargs, self._shard(ctx, mb))

    def _loss_forward(self, ctx: StepContext, a: Action, inputs: list[Tensor]) -> None:
        mb = a.microbatch
        # recomputed: the value and the logs now, the graph rebuilt in the backward action
        with torch.no_grad() if self.recompute else nullcontext():
            with self.balancing.running(mb, a.chunk) if self.balancing is not None else nullcontext():
                y = self._post(ctx, self.num_layers, mb, inputs[0], inputs[1:])
            if self.balancing is not None:  # the loss needs every micro-batch's router sums: at the turn
                ctx.pending.append((mb, a.chunk, inputs, y))
            else:
                self._loss(ctx, mb, a.chunk, inputs, y)

    def _loss(self, ctx: StepContext, i: int, c: int, x: Any, out: Any) -> None:
        """The user's step from the last layer's output ``out`` on to micro-batch i's loss (``x``: P_L's inputs)."""
        with torch.no_grad() if self.recompute else nullcontext():
            step_out = substitute(self.trunk, lambda: ctx.user.loss(i), wrap_output(out, self.output_like))
        loss = ctx.loss_of(step_out)
        ctx.saved[Action("FP", i, c)] = (x, [loss])
        ctx.results[i] = (loss.detach(), detached(step_out))  # the graph is the actions' alone

    def _weighted_loss(self, ctx: StepContext, i: int, c: int) -> Tensor:
        return ctx.saved[Action("FP", i, c)][1][0] * ctx.weights[i]

    def _forward_of(self, ctx: StepContext, a: Action) -> tuple[list[Tensor], list[Tensor]]:
        return ctx.saved.pop(Action("F" + a.kind[1], a.microbatch, a.chunk))  # type: ignore[arg-type]

    def _backward_attention(self, ctx: StepContext, a: Action) -> None:
        j, mb, p = a.chunk, a.microbatch, self.num_stages
        inputs, outputs = self._forward_of(ctx, a)
        try:
            grad_out, *grad_state = self._recv(ctx, 2, j % p, a)
            torch.autograd.backward(outputs, [grad_out])
            grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs[: self._inputs(j - 1)]]
            self._send(ctx, [*grads, *grad_state], (j - 1) % p, "BP", j - 1, mb)
        finally:
            self._backward_done(ctx, mb)

    def _backward_param(self, ctx: StepContext, a: Action) -> None:
        j, mb, L = a.chunk, a.microbatch, self.num_layers
        inputs, outputs = self._forward_of(ctx, a)
        try:
            retain = self._capture(ctx, mb).needs_grad
            if j == L:
                loss = outputs[0]
                if self.recompute:  # the head and loss inside the backward step, logging suppressed
                    y = self._post(ctx, L, mb, inputs[0], inputs[1:])
                    out = wrap_output(y, self.output_like)
                    loss = ctx.loss_of(substitute(self.trunk, lambda: ctx.user.replay(mb), out))
                extra, extra_grads = self._roots(Action(a.kind, mb, j))
                torch.autograd.backward([loss * ctx.weights[mb], *extra], [None, *extra_grads], retain_graph=retain)
            else:
                grads = self._recv(ctx, 4, self._attention_stage(j + 1, mb), a)
                extra, extra_grads = self._roots(Action(a.kind, mb, j))
                torch.autograd.backward([*outputs, *extra], [*grads, *extra_grads], retain_graph=retain)
            if j > 0:
                grads_in = [t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs]
                self._send(ctx, grads_in, self._attention_stage(j, mb), "BA", j, mb)
        finally:
            self._backward_done(ctx, mb)

    # ---------------------------------------------------------------------------- lock-step
    def _evaluates_in_parts(self) -> bool:
        """Before the first training step places the parameters, every stage holds the whole model."""
        return bool(self.splits)

    def _output_stage(self) -> int:
        return 0

    def _evaluate_block(
        self,
        ev: EvalContext,
        i: int,
        block: nn.Module,
        real: Callable[..., Any],
        hidden: Tensor,
        args: tuple,
        kwargs: dict,
    ) -> tuple[Any, Tensor | None]:
        """Layer k = i+1: its pre-attention on stage (k-1) mod p, its attention and post-attention on stage
        k mod p (which also runs layer k+1's pre-attention); the hidden state is carried between calls."""
        p = self.num_stages
        pre_stage, post_stage = i % p, (i + 1) % p
        tag = self.tag("E", ev.passes, i)
        if i < len(self.verdicts):
            self.verdicts[i].ensure(hidden, args, kwargs)
        if i == 0 and self._sequence_parallel:  # the pass's shard, on every stage alike
            ev.shard = self.splits[0].shard(block, hidden, args, kwargs)
        if self.stage == pre_stage:
            x = self._enter(hidden, ev.shard) if i == 0 else ev.carry
            inputs, rest = self._pre(i, x, args, kwargs, ev.shard)
            message = [*inputs, *rest]
            if post_stage != pre_stage:
                dst = self.rank_of_stage(post_stage)
                ev.sends += _p2p.isend_packed(message, dst, tag, self.lanes.to(dst))
        if self.stage == post_stage:
            if post_stage != pre_stage:
                src = self.rank_of_stage(pre_stage)
                message, _, _ = _p2p.recv_packed(src, tag, self.lanes.source(src), self.device)
            n = self._inputs(i)
            out = self._attend(i, message[:n], args, kwargs, ev.shard)
            rest = message[n:]
            ev.carry = self._post_part(i, out, tuple(rest), args, kwargs, ev.shard)
        return None, (ev.carry if i == self.num_layers - 1 and self.stage == 0 else None)


def place_block(i: int, block: nn.Module, split: Any, stage: int, num_stages: int) -> set[int]:
    """Free what ``stage`` does not run of block ``i`` (layer k = i + 1): its pre-attention parameters live on
    stage (k-1) mod p, the rest of it on stage k mod p. A freed parameter becomes a plain meta tensor of its
    whole shape (a tensor-parallel shard's too). Returns the ids of the parameters that were freed."""
    freed: set[int] = set()
    for name, param in list(block.named_parameters()):
        if (i % num_stages if name in split.pre_parameters else (i + 1) % num_stages) != stage:
            freed.add(id(param))
            owner_name, _, attr = name.rpartition(".")
            owner = block.get_submodule(owner_name) if owner_name else block
            meta = torch.empty(param.shape, dtype=param.dtype, device="meta")
            setattr(owner, attr, torch.nn.Parameter(meta, requires_grad=param.requires_grad))
    return freed
