"""Sharded data parallelism: optimizer state and reduced gradients split over the dp axis (ZeRO stages 1
and 2 of Rajbhandari et al., 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models").

``data_parallel_sharding="optimizer"``. Every parameter an optimizer steps is owned by one rank of the dp
group (:func:`owners`: greedy balance by bytes over the optimizer's parameters in order, computed once, the
same on every rank of the group, since its ranks are replicas holding the same parameters). Per step:

1. after the backward (and the tensor-, sequence- and pipeline-parallel gradient algebra), each gradient
   is reduced, as a mean over dp, to its owner only; the other ranks drop it (``grad = None``);
2. gradient clipping counts each gradient on its owner (the dp group joins the norm's groups);
3. the optimizer, which skips parameters without a gradient, updates the owned parameters and creates
   state (Adam's moments, momentum buffers) for them alone;
4. each owner broadcasts its updated parameters to the other ranks of the dp group.

Per rank: optimizer state and, after step 1, gradients are 1/dp of a replica's; parameters stay whole.
Checkpoints store optimizer state by parameter name, each entry written by its owner; a restored optimizer
keeps only the state of the parameters this rank owns. The numerics are those of plain data parallelism:
the same mean gradient, the same update, computed once instead of dp times.
"""

from __future__ import annotations

from typing import Literal

from torch import Tensor
from torch.optim import Optimizer

from lightning_parallel import _collectives
from lightning_parallel.tensor_parallel import local

Sharding = Literal["none", "optimizer"]
SHARDINGS: tuple[str, ...] = ("none", "optimizer")


def check_sharding(value: str) -> None:
    if value not in SHARDINGS:
        raise ValueError(
            f"data_parallel_sharding={value!r}; choose one of {SHARDINGS} ('optimizer': optimizer state and"
            " reduced gradients split over the data-parallel ranks)"
        )


def owners(optimizer: Optimizer, size: int) -> dict[int, int]:
    """``id(parameter) -> owning dp rank`` for every parameter of ``optimizer``, balanced by bytes."""
    loads, out = [0] * size, {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) in out:
                continue
            rank = min(range(size), key=loads.__getitem__)
            loads[rank] += local(p).numel() * p.element_size()
            out[id(p)] = rank
    return out


def _by_owner(optimizer: Optimizer, owner: dict[int, int], size: int, with_grad: bool) -> list[list[Tensor]]:
    parts: list[list] = [[] for _ in range(size)]
    seen: set[int] = set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) in seen or (with_grad and p.grad is None):
                continue
            seen.add(id(p))
            parts[owner[id(p)]].append(p)
    return parts


def reduce_to_owners_(optimizer: Optimizer, owner: dict[int, int], group: object, rank: int, size: int) -> None:
    """Step 1: each gradient becomes its dp mean on its owner; elsewhere it is dropped."""
    for r, params in enumerate(_by_owner(optimizer, owner, size, with_grad=True)):
        _collectives.reduce_mean_([local(p.grad) for p in params], group, group_dst=r)
        if r != rank:
            for p in params:
                p.grad = None


def broadcast_from_owners_(optimizer: Optimizer, owner: dict[int, int], group: object, size: int) -> None:
    """Step 4: every rank receives the parameters each owner updated."""
    for r, params in enumerate(_by_owner(optimizer, owner, size, with_grad=False)):
        _collectives.broadcast_([local(p.data) for p in params], group, group_src=r)


def drop_unowned_state(optimizer: Optimizer, owner: dict[int, int], rank: int) -> None:
    """After a restore: keep only the state of the parameters this rank owns."""
    for p in list(optimizer.state):
        if owner.get(id(p), rank) != rank:
            del optimizer.state[p]
