"""Sequence (context) parallelism for unchanged blocks over the ``sp`` axis: DeepSpeed-Ulysses (Jacobs et
al., arXiv 2309.14509) and ring attention (Liu et al., arXiv 2310.01889) with zig-zag load balancing.

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

Ring mode replaces step 3: the sequence is cut into 2·sp chunks and rank r holds chunks r and 2sp-1-r
(zig-zag), the same permutation applied to the hidden state on entry (and undone on exit) and to the
rotary positions, so every rank does the same causal work; ``lightning_parallel.ring_attention`` passes
k and v around the ring (fused flash kernel per chunk pair, merged by log-sum-exp; one custom op, so
recomputation keeps its output; an explicit mask is sliced per chunk pair). Attention dropout is
refused in ring mode.

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
from lightning_parallel.adapters import BlockAdapter, verify_on_first_call
from lightning_parallel.ring_attention import ring_attention

MODES = ("ulysses", "ring")


@dataclass
class SequenceParallelLayout:
    mesh: DeviceMesh
    mode: str
    partial: list[nn.Parameter] = field(default_factory=list)  # block parameters: gradients summed over sp


def check_heads(block: nn.Module, adapter: BlockAdapter, sp: int, mode: str, tp: int = 1) -> None:
    if mode == "ring":
        return  # ring attention keeps every (local) head on every rank
    heads, kv_heads = adapter.head_counts(block)
    for what, n in (("attention heads", heads), ("key/value heads", kv_heads)):
        if (n // tp) % sp:
            per_rank = f" per tensor-parallel rank ({n} / {tp} = {n // tp})" if tp > 1 else f" ({n})"
            raise ValueError(
                f"sequence_parallel_mode='ulysses' needs sequence_parallel_size={sp} to divide the number of {what}"
                f"{per_rank} of {type(block).__name__}; use sequence_parallel_mode='ring'"
            )


def parallelize_sequence(
    blocks: Iterable[nn.Module], adapter: BlockAdapter, mesh: DeviceMesh, mode: str = "ulysses", tp: int = 1
) -> SequenceParallelLayout:
    """Make every block run on 1/sp of the sequence (see the module docstring); returns what the
    strategy needs for gradients. With ``tp > 1`` the blocks are already tensor-parallel (their
    projections sharded, the adapter verified by tensor parallelism): heads are split by tp, then by sp."""
    if mode not in MODES:
        raise ValueError(f"sequence_parallel_mode={mode!r}; choose one of {MODES}")
    layout = SequenceParallelLayout(mesh, mode)
    for i, block in enumerate(blocks):
        check_heads(block, adapter, mesh.size(), mode, tp)
        reference = copy.deepcopy(block) if i == 0 and tp == 1 else None
        block.forward = _SequenceParallelForward(block, adapter, mesh, reference, mode)
        if reference is not None:  # verified once, on the first real input, outside any recomputation
            block.register_forward_pre_hook(verify_on_first_call, with_kwargs=True)
        layout.partial += list(block.parameters())
    return layout


class _SequenceParallelForward:
    def __init__(
        self, block: nn.Module, adapter: BlockAdapter, mesh: DeviceMesh, reference: nn.Module | None, mode: str
    ) -> None:
        self.block, self.adapter, self.mesh, self.reference, self.mode = block, adapter, mesh, reference, mode

    def __call__(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if not (self.block.training and _has_dropout(self.block)):
            return self._forward(x, *args, **kwargs)
        # Dropout on sharded activations: a seed drawn from the (replicated) generator keeps every rank's
        # stream in step; offset by the rank, each rank's tokens get their own masks. Recomputation
        # restores the generator first, so it draws the same seed and replays the same masks.
        seed = int(torch.randint(0, 2**62, (1,)))
        with torch.random.fork_rng(devices=[x.device] if x.device.type == "cuda" else []):
            torch.manual_seed(seed + self.mesh.get_local_rank())
            return self._forward(x, *args, **kwargs)

    def _forward(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        sp, T = self.mesh.size(), x.shape[1]
        parts = 2 * sp if self.mode == "ring" else sp
        if T % parts:
            raise ValueError(
                f"sequence parallelism needs the sequence length ({T}) to be divisible by"
                f" {'2 x ' if parts > sp else ''}sequence_parallel_size ({parts}); pad the batch or change"
                " sequence_parallel_size"
            )
        rank, group = self.mesh.get_local_rank(), self.mesh.get_group()
        order = zigzag(T, sp, x.device) if self.mode == "ring" else torch.arange(T, device=x.device)
        index = order.view(sp, -1)[rank]  # this rank's token positions
        if self.mode == "ring":
            x = x.index_select(1, order)
        mine = DTensor.from_local(x, self.mesh, [Replicate()], run_check=False).redistribute(placements=[Shard(1)])
        local_args, local_kwargs = self.adapter.sequence_args(self.block, args, kwargs, index)
        (q, k, v), residual = self.adapter.pre(self.block, mine.to_local(), local_args, local_kwargs)
        if self.mode == "ring":
            out = self._ring(q, k, v, args, kwargs, rank, group)
        else:
            q, k, v = (_heads_to_sequence(t, sp, group) for t in (q, k, v))
            out = _sequence_to_heads(self.adapter.attention(self.block, q, k, v, args, kwargs), sp, group)
        y = self.adapter.post(self.block, out, residual, local_args, local_kwargs)
        whole = DTensor.from_local(y, self.mesh, [Shard(1)], run_check=False).redistribute(placements=[Replicate()])
        y = whole.to_local()
        return y.index_select(1, torch.argsort(order)) if self.mode == "ring" else y

    def _ring(self, q: Tensor, k: Tensor, v: Tensor, args: tuple, kwargs: dict, rank: int, group: Any) -> Tensor:
        causal, scale, dropout, mask = self.adapter.attention_info(self.block, args, kwargs)
        if q.device.type != "cpu":
            raise NotImplementedError(
                f"sequence_parallel_mode='ring' runs torch's CPU flash-attention kernel per chunk pair; on"
                f" {q.device.type} use sequence_parallel_mode='ulysses' (a CUDA ring kernel is not written yet)"
            )
        if dropout:
            raise ValueError(
                f"sequence_parallel_mode='ring' does not run attention dropout; {type(self.block).__name__} uses"
                f" dropout={dropout}: use sequence_parallel_mode='ulysses' or set the attention dropout to 0"
            )
        if mask is not None:  # additive, in q's dtype, over the whole sequence in its original order
            if mask.dtype == torch.bool:
                fill = torch.finfo(q.dtype).min
                mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, fill)
            mask, causal = mask.to(q.dtype), False
        if k.shape[1] != q.shape[1]:  # grouped-query attention: every query head gets its kv head
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        scale = scale if scale is not None else q.shape[-1] ** -0.5
        out, _ = ring_attention(q.contiguous(), k.contiguous(), v.contiguous(), group.group_name, causal, scale, mask)
        return out


def _has_dropout(block: nn.Module) -> bool:
    attn_p = [getattr(m, "dropout", 0.0) for m in block.modules() if isinstance(getattr(m, "dropout", None), float)]
    return any(isinstance(m, nn.Dropout) and m.p > 0 for m in block.modules()) or any(p > 0 for p in attn_p)


def zigzag(T: int, sp: int, device: torch.device) -> Tensor:
    """Token order that gives rank r the chunks r and 2sp-1-r of 2sp equal chunks (causal load balance)."""
    chunks = torch.arange(T, device=device).view(2 * sp, -1)
    return torch.cat([torch.cat([chunks[r], chunks[2 * sp - 1 - r]]) for r in range(sp)])


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
