"""A flat run of a tensor's elements as rectangles (lightning_parallel/flat_chunks.py)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from lightning_parallel.flat_chunks import FlatChunk, boxes


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (4, 1, 5), (2, 3, 1, 2)])
def test_boxes_cover_the_range_in_order_and_each_is_contiguous(shape):
    n = math.prod(shape)
    index = torch.arange(n).view(shape)
    for start, end in itertools.combinations(range(n + 1), 2):
        pieces = boxes(shape, start, end)
        assert len(pieces) <= 2 * len(shape) - 1
        flat = [index[tuple(slice(o, o + s) for o, s in zip(off, size))].reshape(-1) for off, size in pieces]
        assert torch.equal(torch.cat(flat), torch.arange(start, end)), (shape, start, end, pieces)
    assert boxes(shape, 3, 3) == []


def test_a_tensor_without_elements_has_no_rectangle():
    assert boxes((2, 0, 3), 0, 6) == [] and boxes((0,), 0, 1) == []


def test_a_flat_chunk_gives_views_of_its_data_at_offsets_in_the_whole_tensor():
    whole = torch.arange(4 * 6.0).view(4, 6)
    block_at, block = (2, 0), (2, 6)  # a tensor-parallel shard: rows 2 and 3
    data = whole[2:4].reshape(-1)[3:10].clone()
    chunk = FlatChunk(data, 3, block, block_at, (4, 6))
    for where, sizes, view in chunk.pieces():
        assert view.data_ptr() >= data.data_ptr() and view.is_contiguous()
        torch.testing.assert_close(view, whole[tuple(slice(w, w + s) for w, s in zip(where, sizes))])
    assert [tuple(w) for w, _, _ in chunk.pieces()] == [(2, 3), (3, 0)]
    items = chunk.__create_write_items__("state.x", chunk)
    assert [tuple(i.tensor_data.size) for i in items] == [(4, 6), (4, 6)]
    assert sum(math.prod(i.tensor_data.chunk.sizes) for i in items) == data.numel()
