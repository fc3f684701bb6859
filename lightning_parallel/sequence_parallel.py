"""Sequence (context) parallelism for unchanged blocks: DeepSpeed-Ulysses (Jacobs et al., arXiv
2309.14509) over the ``sp`` axis.

Each block of the trunk runs the adapter's split forward (``lightning_parallel.adapters``) on 1/sp of
the sequence per rank:

1. the block takes this rank's contiguous slice of the (replicated) hidden state along T
   (``Replicate -> Shard(1)``: free forward, all-gather backward, so the pre-trunk gradient is whole);
2. ``pre`` (norms, projections, rotary embedding) runs on the local tokens; block arguments that carry
   T (RoPE tables) are sliced to the local positions by the adapter (``sequence_args``), never guessed
   from "a dim equal to T";
3. attention: one all-to-all turns (B, heads, T/sp, hd) into (B, heads/sp, T, hd), the block's own
   attention (masks whole, causal as is) runs on whole sequences for 1/sp of the heads, and the inverse
   all-to-all returns this rank's tokens for all heads; the backward is the inverse all-to-alls
   (functional collectives, which differentiate correctly on gloo);
4. ``post`` (output projection, residuals, MLP) runs on the local tokens; the output is all-gathered
   (``Shard(1) -> Replicate``, whose backward is a slice), so the trunk's interface is unchanged.

Parameters inside the blocks see 1/sp of the tokens on each rank: their gradients are summed over the
sp group (``SequenceParallelLayout.partial``). The adapter is verified against the block's own forward
on the first real call, like tensor parallelism's.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from lightning_parallel import _collectives
from lightning_parallel.adapters import BlockAdapter, verify_adapter

MODES = ("ulysses",)


@dataclass
class SequenceParallelLayout:
    mesh: DeviceMesh
    mode: str
    partial: list[nn.Parameter] = field(default_factory=list)  # block parameters: gradients summed over sp


def check_heads(block: nn.Module, adapter: BlockAdapter, sp: int) -> None:
    heads, kv_heads = adapter.head_counts(block)
    for what, n in (("attention heads", heads), ("key/value heads", kv_heads)):
        if n % sp:
            raise ValueError(
                f"sequence_parallel_mode='ulysses' needs sequence_parallel_size={sp} to divide the number of {what}"
                f" ({n}) of {type(block).__name__}"
            )


def parallelize_sequence(
    blocks: Iterable[nn.Module], adapter: BlockAdapter, mesh: DeviceMesh, mode: str = "ulysses"
) -> SequenceParallelLayout:
    """Make every block run on 1/sp of the sequence (see the module docstring); returns what the
    strategy needs for gradients."""
    if mode not in MODES:
        raise ValueError(f"sequence_parallel_mode={mode!r}; choose one of {MODES}")
    layout = SequenceParallelLayout(mesh, mode)
    for i, block in enumerate(blocks):
        check_heads(block, adapter, mesh.size())
        block.forward = _SequenceParallelForward(block, adapter, mesh, copy.deepcopy(block) if i == 0 else None)
        if i == 0:  # verified once, on the first real input, outside any recomputation
            block.register_forward_pre_hook(_verify_once, with_kwargs=True)
        layout.partial += list(block.parameters())
    return layout


class _SequenceParallelForward:
    def __init__(self, block: nn.Module, adapter: BlockAdapter, mesh: DeviceMesh, reference: nn.Module | None):
        self.block, self.adapter, self.mesh, self.reference = block, adapter, mesh, reference

    def __call__(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        sp, T = self.mesh.size(), x.shape[1]
        if T % sp:
            raise ValueError(
                f"sequence parallelism needs the sequence length ({T}) to be divisible by sequence_parallel_size"
                f" ({sp}); pad the batch or change sequence_parallel_size"
            )
        rank = self.mesh.get_local_rank()
        index = torch.arange(rank * (T // sp), (rank + 1) * (T // sp), device=x.device)
        mine = DTensor.from_local(x, self.mesh, [Replicate()], run_check=False).redistribute(placements=[Shard(1)])
        local_args, local_kwargs = self.adapter.sequence_args(self.block, args, kwargs, index)
        (q, k, v), residual = self.adapter.pre(self.block, mine.to_local(), local_args, local_kwargs)
        group = self.mesh.get_group()
        q, k, v = (_heads_to_sequence(t, sp, group) for t in (q, k, v))
        out = _sequence_to_heads(self.adapter.attention(self.block, q, k, v, args, kwargs), sp, group)
        y = self.adapter.post(self.block, out, residual, local_args, local_kwargs)
        whole = DTensor.from_local(y, self.mesh, [Shard(1)], run_check=False).redistribute(placements=[Replicate()])
        return whole.to_local()


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


def _verify_once(block: nn.Module, args: tuple, kwargs: dict) -> None:
    forward = block.__dict__.get("_lp_original_forward") or block.__dict__.get("forward")
    reference = getattr(forward, "reference", None)
    if reference is None or not args or not isinstance(args[0], Tensor):
        return
    forward.reference = None
    with torch.enable_grad():
        verify_adapter(forward.adapter, reference, args[0].detach(), args[1:], kwargs)
