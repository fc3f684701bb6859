"""Collectives used by the strategies; the one module that calls ``torch.distributed`` for them (point-to-point
messages are :mod:`lightning_parallel._p2p`).

Gradient and state synchronisation is coalesced: tensors are flattened into one buffer per dtype,
reduced or broadcast with a single collective, and copied back. Buffers are always contiguous (gloo
silently mis-handles non-contiguous buffers in some collectives, see docs/design.md).
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

ProcessGroup = dist.ProcessGroup
_F = TypeVar("_F", bound=Callable[..., Any])

comm_seconds = 0.0  # wall time spent in the blocking collectives below, read by the profiling callbacks


def _timed(fn: _F) -> _F:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        global comm_seconds
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            comm_seconds += time.perf_counter() - t0

    return wrapper  # type: ignore[return-value]


def by_dtype(items: Iterable[Any], dtype: Callable[[Any], torch.dtype] = lambda t: t.dtype) -> dict[Any, list]:
    """``items`` grouped by ``dtype(item)`` (a tensor's own by default), in order."""
    groups: dict[torch.dtype, list] = defaultdict(list)
    for t in items:
        groups[dtype(t)].append(t)
    return groups


def all_reduce_mean_(tensors: Iterable[Tensor], group: ProcessGroup) -> None:
    """In place: each tensor becomes its mean over ``group`` (one all-reduce per dtype)."""
    all_reduce_sum_(tensors, group, mean=True)


BUCKET_BYTES = 16 * 2**20


@_timed
def broadcast_(tensors: Iterable[Tensor], group: ProcessGroup, group_src: int = 0) -> None:
    """In place: every rank of ``group`` receives the values held by its rank ``group_src``. Small tensors
    travel flattened in buckets of up to 16 MiB, large contiguous ones in place (no whole-model copy)."""
    if dist.get_world_size(group) == 1:
        return
    for same_dtype in by_dtype(tensors).values():
        bucket: list[Tensor] = []
        for t in [*same_dtype, None]:
            big = t is not None and t.numel() * t.element_size() >= BUCKET_BYTES and t.is_contiguous()
            full = t is None or big or sum(b.numel() for b in bucket) * t.element_size() >= BUCKET_BYTES
            if bucket and full:
                flat = _flatten_dense_tensors(bucket)
                dist.broadcast(flat, group=group, group_src=group_src)
                for b, received in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                    b.copy_(received)
                bucket = []
            if big:
                dist.broadcast(t, group=group, group_src=group_src)
            elif t is not None:
                bucket.append(t)


def comm_device(group: ProcessGroup | None = None) -> torch.device:
    """The device a tensor this module creates for ``group``'s collectives lives on: CUDA's current device when
    the group has no host backend (NCCL alone, Lightning's default on GPUs: "No backend type associated with
    device type cpu" otherwise), else the host (gloo, or ``"cpu:gloo,cuda:nccl"``, which serves host tensors on
    purpose). Tensors the caller hands over keep their own device."""
    from torch.distributed.distributed_c10d import _get_object_coll_device

    kind = _get_object_coll_device(group)
    return torch.device(kind, torch.cuda.current_device()) if kind == "cuda" else torch.device(kind)


def _on(values: list[int] | list[float], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A small tensor built from host values (a header, a flag vector) on ``device``: one copy to it."""
    return torch.tensor(values, dtype=dtype, device=device)


@_timed
def all_reduce_sum_(tensors: Iterable[Tensor], group: ProcessGroup, mean: bool = False) -> None:
    """In place: each tensor becomes its sum (``mean``: its mean) over ``group`` (one all-reduce per dtype)."""
    size = dist.get_world_size(group)
    if size == 1:
        return
    for same_dtype in by_dtype(tensors).values():
        flat = _flatten_dense_tensors(same_dtype)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        if mean:
            flat.div_(size)
        for t, reduced in zip(same_dtype, _unflatten_dense_tensors(flat, same_dtype)):
            t.copy_(reduced)


@_timed
def all_reduce_max_(tensor: Tensor, group: ProcessGroup) -> Tensor:
    """In place: ``tensor`` becomes its element-wise maximum over ``group``; returns it."""
    if dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor


@_timed
def reduce_scatter_sum(flat: Tensor, group: ProcessGroup) -> Tensor:
    """Rank r of ``group`` gets the sum over the group of segment r of ``flat`` (equal segments)."""
    size = dist.get_world_size(group)
    out = torch.empty(flat.numel() // size, dtype=flat.dtype, device=flat.device)
    if size == 1:
        return out.copy_(flat)
    dist.reduce_scatter_single(out, flat, op=dist.ReduceOp.SUM, group=group)
    return out


@_timed
def all_gather_flat(mine: Tensor, group: ProcessGroup) -> Tensor:
    """Every rank's ``mine`` (the same size everywhere), concatenated in group-rank order."""
    size = dist.get_world_size(group)
    out = torch.empty(size * mine.numel(), dtype=mine.dtype, device=mine.device)
    if size == 1:
        return out.copy_(mine)
    dist.all_gather_single(out, mine, group=group)
    return out


def gather_rows(mine: Tensor, rows: int, group: ProcessGroup, dsts: list[int]) -> Tensor | None:
    """The whole tensor of ``rows`` rows cut in dim 0 over ``group`` (group rank i holds chunk i of
    ``ceil(rows / size)`` rows, the last ones shorter or empty, as ``torch.chunk`` and DTensor's ``Shard(0)``
    cut it) on each global rank in ``dsts``, ``None`` on the others, which only send their chunk: one
    gather per destination."""
    size = dist.get_world_size(group)
    c = -(-rows // size)
    padded = _pad_rows(mine, c)
    me, out = dist.get_rank(), None
    for dst in dsts:
        if me == dst:
            buf = mine.new_empty((size * c, *mine.shape[1:]))
            dist.gather(padded, list(buf.split(c)), dst=dst, group=group)
            out = buf[:rows]
        else:
            dist.gather(padded, None, dst=dst, group=group)
    return out


def scatter_rows_sum(whole: Tensor | None, like: Tensor, rows: int, group: ProcessGroup, srcs: list[int]) -> Tensor:
    """This rank's chunk (shaped like ``like``, cut as in :func:`gather_rows`) of the sum over the global ranks
    in ``srcs``, in that order, of their ``whole`` tensor of ``rows`` rows (read on ``srcs`` only): one
    scatter per source."""
    size = dist.get_world_size(group)
    c = -(-rows // size)
    recv, out, me = like.new_empty((c, *like.shape[1:])), None, dist.get_rank()
    for src in srcs:
        parts = None
        if me == src:
            assert whole is not None
            parts = [_pad_rows(p, c) for p in whole.split(c)]
            parts += [whole.new_zeros((c, *whole.shape[1:]))] * (size - len(parts))
        dist.scatter(recv, parts, src=src, group=group)
        mine = recv[: like.shape[0]]
        out = mine.clone() if out is None else out.add_(mine)
    assert out is not None
    return out


def _pad_rows(t: Tensor, rows: int) -> Tensor:
    if t.shape[0] == rows:
        return t.contiguous()
    return torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))])


