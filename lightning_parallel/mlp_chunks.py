"""Chunked MLP (``mlp_chunks=k``): a block's token-wise MLP runs over k slices of the sequence, so its wide
intermediate (4H, or the SwiGLU gate and up projections) exists for T/k tokens at a time, in forward and
backward (autograd keeps one 1/k-sized tensor per slice). The primitive the anatomies install where they find
the MLP; it imports nothing of this package but the block-call protocol."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from lightning_parallel.errors import ConfigurationError


def chunk_mlp(owner: nn.Module, name: str, chunks: int, dim: int, block_name: str) -> None:
    """Run ``owner.<name>`` (the block's token-wise MLP, as the block's anatomy locates it) over ``chunks``
    slices of the sequence: an instance attribute, removed by :func:`unchunk_mlps`."""
    setattr(owner, name, ChunkedMLP(owner, name, chunks, dim, block_name))


def unchunk_mlps(block: nn.Module) -> None:
    for module in block.modules():
        for name, value in list(module.__dict__.items()):
            if isinstance(value, ChunkedMLP):
                del module.__dict__[name]


class ChunkedMLP:
    """``owner.<name>`` run over ``chunks`` slices of the sequence; holds ``owner`` itself so that a deep
    copy of the block runs the copy's MLP."""

    def __init__(self, owner: nn.Module, name: str, chunks: int, dim: int, block_name: str) -> None:
        self.owner, self.name, self.chunks, self.dim, self.block_name = owner, name, chunks, dim, block_name

    def __call__(self, x: Tensor, *args: Any, **kwargs: Any) -> Any:
        length = x.shape[self.dim]
        if self.chunks > length:
            raise ConfigurationError(
                f"mlp_chunks={self.chunks} is larger than the sequence: the MLP input {tuple(x.shape)} of"
                f" {self.block_name} has {length} tokens along dim {self.dim}"
            )
        original = getattr(type(self.owner), self.name)
        # contiguous: a slice along the sequence of a (B, T, H) batch is not, and some MLPs .view() their input
        parts = [part.contiguous() for part in torch.tensor_split(x, self.chunks, dim=self.dim)]
        outs = [original(self.owner, part, *args, **kwargs) for part in parts]
        return self._joined(outs, parts)

    def _joined(self, outs: list[Any], parts: list[Tensor]) -> Any:
        """The chunks' outputs as the whole sequence's: tensors along the sequence dim; a tuple element by element
        (a mixture of experts' router scores beside its output, GPT-OSS); ``None`` stays ``None``; a tensor of one
        row per token flattened batch-first (``(B*T, E)`` router scores) joined per token."""
        first = outs[0]
        if first is None and all(o is None for o in outs):
            return None
        if isinstance(first, (tuple, list)):
            return type(first)(self._joined([o[k] for o in outs], parts) for k in range(len(first)))
        if isinstance(first, Tensor):
            lead = [p.shape[: self.dim + 1] for p in parts]  # (B, T_chunk): the tokens of a chunk, batch-first
            if all(o.shape[: self.dim + 1] == s for o, s in zip(outs, lead)):
                return torch.cat(outs, dim=self.dim)
            if all(o.dim() >= 1 and o.shape[0] == math.prod(s) for o, s in zip(outs, lead)):
                rows = [o.reshape(*s, *o.shape[1:]) for o, s in zip(outs, lead)]
                return torch.cat(rows, dim=self.dim).flatten(0, self.dim)
        raise ValueError(
            f"mlp_chunks={self.chunks}: the MLP of {self.block_name} returns {type(first).__name__}, which is not"
            " one value per token; chunking needs outputs along the sequence (or one row per token)"
        )
