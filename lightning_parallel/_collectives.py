"""Collectives used by the strategies; the one module that calls ``torch.distributed`` for them.

Gradient and state synchronisation is coalesced: tensors are flattened into one buffer per dtype,
reduced or broadcast with a single collective, and copied back. Buffers are always contiguous (gloo
silently mis-handles non-contiguous buffers in some collectives, see docs/design.md).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

ProcessGroup = dist.ProcessGroup


def _by_dtype(tensors: Iterable[Tensor]) -> dict[torch.dtype, list[Tensor]]:
    groups: dict[torch.dtype, list[Tensor]] = defaultdict(list)
    for t in tensors:
        groups[t.dtype].append(t)
    return groups


def all_reduce_mean_(tensors: Iterable[Tensor], group: ProcessGroup) -> None:
    """In place: each tensor becomes its mean over ``group`` (one all-reduce per dtype)."""
    size = dist.get_world_size(group)
    if size == 1:
        return
    for same_dtype in _by_dtype(tensors).values():
        flat = _flatten_dense_tensors(same_dtype)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        flat.div_(size)
        for t, reduced in zip(same_dtype, _unflatten_dense_tensors(flat, same_dtype)):
            t.copy_(reduced)


def broadcast_(tensors: Iterable[Tensor], group: ProcessGroup, group_src: int = 0) -> None:
    """In place: every rank of ``group`` receives the values held by its rank ``group_src``."""
    if dist.get_world_size(group) == 1:
        return
    for same_dtype in _by_dtype(tensors).values():
        flat = _flatten_dense_tensors(same_dtype)
        dist.broadcast(flat, group=group, group_src=group_src)
        for t, received in zip(same_dtype, _unflatten_dense_tensors(flat, same_dtype)):
            t.copy_(received)
