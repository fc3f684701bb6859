"""Sequence (context) parallelism over the ``sp`` axis: DeepSpeed-Ulysses (Jacobs et al., arXiv 2309.14509)
and ring attention (Liu et al., arXiv 2310.01889) with zig-zag load balancing.

Each block of the trunk runs on 1/sp of the sequence per rank (the block layer, :mod:`lightning_parallel.blocks`,
composes it):

1. the block takes this rank's slice of the (replicated) hidden state along T (``Replicate -> Shard``:
   free forward, all-gather backward, so the pre-trunk gradient is whole);
2. the block's arguments that carry T (rotary tables, position ids) are sliced to the local positions by
   the block's anatomy, never guessed from "a dim equal to T"; masks stay whole (attention uses them);
3. the block computes on its tokens, and its attention core is replaced by :func:`attend`:
   **Ulysses**: one all-to-all turns (B, heads, T/sp, hd) into (B, heads/sp, T, hd), the block's own
   attention runs on whole sequences for 1/sp of the heads (masks whole, causality as is), and the
   inverse all-to-all returns this rank's tokens for all heads (functional collectives, which
   differentiate correctly on gloo); **ring**: the sequence is cut into 2·sp chunks and rank r holds
   chunks r and 2sp-1-r (zig-zag: every rank does the same causal work; under a document mask, the
   chunks paired by the pairs they compute, :func:`balanced_chunks`), the same permutation applied
   to the hidden state on entry (undone on exit) and to the positions;
   :func:`lightning_parallel.ring_attention.ring_attention` passes k and v around the ring (one custom op,
   so recomputation keeps its output; an explicit mask is sliced per chunk pair);
4. the output is all-gathered (``Shard -> Replicate``, whose backward is a slice), so the trunk's
   interface is unchanged.

Parameters inside the blocks see 1/sp of the tokens on each rank: their gradients are summed over the
sp group (``SequenceParallelLayout.partial``). Attention dropout is refused in ring mode.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from lightning_parallel import _collectives
from lightning_parallel.block_protocol import AttentionCall
from lightning_parallel.errors import ConfigurationError
from lightning_parallel.ring_attention import ring_attention
from lightning_parallel.rng import forked, has_dropout

MODES = ("ulysses", "ring")


@dataclass
class SequenceParallelLayout:
    mesh: DeviceMesh
    mode: str
    partial: list[nn.Parameter] = field(default_factory=list)  # block parameters: gradients summed over sp


@dataclass(frozen=True)
class SequenceShard:
    """One call's sequence split: ``order`` is the token order on entry (the ring's chunks in rank order),
    ``index`` the (original) positions of this rank's tokens, ``length`` the whole sequence's length,
    ``chunks`` the ring's chunk of each half of each rank (rank r: ``chunks[2r]``, ``chunks[2r+1]``)."""

    mesh: DeviceMesh
    mode: str
    order: Tensor
    index: Tensor
    length: int
    chunks: tuple[int, ...] = ()

    @classmethod
    def of(
        cls, mesh: DeviceMesh, mode: str, length: int, device: torch.device, mask: Tensor | None = None
    ) -> SequenceShard:
        """The split of a sequence of ``length`` tokens; ``mask``: the call's attention mask (whole, original
        order), by which ring mode balances its chunks."""
        sp = mesh.size()
        parts = 2 * sp if mode == "ring" else sp
        if length % parts:
            raise ConfigurationError(
                f"sequence parallelism needs the sequence length ({length}) to be divisible by"
                f" {'2 x ' if parts > sp else ''}sequence_parallel_size ({parts}); pad the batch to a multiple of"
                f" {parts} tokens (packed rows: lightning_parallel.packing.pad_to_multiple_of(batch, {parts}) in the"
                " collate function; the padding is a document of its own without labels) or change"
                " sequence_parallel_size"
            )
        if mode != "ring":
            order = torch.arange(length, device=device)
            return cls(mesh, mode, order, order.view(sp, -1)[mesh.get_local_rank()], length)
        chunks = balanced_chunks(mask, sp)
        order = torch.arange(length, device=device).view(parts, -1)[list(chunks)].reshape(-1)
        return cls(mesh, mode, order, order.view(sp, -1)[mesh.get_local_rank()], length, chunks)

    def scatter(self, x: Tensor, dim: int) -> Tensor:
        """This rank's tokens of the replicated ``x`` (all-gather in backward)."""
        if self.mode == "ring":
            x = x.index_select(dim, self.order)
        mine = DTensor.from_local(x, self.mesh, [Replicate()], run_check=False).redistribute(placements=[Shard(dim)])
        return mine.to_local()

    def gather(self, y: Tensor, dim: int) -> Tensor:
        """The whole sequence from every rank's tokens (a slice in backward), in the original order."""
        whole = DTensor.from_local(y, self.mesh, [Shard(dim)], run_check=False).redistribute(placements=[Replicate()])
        y = whole.to_local()
        return y.index_select(dim, torch.argsort(self.order)) if self.mode == "ring" else y