def gather_object_to_zero(obj: object) -> list | None:
    """Every rank's ``obj`` on global rank 0 (``None`` elsewhere); ``[obj]`` without a process group."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    parts: list | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, parts, dst=0)
    return parts


def barrier(group: ProcessGroup | None = None) -> None:
    dist.barrier(group=group)


def broadcast_object(obj: object, src: int, group: ProcessGroup | None) -> object:
    box = [obj]
    dist.broadcast_object_list(box, src, group=group)
    return box[0]


def any_over_group(flags: list[bool], group: ProcessGroup) -> list[bool]:
    """Element-wise logical OR of ``flags`` over ``group``."""
    t = _on([int(f) for f in flags], torch.uint8, comm_device(group))
    if dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [bool(x) for x in t.tolist()]


def world_size() -> int:
    """Processes in the default group; 1 when torch.distributed is not initialised."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def all_gather_object(obj: object, group: ProcessGroup | None = None) -> list:
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def group_ranks(group: ProcessGroup) -> list[int]:
    """Global ranks of ``group``, in group-rank order."""
    return dist.get_process_group_ranks(group)


@_timed
def sum_of_squares(local: Tensor, group: ProcessGroup) -> Tensor:
    """``local`` (a scalar of squared norms) summed over ``group`` in float64."""
    total = local.double().reshape(1)
    dist.all_reduce(total, group=group)
    return total[0]


def settled(t: Any) -> Any:
    """``t`` waited (gradients pass through), where an asynchronous functional collective made it (an
    ``AsyncCollectiveTensor``: the output of a tensor-parallel plan's module, which DTensor redistributes with
    ``async_op=True``); else ``t``. The pipeline drops such values (the trunk input a stage that does not run the
    first block captures, or recomputes and replaces: ``pipeline/capture.py``), so nothing would wait on them:
    their collectives would stay registered, holding their outputs, until the process ends (torch warns of
    "unwaited collective calls")."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return _Waited.apply(t) if isinstance(t, AsyncCollectiveTensor) else t


class _Waited(torch.autograd.Function):
    """An asynchronous collective's output, waited; the identity for gradients."""

    @staticmethod
    def forward(ctx: Any, t: Tensor) -> Tensor:  # type: ignore[override]
        return t.wait()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:  # type: ignore[override]
        return grad


