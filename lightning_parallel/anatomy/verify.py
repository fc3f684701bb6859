"""Fail-closed verification: a transformed block must reproduce the block's own forward and gradients.

On the first real input, in float64 on copies of the block (the block itself is not touched): the
block's own forward gives the reference output, input gradient and parameter gradients; the candidate
(any transformed copy: a split, a tensor- or sequence-parallel stack, chunked MLP, recomputation) is run
on the same input with the same output weighting, its gradients brought to the single-process view with
the same algebra the strategies use (partial sums reduced, shards gathered), and compared at
``rtol=1e-9, atol=1e-10``. The verdict is agreed over the given process groups, so every rank raises
the same error or none does. With active dropout both copies run in eval mode (random masks cannot
match); the dropout paths are tested separately.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map

from lightning_parallel import _collectives
from lightning_parallel.anatomy.base import ConfigurationError

TOLERANCE = dict(rtol=1e-9, atol=1e-10)


class VerificationError(ValueError):
    """A transformed block differs from the block's own forward (or another rank found that it does)."""


def to64(value: Any) -> Any:
    """Floating tensors as detached float64 copies; everything else as is (any nesting)."""
    return tree_map(lambda t: t.detach().double() if isinstance(t, Tensor) and t.is_floating_point() else t, value)


@contextmanager
def without_forward(block: nn.Module) -> Iterator[None]:
    """Temporarily drop an instance ``forward`` (a runner) so that a deep copy is the plain block."""
    forward = block.__dict__.pop("forward", None)
    try:
        yield
    finally:
        if forward is not None:
            block.forward = forward


def float64_copy(block: nn.Module) -> nn.Module:
    with without_forward(block):
        return copy.deepcopy(block).double()


def meta_copy(block: nn.Module) -> nn.Module:
    """A float64 copy of ``block`` on the ``meta`` device (no data copied; a DTensor parameter becomes its
    global shape), without the block layer's runner and chunked MLP: the plain block, for tracing."""
    from lightning_parallel.recompute import unchunk_mlps

    def empty(t: Tensor) -> Tensor:
        return torch.empty(t.shape, dtype=torch.float64 if t.is_floating_point() else t.dtype, device="meta")

    memo: dict[int, Any] = {}
    for p in block.parameters():
        memo[id(p)] = nn.Parameter(empty(p), requires_grad=p.requires_grad)
    for b in block.buffers():
        memo[id(b)] = empty(b)
    with without_forward(block):
        copied = copy.deepcopy(block, memo)
    unchunk_mlps(copied)
    return copied


def first_tensor(out: Any) -> Tensor:
    return out if isinstance(out, Tensor) else out[0]


def _run(module: nn.Module, fn: Callable[..., Any], x: Tensor, args: tuple, kwargs: dict) -> tuple[Tensor, Tensor]:
    xi = x.clone().requires_grad_(True)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        out = first_tensor(fn(module, xi, args, kwargs))
    weight = torch.linspace(-1, 1, out.numel(), dtype=out.dtype, device=out.device).view_as(out)
    (out * weight).sum().backward()
    return out.detach(), xi.grad


def verify(
    block: nn.Module,
    x: Tensor,
    args: tuple,
    kwargs: dict,
    build: Callable[[nn.Module], tuple[Callable[..., Any], Callable[[nn.Module], dict[str, Tensor]]]],
    *,
    name: str,
    groups: Sequence[Any] = (),
) -> None:
    """Check ``build`` against ``block``'s own forward; raise :class:`VerificationError` if they differ.

    ``build(copy)`` transforms a float64 copy of the block and returns ``(forward, gradients)``:
    ``forward(copy, x, args, kwargs)`` runs it, ``gradients(copy)`` returns its parameter gradients by name
    as one process would see them (a collective where the copy is sharded)."""
    x64, a64, kw64 = to64(x), to64(args), to64(kwargs)
    reference, candidate = float64_copy(block), float64_copy(block)
    if _active_dropout(block):
        reference.eval(), candidate.eval()
    own = lambda m, xi, a, kw: type(m).forward(m, xi, *a, **kw)  # noqa: E731
    ref_out, ref_grad = _run(reference, own, x64, a64, kw64)
    ref_params = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    problems: list[str] = []
    try:
        forward, gradients = build(candidate)
        out, grad = _run(candidate, forward, x64, a64, kw64)
        params = gradients(candidate)
    except ConfigurationError:
        raise
    except Exception as err:  # noqa: BLE001  (any other failure of a candidate is a reason to refuse it)
        what = f"it raised {type(err).__name__}: {err}"
    else:
        if out.shape != ref_out.shape or not torch.allclose(out, ref_out, **TOLERANCE):
            problems.append("output")
        if grad is None or ref_grad is None or not torch.allclose(grad, ref_grad, **TOLERANCE):
            problems.append("input gradient")
        problems += [
            f"gradient of {n}"
            for n in ref_params
            if n not in params or not torch.allclose(params[n].to(ref_params[n].dtype), ref_params[n], **TOLERANCE)
        ]
        what = f"{', '.join(problems[:4])} differ(s) from the block's own forward" if problems else ""
    failed_anywhere = any(_collectives.any_over_group([bool(what)], g)[0] for g in groups)
    if what or failed_anywhere:
        raise VerificationError(
            f"{name} does not reproduce {type(block).__name__}: {what or 'verification failed on another rank'}"
        )


def plain_gradients(module: nn.Module) -> dict[str, Tensor]:
    return {n: p.grad for n, p in module.named_parameters() if p.grad is not None}


def _active_dropout(block: nn.Module) -> bool:
    from lightning_parallel.sequence_parallel import has_dropout

    return block.training and has_dropout(block)


def verify_split(split: Any, block: nn.Module, x: Tensor, args: tuple = (), kwargs: dict | None = None) -> None:
    """Check a :class:`~lightning_parallel.anatomy.Split` against ``block``'s own forward (see :func:`verify`)."""
    verify(block, x, args, kwargs or {}, lambda copy_: (split, plain_gradients), name=split.name)