@dataclass(frozen=True)
class SplitOverSequence:
    """HelixPipe's parts of one block (:class:`~lightning_parallel.block_protocol.Split`) on a sequence shard: the
    stages' parts (``pre``, ``post``) run on this rank's tokens with the block's sequence-carrying arguments
    sliced to them (by the block's anatomy), and the attention core of each layer is :func:`attend` over the sp
    group (Ulysses or ring) on the attention stage. One shard serves a micro-batch's whole trunk
    (:meth:`shard` of the first layer, so that ring mode's token order is the same in every layer); the
    hidden state enters it at the trunk's entry and leaves it at its exit (:meth:`enter`, :meth:`exit`), so
    every message between stages holds 1/sp of the tokens."""

    split: Any  # the block's Split
    anatomy: Any  # sequence_dim, sequence_args and attention_mask of the block
    mesh: DeviceMesh
    mode: str

    @property
    def name(self) -> str:
        return self.split.name

    @property
    def pre_parameters(self) -> frozenset[str]:
        return self.split.pre_parameters

    def shard(self, block: nn.Module, x: Tensor, args: tuple, kwargs: dict) -> SequenceShard:
        """The split of the whole hidden state ``x`` (ring mode balances its chunks by this call's mask)."""
        dim = self.anatomy.sequence_dim(block)
        mask = self.anatomy.attention_mask(block, args, kwargs) if self.mode == "ring" else None
        return SequenceShard.of(self.mesh, self.mode, x.shape[dim], x.device, mask)

    def enter(self, block: nn.Module, x: Tensor, shard: SequenceShard) -> Tensor:
        return shard.scatter(x, self.anatomy.sequence_dim(block))

    def exit(self, block: nn.Module, y: Tensor, shard: SequenceShard) -> Tensor:
        return shard.gather(y, self.anatomy.sequence_dim(block))

    def pre(self, block: nn.Module, x: Tensor, args: tuple, kwargs: dict, shard: SequenceShard) -> Any:
        local_args, local_kwargs = self.anatomy.sequence_args(block, args, kwargs, shard.index)
        with shard_dropout(block, self.mesh, x.device):
            return self.split.pre(block, x, local_args, local_kwargs)

    def attention(self, block: nn.Module, q: Tensor, k: Tensor, v: Tensor, args: tuple, kwargs: dict,
                  shard: SequenceShard) -> Tensor:  # fmt: skip
        split = self.split

        def inner(q: Tensor, k: Tensor, v: Tensor) -> Tensor:  # (B, heads, T, hd) whatever the split returns
            out = split.attention(block, q, k, v, args, kwargs)
            return out.transpose(1, 2) if split.heads_dim == 2 else out

        def info() -> AttentionCall:
            if split.attention_call is None:
                raise ConfigurationError(
                    f"sequence_parallel_mode='ring' needs the parameters of {type(block).__name__}'s attention call,"
                    f" which {split.name} cannot tell without running the block (a mask computed inside it); use"
                    " sequence_parallel_mode='ulysses'"
                )
            return split.attention_call(block, args, kwargs)

        with shard_dropout(block, self.mesh, q.device):
            out = attend(shard, q, k, v, inner, info)
        return out.transpose(1, 2) if split.heads_dim == 2 else out

    def post(self, block: nn.Module, out: Tensor, state: tuple, args: tuple, kwargs: dict,
             shard: SequenceShard) -> Any:  # fmt: skip
        local_args, local_kwargs = self.anatomy.sequence_args(block, args, kwargs, shard.index)
        with shard_dropout(block, self.mesh, out.device):
            return self.split.post(block, out, state, local_args, local_kwargs)

    def __call__(self, block: nn.Module, x: Tensor, args: tuple, kwargs: dict) -> Any:
        """The whole block on the whole sequence, through the shards (what verification compares)."""
        shard = self.shard(block, x, args, kwargs)
        (q, k, v), state = self.pre(block, self.enter(block, x, shard), args, kwargs, shard)
        out = self.attention(block, q, k, v, args, kwargs, shard)
        y = self.post(block, out, state, args, kwargs, shard)
        if isinstance(y, Tensor):
            return self.exit(block, y, shard)
        return type(y)([self.exit(block, y[0], shard), *y[1:]])


