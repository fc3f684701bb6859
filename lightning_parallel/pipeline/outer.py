"""Stage-local pre- and post-trunk parameters (docs/design.md, "Where each parameter lives").

The user's step runs on every pipeline stage (the capture pass needs the trunk's input shape and the
blocks' side arguments), but only the first stage needs the values of what comes before the trunk (the
embedding) and only the loss stage needs what comes after it (final norm, head). At the first training
step, :func:`touched` finds out which parameters outside the trunk each part uses, by running the user's
step once with every such parameter present:

- a ``TorchFunctionMode`` records every watched parameter passed to a torch op before the trunk's first
  block is called ("pre") and after its last block returned ("post"): module calls
  (``F.embedding(ids, self.weight)``) and direct uses (``x @ self.wte.weight.T``) alike;
- the post-trunk part runs on a detached stand-in for the trunk's output, and ``autograd.grad`` of its
  loss finds pre-trunk parameters the loss still depends on (a residual from the embedding to the head):
  those count as "post" too;
- if a captured block argument requires grad it may be computed from a parameter; then every stage keeps
  everything (the blocks need the real values) and the step says so.

A parameter a stage does not hold lives on the ``meta`` device. While the schedule runs, it is a stride-0
placeholder of its shape, dtype and device instead (:func:`placeholders`, one element of memory), so the
capture pass still runs the pre-trunk code with real devices (Hugging Face's rotary embedding takes its
device from the hidden state); by the rules above no value the stage keeps depends on it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from lightning_parallel.pipeline.capture import Capture, _forwards, split_hidden, wrap_output
from lightning_parallel.trunk import Trunk


class _Touches(TorchFunctionMode):
    """Records which watched tensors the ops see, per phase ("pre", "trunk", "post")."""

    def __init__(self, watched: dict[int, str]) -> None:
        super().__init__()
        self.watched, self.phase = watched, "pre"
        self.seen: dict[str, set[str]] = {"pre": set(), "trunk": set(), "post": set()}

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        for a in tree_leaves((args, kwargs)):
            name = self.watched.get(id(a)) if isinstance(a, Tensor) else None
            if name is not None:
                self.seen[self.phase].add(name)
        return func(*args, **kwargs)


def touched(
    trunk: Trunk,
    step: Callable[[], Any],
    loss_of: Callable[[Any], Tensor],
    watched: dict[str, nn.Parameter],
    capture: Capture,
    output_like: Any,
) -> tuple[set[str], set[str]]:
    """The names in ``watched`` the step uses before the trunk and after it (see the module docstring).

    ``step`` runs the user's step once more with the blocks as pass-throughs; ``capture`` is its capture
    (for the trunk input's shape and the blocks' output structure ``output_like``)."""
    ids = {id(p): n for n, p in watched.items()}
    mode = _Touches(ids)
    stand_in = capture.trunk_input.detach().clone()
    last = len(trunk) - 1

    def make(j: int, block: nn.Module) -> Callable[..., Any]:
        def passthrough(*a: Any, **kw: Any) -> Any:
            hidden, _ = split_hidden(trunk, a, kw)
            if j == 0:
                mode.phase = "trunk"
            if j == last:
                mode.phase = "post"
                return wrap_output(stand_in, output_like)
            return wrap_output(hidden, output_like)

        return passthrough

    with _forwards(trunk.blocks, make, hooks=False), mode:
        loss = loss_of(step())
    pre, post = mode.seen["pre"], set(mode.seen["post"])
    suspects = [n for n in sorted(pre - post) if watched[n].requires_grad]
    if suspects and loss.requires_grad:
        grads = torch.autograd.grad(loss, [watched[n] for n in suspects], allow_unused=True)
        post |= {n for n, g in zip(suspects, grads) if g is not None}
    return set(pre), post


def set_(p: nn.Parameter, value: Tensor) -> None:
    """Make ``p`` hold ``value`` (any device, ``meta`` included) keeping the object: tied modules, optimizer
    keys and the names that point at it stay valid (``torch.utils.swap_tensors``)."""
    torch.utils.swap_tensors(p, nn.Parameter(value, requires_grad=p.requires_grad))


def free_(params: list[nn.Parameter]) -> None:
    """Move ``params`` to ``meta`` (their objects stay; the memory goes)."""
    for p in params:
        set_(p, torch.empty(p.shape, dtype=p.dtype, device="meta"))


@contextmanager
def placeholders(params: list[nn.Parameter], device: torch.device) -> Iterator[None]:
    """While inside, each meta parameter of ``params`` is a stride-0 zero tensor of its shape on ``device``."""
    for p in params:
        set_(p, torch.zeros((), dtype=p.dtype, device=device).expand(p.shape))
    try:
        yield
    finally:
        free_(params)


def exchange_sum_(grads: list[Tensor], peer: int, group: Any) -> None:
    """In place: each of ``grads`` becomes its sum with the peer's (global rank ``peer``) same-shaped tensor;
    both sides compute ``a + b`` in the same order of operands, so the results are identical."""
    import torch.distributed as dist

    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    theirs = torch.empty_like(flat)
    ops = [dist.P2POp(dist.isend, flat, peer, group), dist.P2POp(dist.irecv, theirs, peer, group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    me = dist.get_rank()
    total = flat + theirs if me < peer else theirs + flat
    offset = 0
    for g in grads:
        g.copy_(total[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