# ------------------------------------------------------------------- differentiable (sequence parallel)
def all_to_all_autograd(tensor: Tensor, group: ProcessGroup) -> Tensor:
    """Equal-split all-to-all along dim 0 whose backward is the inverse all-to-all (functional
    collectives: correct gradients on gloo, unlike ``torch.distributed.nn``; cpu-gloo.md §3)."""
    import torch.distributed._functional_collectives as fc

    out = fc.all_to_all_single_autograd(tensor.contiguous(), None, None, group)
    return fc.wait_tensor(out) if isinstance(out, fc.AsyncCollectiveTensor) else out


def all_to_all_counts(counts: Tensor, group: ProcessGroup) -> Tensor:
    """Equal-split all-to-all of ``counts`` (no autograd): rank j of ``group`` gets the j-th of its equal parts from
    every rank, concatenated by source rank (expert parallelism's per-expert counts)."""
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    return received


def all_to_all_rows(rows: Tensor, send: list[int], recv: list[int], group: ProcessGroup) -> Tensor:
    """All-to-all of ``rows`` along dim 0 with variable splits: ``send[j]`` rows (in order) to rank j of ``group``,
    ``recv[j]`` from it, concatenated by source rank. Its backward is the reverse all-to-all (functional
    collectives, as :func:`all_to_all_autograd`)."""
    import torch.distributed._functional_collectives as fc

    out = fc.all_to_all_single_autograd(rows.contiguous(), recv, send, group)
    return fc.wait_tensor(out) if isinstance(out, fc.AsyncCollectiveTensor) else out


def all_gather_rows(rows: Tensor, group: ProcessGroup) -> Tensor:
    """Every rank's ``rows`` (any count each) concatenated along dim 0 by rank, with autograd: the gradient of a
    rank's rows is the sum of what every rank's copy received (an all-to-all of the copies, and back)."""
    size = group_size(group)
    counts = all_to_all_counts(torch.full((size,), rows.shape[0], device=rows.device), group).tolist()
    return all_to_all_rows(rows.repeat(size, *[1] * (rows.dim() - 1)), [rows.shape[0]] * size, counts, group)


def ring_shift(tensor: Tensor, group: ProcessGroup) -> Tensor:
    """Send ``tensor`` to the next rank of ``group``'s ring; return the previous rank's (same shape)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    flat = tensor.contiguous().reshape(1, -1)
    out = torch.empty_like(flat)
    send = [1 if j == (rank + 1) % size else 0 for j in range(size)]
    recv = [1 if j == (rank - 1) % size else 0 for j in range(size)]
    dist.all_to_all_single(out, flat, output_split_sizes=recv, input_split_sizes=send, group=group)
    return out.reshape(tensor.shape)


def resolve_group(name: str) -> ProcessGroup:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def group_rank(group: ProcessGroup) -> int:
    return dist.get_rank(group)


def group_size(group: ProcessGroup) -> int:
    return dist.get_world_size(group)


# ------------------------------------------------------------------ differentiable (tensor parallel)
# Megatron-LM's f and g (Shoeybi et al., arXiv 1909.08053, §3), on functional collectives so that
# selective recomputation recognises and keeps them.
def _all_reduce(t: Tensor, group: ProcessGroup) -> Tensor:
    import torch.distributed._functional_collectives as fc

    return fc.wait_tensor(fc.all_reduce(t.contiguous(), "sum", group))


class _CopyToGroup(torch.autograd.Function):
    """Identity in forward, all-reduce (sum) in backward: Megatron's f, before column-parallel work."""

    @staticmethod
    def forward(ctx: Any, t: Tensor, group: ProcessGroup) -> Tensor:  # type: ignore[override]
        ctx.group = group
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return _all_reduce(grad, ctx.group), None


class _ReduceFromGroup(torch.autograd.Function):
    """All-reduce (sum) in forward, identity in backward: Megatron's g, after row-parallel work."""

    @staticmethod
    def forward(ctx: Any, t: Tensor, group: ProcessGroup) -> Tensor:  # type: ignore[override]
        return _all_reduce(t, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return grad, None


def copy_to_group(t: Tensor, group: ProcessGroup) -> Tensor:
    return _CopyToGroup.apply(t, group)


def reduce_from_group(t: Tensor, group: ProcessGroup) -> Tensor:
    return _ReduceFromGroup.apply(t, group)
