"""Recurrent mixers under sequence parallelism: the state passed from rank to rank in sequence order (LASP, Sun et
al., arXiv 2404.02882: linear attention's running state sent along the sequence-parallel ranks, as a ring passes
keys and values).

A linear-attention or state-space mixer (gated DeltaNet in Qwen3-Next, Mamba-2 in Falcon-H1) reads its tokens
in order: a causal short convolution over the last ``K - 1`` inputs, then a recurrence whose state carries
everything before. Split over sp ranks, each rank's tokens need the two from the tokens before them. transformers'
mixers already take both from a cache (the one generation uses: ``get_conv_state`` / ``update_conv_state``
prepend the previous inputs, ``get_recurrent_state`` / ``update_recurrent_state`` give the initial state and keep
the final one), so the mixer's own forward runs on each piece of this rank's tokens with a :class:`_ChainCache`
that holds the previous piece's convolution inputs and final state, received from the rank that owns that
piece, and whose own are sent to the rank owning the next piece.

Pieces: Ulysses gives rank r the r-th of sp contiguous chunks; ring mode two of 2·sp chunks
(:class:`~lightning_parallel.sequence_parallel.SequenceShard.chunks`), so a rank may pass state to itself or get it
back from a later rank. The forward is sequential along the chain (a rank's piece waits for the previous one);
the backward runs it in reverse: each received state's gradient goes back to its sender (:class:`_Receive`), and
a sent state's gradient arrives from the next piece's owner (:class:`_Send`). The first piece starts from the
model's own zero state.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch
from torch import Tensor, nn

from lightning_parallel import _collectives, _p2p
from lightning_parallel.errors import ConfigurationError


def recurrent_mixers(block: nn.Module) -> list[nn.Module]:
    """The block's modules that keep a recurrent state in transformers' linear-attention cache: a ``layer_idx``, a
    ``conv1d`` and a forward taking ``cache`` (Qwen3-Next's ``linear_attn``, Falcon-H1's ``mamba``)."""
    found = []
    for module in block.modules():
        if not (hasattr(module, "layer_idx") and isinstance(getattr(module, "conv1d", None), nn.Conv1d)):
            continue
        if "cache" in inspect.signature(type(module).forward).parameters:
            found.append(module)
    return found


class Chained:
    """A recurrent mixer's forward under sequence parallelism: its own forward per piece of this rank's tokens,
    the state chained between pieces (module docstring). ``shard_of()`` gives the call's sequence shard (None:
    the plain forward)."""

    def __init__(self, module: nn.Module, shard_of: Any) -> None:
        self.module, self.shard_of = module, shard_of

    def __deepcopy__(self, memo: dict) -> Chained:
        """A copy of the block (verification's reference) chains its own copy of the mixer."""
        return Chained(copy.deepcopy(self.module, memo), self.shard_of)

    def __call__(self, hidden_states: Tensor, cache: Any = None, attention_mask: Tensor | None = None, **kwargs: Any):
        forward = type(self.module).forward
        shard = self.shard_of()
        if shard is None:
            return forward(self.module, hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
        name = type(self.module).__name__
        if cache is not None or attention_mask is not None:
            raise ConfigurationError(
                f"sequence parallelism passes {name}'s recurrent state between ranks for training without a cache"
                " or a padding mask (it got " + ("a cache" if cache is not None else "a padding mask") + ")"
            )
        pieces, chunk_ids = _pieces(shard)
        kernel = self.module.conv1d.kernel_size[0]
        length = hidden_states.shape[1] // pieces
        if length < kernel - 1:
            raise ConfigurationError(
                f"sequence parallelism needs each rank's piece of the sequence ({length} tokens) to be at least"
                f" {name}'s convolution width - 1 ({kernel - 1}); use a smaller sequence_parallel_size"
            )
        owner = {c: i // pieces for i, c in enumerate(shard.chunks or range(shard.mesh.size()))}
        group, me = shard.mesh.get_group(), shard.mesh.get_local_rank()
        layer = int(self.module.layer_idx)
        outs, local = [], {}
        for piece, chunk in sorted(enumerate(chunk_ids), key=lambda pc: pc[1]):
            x = hidden_states.narrow(1, piece * length, length)
            previous = None
            if chunk > 0:
                src = owner[chunk - 1]
                if src == me:
                    previous = local.pop(chunk - 1)
                else:
                    previous = _Receive.apply(x, group, src, _tag(layer, chunk))
            chain = _ChainCache(previous, kernel)
            out = forward(self.module, x, cache=chain, **kwargs)
            last = chunk == len(owner) - 1
            if not last:
                state = chain.sent()
                dst = owner[chunk + 1]
                if dst == me:
                    local[chunk] = state
                else:
                    out = _Send.apply(out, group, dst, _tag(layer, chunk + 1), *state)
            outs.append((piece, out))
        return torch.cat([o for _, o in sorted(outs, key=lambda po: po[0])], dim=1)


def _pieces(shard: Any) -> tuple[int, list[int]]:
    """How many pieces this rank's tokens are, and their chunk ids in the local order."""
    if shard.mode == "ring":
        r = shard.mesh.get_local_rank()
        return 2, list(shard.chunks[2 * r : 2 * r + 2])
    return 1, [shard.mesh.get_local_rank()]


def _tag(layer: int, chunk: int) -> int:
    return 100_000 + 1_000 * layer + chunk


class _ChainCache:
    """The linear-attention cache a mixer reads for one piece: the previous piece's last ``K - 1`` convolution inputs
    and final recurrent state (None for the first piece), and this piece's, kept to send on."""

    def __init__(self, previous: tuple[Tensor, Tensor] | None, kernel: int) -> None:
        self.previous, self.kernel = previous, kernel
        self.conv_tail: Tensor | None = None
        self.final: Tensor | None = None

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> None:
        return None  # never the one-token decode path

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def update_conv_state(self, hidden_states: Tensor, layer_idx: int, state_idx: int = 0, conv_kernel_size: int = 0):
        """(B, C, T) inputs of the convolution -> the previous piece's last K-1 prepended (the mixer drops their
        outputs); this piece's last K-1 kept."""
        self.conv_tail = hidden_states[..., -(self.kernel - 1) :]
        if self.previous is None:
            return hidden_states
        return torch.cat([self.previous[0].to(hidden_states.dtype), hidden_states], dim=-1)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> Tensor | None:
        return None if self.previous is None else self.previous[1]

    def get_recurrent_states_to_keep(self, layer_idx: int) -> int:
        return 0

    def update_recurrent_state(self, state: Tensor, layer_idx: int, state_idx: int = 0) -> None:
        self.final = state

    def sent(self) -> tuple[Tensor, Tensor]:
        if self.conv_tail is None or self.final is None:
            raise ConfigurationError(
                "the recurrent mixer did not read its convolution inputs and final state from the cache; sequence"
                " parallelism cannot pass its state between ranks"
            )
        return self.conv_tail, self.final


class _Receive(torch.autograd.Function):
    """The previous piece's (convolution inputs, final state) from rank ``src``; their gradients go back to it."""

    @staticmethod
    def forward(ctx: Any, anchor: Tensor, group: Any, src: int, tag: int) -> tuple[Tensor, ...]:  # type: ignore[override]
        ctx.group, ctx.src, ctx.tag = group, src, tag
        peer = _collectives.group_ranks(group)[src]
        tensors, _, _ = _p2p.recv_packed(peer, tag, group, anchor.device)
        return tuple(tensors)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> Any:  # type: ignore[override]
        peer = _collectives.group_ranks(ctx.group)[ctx.src]
        for work, _ in _p2p.isend_packed(list(grads), peer, ctx.tag, ctx.group):
            work.wait()
        return None, None, None, None


class _Send(torch.autograd.Function):
    """``out`` unchanged; ``state`` sent to rank ``dst`` (the next piece's owner), whose gradients come back from it."""

    @staticmethod
    def forward(ctx: Any, out: Tensor, group: Any, dst: int, tag: int, *state: Tensor) -> Tensor:  # type: ignore[override]
        ctx.group, ctx.dst, ctx.tag = group, dst, tag
        ctx.shapes = [(t.shape, t.dtype) for t in state]
        peer = _collectives.group_ranks(group)[dst]
        for work, _ in _p2p.isend_packed([t.detach() for t in state], peer, tag, group):
            work.wait()
        return out.clone()

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> Any:  # type: ignore[override]
        peer = _collectives.group_ranks(ctx.group)[ctx.dst]
        grads, _, _ = _p2p.recv_packed(peer, ctx.tag, ctx.group, grad_out.device)
        return (grad_out, None, None, None, *grads)