@contextmanager
def shard_dropout(block: nn.Module, mesh: DeviceMesh, device: torch.device) -> Iterator[None]:
    """Dropout on a sequence shard: a seed drawn from the (replicated) generator keeps every rank's stream in
    step; offset by the rank, each rank's tokens (or Ulysses' heads) get their own masks. Recomputation
    restores the generator first, so it draws the same seed and replays the same masks."""
    if not (block.training and has_dropout(block)):
        yield
        return
    with forked(mesh.get_local_rank(), device):  # lightning_parallel.rng: the CPU and the device's generator
        yield


def check_heads(heads: int, kv_heads: int, sp: int, mode: str, where: str, tp: int = 1) -> None:
    """Ulysses splits heads over sp: every head count (per tensor-parallel rank) must divide by sp."""
    if mode == "ring":
        return  # ring attention keeps every (local) head on every rank
    for what, n in (("attention heads", heads), ("key/value heads", kv_heads)):
        if (n // tp) % sp:
            per_rank = f" per tensor-parallel rank ({n} / {tp} = {n // tp})" if tp > 1 else f" ({n})"
            raise ConfigurationError(
                f"sequence_parallel_mode='ulysses' needs sequence_parallel_size={sp} to divide the number of {what}"
                f"{per_rank} of {where}; use sequence_parallel_mode='ring'"
            )


def attend(
    shard: SequenceShard,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    inner: Callable[[Tensor, Tensor, Tensor], Tensor],
    call_info: Callable[[], AttentionCall],
) -> Tensor:
    """The attention core over the whole sequence from this rank's tokens: ``q, k, v`` are
    ``(B, heads, T/sp, hd)``; ``inner`` is the block's own attention core, ``call_info`` its parameters
    (ring mode runs its own kernel with them)."""
    sp, group = shard.mesh.size(), shard.mesh.get_group()
    if shard.mode == "ring":
        return _ring(q, k, v, call_info(), shard.chunks, group)
    check_heads(q.shape[1], k.shape[1], sp, "ulysses", "the block's attention")
    q, k, v = (_heads_to_sequence(t, sp, group) for t in (q, k, v))
    return _sequence_to_heads(inner(q, k, v), sp, group)


def _ring(q: Tensor, k: Tensor, v: Tensor, call: AttentionCall, chunks: tuple[int, ...], group: Any) -> Tensor:
    if call.dropout:
        raise ValueError(
            f"sequence_parallel_mode='ring' does not run attention dropout; the block uses dropout={call.dropout}:"
            " use sequence_parallel_mode='ulysses' or set the attention dropout to 0"
        )
    if call.softcap:
        raise ValueError(
            f"sequence_parallel_mode='ring' does not run attention logit soft-capping (softcap={call.softcap}):"
            " use sequence_parallel_mode='ulysses'"
        )
    mask, causal = call.mask, call.causal and call.mask is None  # a mask (whole, original order) says it all
    if k.shape[1] != q.shape[1]:  # grouped-query attention: every query head gets its kv head
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    scale = call.scale if call.scale is not None else q.shape[-1] ** -0.5
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    sinks = call.sinks.to_local() if isinstance(call.sinks, DTensor) else call.sinks
    if sinks is not None and sinks.numel() != q.shape[1]:
        raise ConfigurationError(
            f"sequence_parallel_mode='ring': the attention call has {sinks.numel()} sinks for {q.shape[1]} query"
            " heads; use sequence_parallel_mode='ulysses'"
        )
    out, _ = ring_attention(q, k, v, group.group_name, causal, scale, list(chunks), mask, sinks)
    return out


def balanced_chunks(mask: Tensor | None, sp: int) -> tuple[int, ...]:
    """Which two of the 2·sp sequence chunks each rank holds in ring mode (rank r: ``[2r]`` and ``[2r+1]``,
    in sequence order), so that every rank computes about as many chunk pairs.

    A query chunk's load is the number of key chunks it attends to: q + 1 for causal attention, and under a
    mask (a packed batch's documents) the key chunks where the mask leaves any score (always its own). The
    chunks are sorted by load and the heaviest paired with the lightest, the next with the next: for causal
    attention that is the zig-zag split (rank r: chunks r and 2sp-1-r), and under documents it evens out what
    the zig-zag would not (rows of T=16k packed from random lengths of mean 2048: the busiest rank's pairs 1.29x
    / 1.47x the mean at sp=4 / 8 with the zig-zag, 1.08x / 1.20x paired by load; benchmarks/ring_balance.py,
    docs/benchmarks.md "Long context"). Every rank
    holds the same mask, so every rank computes the same split."""
    n = 2 * sp
    if mask is None:
        loads = list(range(1, n + 1))
    else:
        attends = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min
        T = attends.shape[-1]
        if attends.dim() > 2:  # over the batch and heads, without materialising a broadcast mask
            attends = attends.any(dim=tuple(range(attends.dim() - 2)))
        pairs = attends.view(n, T // n, n, T // n).any(3).any(1)
        loads = (pairs | torch.eye(n, dtype=torch.bool, device=pairs.device)).sum(1).tolist()
    by_load = sorted(range(n), key=lambda q: (-loads[q], q))
    return tuple(c for r in range(sp) for c in sorted((by_load[r], by_load[n - 1 - r])))


def _heads_to_sequence(t: Tensor, sp: int, group: Any) -> Tensor:
    """(B, H, T/sp, d) on every rank -> (B, H/sp, T, d): rank r keeps heads r*H/sp.. for all tokens."""
    B, H, Tl, d = t.shape
    out = _collectives.all_to_all_autograd(t.permute(1, 0, 2, 3), group)  # (H, B, Tl, d): head blocks to ranks
    return out.view(sp, H // sp, B, Tl, d).permute(2, 1, 0, 3, 4).reshape(B, H // sp, sp * Tl, d)


def _sequence_to_heads(t: Tensor, sp: int, group: Any) -> Tensor:
    """The inverse of ``_heads_to_sequence``: (B, H/sp, T, d) -> (B, H, T/sp, d)."""
    B, h, T, d = t.shape
    blocks = t.view(B, h, sp, T // sp, d).permute(2, 1, 0, 3, 4)  # (sp, h, B, Tl, d): token blocks to ranks
    out = _collectives.all_to_all_autograd(blocks, group)  # (sp, h, B, Tl, d): source rank's heads
    return out.reshape(sp * h, B, T // sp, d).permute(1, 0, 2, 3)
