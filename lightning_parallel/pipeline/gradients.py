"""Gradient algebra of a pipelined step (docs/design.md, "Pipeline parallelism").

- ``stash`` / ``restore``: Lightning zeroes gradients *after* ``training_step``, where the schedule has
  already run backward; the schedule's gradients are moved aside and added back in ``backward``.
- ``sum_replicated_``: pre- and post-trunk parameters are replicated on every stage and each stage's
  copy gets part of the gradient (the embedding on the first stage, the head on the last; both for tied
  embeddings); the true gradient is their sum over the pipeline group.
- ``clip_grad_norm_``: ``torch.nn.utils.clip_grad_norm_`` over the whole model, each parameter counted
  once across stages.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_parallel import _collectives
from lightning_parallel.tensor_parallel import local


def stash(params: list[nn.Parameter]) -> list[Tensor | None]:
    """Take the current gradients off ``params`` (they become ``None``) and return them."""
    saved = [p.grad for p in params]
    for p in params:
        p.grad = None
    return saved


def restore(
    stashed: list[nn.Parameter], saved: list[Tensor | None], params: list[nn.Parameter]
) -> dict[nn.Parameter, Tensor]:
    """Put ``saved`` back on the ``stashed`` parameters and return the gradients of ``params`` (the current
    ones: a block's first call may have replaced some, e.g. by their tensor-parallel shards) that
    accumulated since ``stash``."""
    new = {p: p.grad for p in params if p.grad is not None}
    current = {id(p) for p in params}
    for p, g in zip(stashed, saved):
        p.grad = g if id(p) in current else None
    return new


def add_(new: dict[nn.Parameter, Tensor]) -> None:
    for p, g in new.items():
        if p.grad is None:
            p.grad = g
        else:
            p.grad.add_(g)


def sum_replicated_(replicated: list[nn.Parameter], group: _collectives.ProcessGroup) -> None:
    """Sum the gradients of parameters replicated on every stage; parameters that no stage used keep
    ``None`` (as on one device), those some stage used get zeros where absent, then the sum."""
    if not replicated:
        return
    used = _collectives.any_over_group([p.grad is not None for p in replicated], group)
    for p, u in zip(replicated, used):
        if u and p.grad is None:
            p.grad = torch.zeros_like(p)
    _collectives.all_reduce_sum_([local(p.grad) for p in replicated if p.grad is not None], group)


def clip_grad_norm_(
    params: list[nn.Parameter], counted: list[Tensor], max_norm: float, groups: list[_collectives.ProcessGroup]
) -> Tensor:
    """Scale the gradients of ``params`` by ``min(1, max_norm / (total + 1e-6))`` as torch does, where
    ``total`` is the 2-norm of ``counted`` (this rank's share: local tensors, each element of the model
    counted on exactly one rank) summed over each of ``groups`` in turn. Returns ``total``."""
    norms = [torch.linalg.vector_norm(g, 2) for g in counted]
    if norms:
        squares = torch.linalg.vector_norm(torch.stack(norms), 2).pow(2)
    else:  # this rank counts nothing: a zero on the device its groups' collectives take
        squares = torch.zeros((), device=_collectives.comm_device(groups[0]) if groups else None)
    dtype = squares.dtype
    for group in groups:
        squares = _collectives.sum_of_squares(squares, group)
    total = squares.sqrt().to(dtype)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            grad.mul_(coef.to(grad.dtype))
    return total
