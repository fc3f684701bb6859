"""HelixPipe's runtime: execute one stage's ``HelixAction`` list with each layer's verified split
(:class:`lightning_parallel.anatomy.Split`: a hand-written adapter's, or one cut from the block's graph).

``P_j`` (stage j mod p) runs ``post`` of layer j and ``pre`` of layer j+1 with the user's captured block
arguments; ``A_k`` runs the attention core of layer k on stage (k + d) mod p. Messages, per micro-batch:

    P_{k-1} --(q, k, v after RoPE, state)--> A_k --(attention output, state)--> P_k

where ``state`` is what ``post`` needs from before attention (the residual; more for some blocks, e.g. the
normalised input of a parallel-residual block), passed through the attention stage untouched.
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

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lightning_parallel import _collectives
from lightning_parallel.anatomy.base import Split
from lightning_parallel.pipeline.capture import _forwards, split_hidden, substitute, wrap_output
from lightning_parallel.pipeline.helix_schedule import HelixAction, attention_stage
from lightning_parallel.pipeline.runtime import PipelineRuntime, RecvClock

_KINDS = {"qkv": 0, "out": 1, "grad_out": 2, "grad_qkv": 3}


class HelixRuntime(PipelineRuntime):
    def __init__(self, *args: Any, folds: int, recompute: bool, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.splits: list[Split] = []  # per layer, set once verified (the strategy's first step)
        self.folds, self.recompute = folds, recompute
        self.num_layers = len(self.trunk)
        self.local_chunks = [0] if self.stage == 0 else []  # stage 0 keeps the capture's pre-trunk graph
        self.quiet_step: Callable[[Callable[[], Any]], Any] = lambda step: step()  # set by the strategy

    def rank_of_stage(self, stage: int) -> int:
        return self.stage_ranks[stage]

    # ------------------------------------------------------------------------------ messages
    def _tag(self, kind: str, index: int, microbatch: int) -> int:  # type: ignore[override]
        return (microbatch * (self.num_layers + 2) + index) * 4 + _KINDS[kind]

    def _send(self, tensors: list[Tensor], stage: int, kind: str, index: int, mb: int) -> None:
        if stage == self.stage:
            self._local[(kind, index, mb)] = [t.detach() for t in tensors]
            return
        dst = self.rank_of_stage(stage)
        self._sends += _collectives.isend_packed(tensors, dst, self._tag(kind, index, mb), self.group)

    def _recv(self, n: int, stage: int, kind: str, index: int, mb: int) -> list[Tensor]:
        if stage == self.stage:
            return [t.requires_grad_(True) for t in self._local.pop((kind, index, mb))]
        with self._clock as clock:
            out, clock.sent = _collectives.recv_packed(
                self.rank_of_stage(stage), self._tag(kind, index, mb), self.group, self.device
            )
        if len(out) < n:
            raise RuntimeError(
                f"expected at least {n} tensors for {kind} of layer {index}, micro-batch {mb}; got {len(out)}"
            )
        return [t.requires_grad_(True) for t in out]

    # --------------------------------------------------------------------------------- steps
    def run(self, actions, steps, loss_of, loss_weights):  # type: ignore[override]
        self.timeline = []
        self._steps, self._loss_of, self._weights = steps, loss_of, loss_weights
        self._captures, self._local, self._saved, self._sends = {}, {}, {}, []
        self._remaining = Counter(a.microbatch for a in actions if a.phase == "B")  # a capture lives until 0
        results: dict[int, tuple[Tensor, Any]] = {}
        try:
            for a in actions:
                start, self._clock = time.time(), RecvClock()
                self._forward_action(a, results) if a.phase == "F" else self._backward_action(a)
                self.timeline.append(self._clock.event(self.stage, a.phase + a.op, a.microbatch, a.index, start))
            for work, _ in self._sends:
                work.wait()
        finally:
            self._captures, self._local, self._saved, self._sends = {}, {}, {}, []
        return results

    def _block_args(self, mb: int, layer: int) -> tuple[tuple, dict]:
        return self._capture(mb).block_args[layer - 1]

    def _forward_action(self, a: HelixAction, results: dict) -> None:
        j, mb, L, p = a.index, a.microbatch, self.num_layers, self.num_stages
        if a.op == "A":
            q, k, v, *state = self._recv(4, (j - 1) % p, "qkv", j, mb)
            args, kwargs = self._block_args(mb, j)
            out = self.splits[j - 1].attention(self.trunk.blocks[j - 1], q, k, v, args, kwargs)
            self._saved[a] = ([q, k, v, *state], [out])
            self._send([out, *state], j % p, "out", j, mb)
            return
        cap = self._capture(mb)
        inputs = self._recv(2, attention_stage(j, mb, p, self.folds), "out", j, mb) if j > 0 else []
        if j == L:
            self._loss_forward(a, inputs, results)
            return
        outputs = self._chunk(j, mb, cap.trunk_input if j == 0 else None, inputs)
        self._saved[a] = (inputs, outputs)
        self._send(outputs, attention_stage(j + 1, mb, p, self.folds), "qkv", j + 1, mb)

    def _chunk(self, j: int, mb: int, trunk_input: Tensor | None, inputs: list[Tensor]) -> list[Tensor]:
        """post-attention of layer j (unless j == 0) then pre-attention of layer j+1: (q, k, v, *state)."""

        def run(*tensors: Tensor) -> tuple[Tensor, ...]:
            x = trunk_input if j == 0 else self._post(j, mb, tensors[0], tensors[1:])
            args, kwargs = self._block_args(mb, j + 1)
            (q, k, v), state = self.splits[j].pre(self.trunk.blocks[j], x, args, kwargs)
            return (q, k, v, *state)

        if self.recompute and j > 0:
            return list(checkpoint(run, *inputs, use_reentrant=False))
        return list(run(*inputs))

    def _post(self, layer: int, mb: int, out: Tensor, state: tuple[Tensor, ...]) -> Tensor:
        args, kwargs = self._block_args(mb, layer)
        y = self.splits[layer - 1].post(self.trunk.blocks[layer - 1], out, tuple(state), args, kwargs)
        return y if isinstance(y, Tensor) else y[0]

    def _loss_forward(self, a: HelixAction, inputs: list[Tensor], results: dict) -> None:
        mb = a.microbatch
        step = self._steps[mb]
        self.phase = "loss"
        try:
            if self.recompute:  # value and logs now; the graph is rebuilt in the backward action
                with torch.no_grad():
                    y = self._post(self.num_layers, mb, inputs[0], inputs[1:])
                    step_out = substitute(self.trunk, step, wrap_output(y, self.output_like))
                loss = self._loss_of(step_out)
            else:
                y = self._post(self.num_layers, mb, inputs[0], inputs[1:])
                step_out = substitute(self.trunk, step, wrap_output(y, self.output_like))
                loss = self._loss_of(step_out)
        finally:
            self.phase = None
        self._saved[a] = (inputs, [loss])
        results[mb] = (loss.detach(), step_out)

    def _backward_action(self, a: HelixAction) -> None:
        j, mb = a.index, a.microbatch
        forward = HelixAction("F", a.op, j, mb)
        inputs, outputs = self._saved.pop(forward)
        self._remaining[mb] -= 1
        try:
            self._backward(a, inputs, outputs)
        finally:
            if self._remaining[mb] == 0:
                self._captures.pop(mb, None)

    def _backward(self, a: HelixAction, inputs: list[Tensor], outputs: list[Tensor]) -> None:
        j, mb, L, p = a.index, a.microbatch, self.num_layers, self.num_stages
        if a.op == "A":
            grad_out, *grad_state = self._recv(2, j % p, "grad_out", j, mb)
            torch.autograd.backward(outputs, [grad_out])
            q, k, v = inputs[:3]
            grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in (q, k, v)]
            self._send([*grads, *grad_state], (j - 1) % p, "grad_qkv", j, mb)
            return
        if j == L:
            loss = outputs[0]
            if self.recompute:  # the head and loss inside the backward step, logging suppressed
                y = self._post(L, mb, inputs[0], inputs[1:])
                out = wrap_output(y, self.output_like)
                loss = self._loss_of(self.quiet_step(lambda: substitute(self.trunk, self._steps[mb], out)))
            torch.autograd.backward(loss * self._weights[mb], retain_graph=self._capture(mb).needs_grad)
        else:
            grads = self._recv(4, attention_stage(j + 1, mb, p, self.folds), "grad_qkv", j + 1, mb)
            torch.autograd.backward(outputs, grads, retain_graph=self._capture(mb).needs_grad)
        if j > 0:
            self._send(
                [t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs],
                attention_stage(j, mb, p, self.folds),
                "grad_out",
                j,
                mb,
            )

    # ---------------------------------------------------------------------------- lock-step
    def lockstep(self, step: Callable[[], Any]) -> Any:  # type: ignore[override]
        """Evaluation: layer k's pre-attention on stage (k-1) mod p, its attention and post-attention on
        stage k mod p (which also runs layer k+1's pre-attention), the trunk output broadcast from stage 0.
        Before the first training step places the parameters, every stage holds the whole model and runs it."""
        if not self.splits:
            return step()
        blocks, L, p = self.trunk.blocks, self.num_layers, self.num_stages
        sends: list[tuple[Any, Tensor]] = []
        state: dict[str, Any] = {"pass": 0, "x": None}

        def make(i: int, block: Any) -> Callable[..., Any]:
            pre_stage, post_stage = i % p, (i + 1) % p

            def forward(*a: Any, **kw: Any) -> Any:
                hidden, (args, kwargs) = split_hidden(self.trunk, a, kw)
                tag = (1 << 24) + (state["pass"] * L + i) * 8
                split = self.splits[i]
                if self.stage == pre_stage:
                    x = hidden if i == 0 else state["x"]
                    (q, k, v), rest = split.pre(block, x, args, kwargs)
                    if post_stage != pre_stage:
                        dst = self.rank_of_stage(post_stage)
                        sends.extend(_collectives.isend_packed([q, k, v, *rest], dst, tag, self.group))
                if self.stage == post_stage:
                    if post_stage != pre_stage:
                        src = self.rank_of_stage(pre_stage)
                        (q, k, v, *rest), _ = _collectives.recv_packed(src, tag, self.group, self.device)
                    out = split.attention(block, q, k, v, args, kwargs)
                    y = split.post(block, out, tuple(rest), args, kwargs)
                    state["x"] = y if isinstance(y, Tensor) else y[0]
                if i == L - 1:
                    state["pass"] += 1
                    mine = state["x"] if self.stage == 0 else None
                    final = _collectives.broadcast_with_header(mine, self.rank_of_stage(0), self.group, self.device)
                    return wrap_output(final, self.output_like)
                return wrap_output(hidden, self.output_like)

            return forward

        with _forwards(blocks, make):
            result = step()
        for work, _ in sends:
            work.wait()
        return result


def place_block(i: int, block: nn.Module, split: Split, stage: int, num_stages: int) -> set[int]:
    """Free what ``stage`` does not run of block ``i`` (layer k = i + 1): its pre-attention parameters live on
    stage (k-1) mod p, the rest of it on stage k mod p. Returns the ids of the parameters that were freed."""
    freed: set[int] = set()
    for name, param in list(block.named_parameters()):
        if (i % num_stages if name in split.pre_parameters else (i + 1) % num_stages) != stage:
            freed.add(id(param))
            owner_name, _, attr = name.rpartition(".")
            owner = block.get_submodule(owner_name) if owner_name else block
            setattr(
                owner,
                attr,
                torch.nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad),
            )
    return freed
