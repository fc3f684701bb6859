"""Split a batch into micro-batches along its batch dimension (docs/design.md, "Pipeline parallelism").

Every tensor in the batch collection is split with ``torch.tensor_split``, so a batch that does not
divide evenly (the DataLoader's default last batch) gives micro-batches whose sizes differ by at most
one; each micro-batch's loss is then weighted by its share of the batch.

A batch of fewer samples than micro-batches (an epoch's last batch) gives one micro-batch per sample and
fills the schedule with *padding*: copies of the last sample with share 0. Their loss weight is 0, so they
add exact zeros to every gradient, and the strategies run them quietly (no ``self.log``, metric states
restored), so the step trains exactly as one device trains the short batch; every schedule keeps its shape.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
from torch import Tensor, tensor_split
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten


def split_microbatches(batch: Any, num_microbatches: int) -> tuple[list[Any], list[float]]:
    """Return ``num_microbatches`` micro-batches and each one's share of the batch (summing to 1)."""
    leaves, spec = tree_flatten(batch)
    sizes = {leaf.shape[0] for leaf in leaves if isinstance(leaf, Tensor) and leaf.dim() > 0}
    if not sizes:
        raise ValueError(f"the batch ({type(batch).__name__}) holds no tensor to split into micro-batches")
    if len(sizes) > 1:
        raise ValueError(f"the batch's tensors have different sizes along dim 0: {sorted(sizes)}; cannot micro-batch")
    size = sizes.pop()
    if size == 0:
        raise ValueError("the batch is empty (0 samples along dim 0); there is nothing to train on")
    real = min(size, num_microbatches)
    pieces = [
        tensor_split(leaf, real) if isinstance(leaf, Tensor) and leaf.dim() > 0 else [leaf] * real for leaf in leaves
    ]
    micro = [tree_unflatten([p[i] for p in pieces], spec) for i in range(real)]
    first_tensor = next(i for i, leaf in enumerate(leaves) if isinstance(leaf, Tensor) and leaf.dim() > 0)
    shares = [pieces[first_tensor][i].shape[0] / size for i in range(real)]
    padding = num_microbatches - real  # the last sample again, share 0 (see the module's docstring); fresh
    last = [p[real - 1] for p in pieces]  # containers each time, so a step that edits its batch edits its own
    return micro + [tree_unflatten(last, spec) for _ in range(padding)], shares + [0.0] * padding


def batch_checksum(batch: Any) -> int:
    """A CRC32 of every tensor in the batch, to check that the ranks of one replica got the same batch."""
    crc = 0
    for leaf in tree_leaves(batch):
        if isinstance(leaf, Tensor):
            raw = leaf.detach().cpu().contiguous().view(-1).view(torch.uint8)  # any dtype, bf16 included
            crc = zlib.crc32(raw.numpy().tobytes(), crc)
    return crc
