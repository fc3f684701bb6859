"""A rank's contiguous run of a tensor's elements, written by ``torch.distributed.checkpoint`` (DCP) into the
whole tensor on disk, with no gather.

Optimizer-state sharding (:mod:`lightning_parallel.strategies._sharding`, ZeRO stage 1) gives each data-parallel
rank the elements ``[start, end)`` of every state tensor in row-major order: a flat range, which is not one
rectangle of the tensor. DCP stores a tensor as rectangular chunks (``ChunkStorageMetadata``: offsets and
sizes), so :func:`boxes` cuts the range into at most ``2 * ndim - 1`` rectangles, each contiguous in row-major
order (a partial first row, a block of whole rows, a partial last row, recursively inside the partial rows).
:class:`FlatChunk` states them as DCP write items through the checkpointable protocol DTensor uses
(``__create_write_items__``); :class:`ChunkSavePlanner` hands DCP each rectangle's elements when it writes. The
checkpoint then holds the tensor whole, in its original shape (DCP's global plan checks that the rectangles of
all ranks cover it exactly), and reads back under any layout as before. This is the layout FSDP1's flat
parameters met too; torch's ``DTensor`` has no placement for a flat range.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def boxes(shape: Sequence[int], start: int, end: int) -> list[Box]:
    """The rectangles, in row-major order, that make up the elements ``[start, end)`` of a tensor of ``shape``
    (row-major); each is contiguous in that order, so it is a view of the range."""
    shape = tuple(shape)
    if start >= end or math.prod(shape) == 0:
        return []
    if len(shape) <= 1:
        return [((start,), (end - start,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    first, first_at = divmod(start, inner)
    last, last_at = divmod(end, inner)
    if first == last:  # inside one row
        return [((first, *o), (1, *s)) for o, s in boxes(shape[1:], first_at, last_at)]
    out: list[Box] = []
    if first_at:
        out += [((first, *o), (1, *s)) for o, s in boxes(shape[1:], first_at, inner)]
        first += 1
    if last > first:
        out.append(((first, *(0,) * (len(shape) - 1)), (last - first, *shape[1:])))
    if last_at:
        out += [((last, *o), (1, *s)) for o, s in boxes(shape[1:], 0, last_at)]
    return out


@dataclass
class FlatChunk:
    """Elements ``[start, start + data.numel())`` (row-major) of this rank's block of a tensor: the block has
    shape ``block`` and sits at ``offset`` in the whole tensor of shape ``size`` (a tensor-parallel shard's
    place; zeros for a whole tensor)."""

    data: Tensor  # 1-D
    start: int
    block: tuple[int, ...]
    offset: tuple[int, ...]
    size: tuple[int, ...]

    def pieces(self) -> Iterator[tuple[torch.Size, torch.Size, Tensor]]:
        """(offsets in the whole tensor, sizes, the elements as a view of ``data``) per rectangle."""
        at = 0
        for offsets, sizes in boxes(self.block, self.start, self.start + self.data.numel()):
            n = math.prod(sizes)
            where = torch.Size(o + b for o, b in zip(offsets, self.offset))
            yield where, torch.Size(sizes), self.data[at : at + n].view(sizes)
            at += n

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        properties = TensorProperties.create_from_tensor(self.data)
        return [
            WriteItem(
                index=MetadataIndex(fqn, where),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=where, sizes=sizes),
                    properties=properties,
                    size=torch.Size(self.size),
                ),
            )
            for where, sizes, _ in self.pieces()
        ]

    def __get_tensor_shard__(self, index: MetadataIndex) -> Tensor:
        for where, _, view in self.pieces():
            if where == index.offset:
                return view
        raise ValueError(f"{index.fqn}: no rectangle of this rank's chunk starts at {tuple(index.offset or ())}")


class ChunkSavePlanner(DefaultSavePlanner):
    """DCP's default save planner that also writes :class:`FlatChunk` values (DCP looks objects up by index
    only for tensors)."""

    def lookup_object(self, index: MetadataIndex) -> Any:
        value = self.state_dict.get(index.fqn)
        if isinstance(value, FlatChunk):
            return value.__get_tensor_shard__(index)
        return super().lookup_object(index)
