"""Stage-local pre- and post-trunk parameters (docs/design.md, "Where each parameter lives").

The user's step runs on every pipeline stage (the capture pass needs the trunk's input shape and the
blocks' side arguments), but only the first stage needs the values of what comes before the trunk (the
embedding) and only the loss stage needs what comes after it (final norm, head). At the first training
step, :func:`touched` finds out which parameters outside the trunk each part uses, by running the user's
step once with every such parameter present:

- a ``TorchFunctionMode`` tracks, op by op, which watched parameters every tensor was computed from
  (module calls like ``F.embedding(ids, self.weight)``, direct uses like ``x @ self.wte.weight.T``,
  ``detach``, ``no_grad`` and integer results included), and records the parameters the ops before the
  trunk's first block ("pre") and after its last block ("post") consume, directly or through such a
  tensor: a skip from the embedding to the head makes the embedding "post" too. The post-trunk part runs
  on a fresh stand-in for the trunk's output;
- if a block's side argument (at any nesting) was computed from a watched parameter, every stage keeps
  everything (the blocks need the real values) and the step says so; a parameter the step does not use
  stays on every stage. Global rank 0 decides for every rank.

A parameter a stage does not hold lives on the ``meta`` device. While the schedule runs, it is a stride-0
NaN placeholder of its shape, dtype and device instead (:func:`placeholders`, one element of memory), so
the capture pass still runs the pre-trunk code with real devices (Hugging Face's rotary embedding takes its
device from the hidden state); by the rules above no value the stage keeps depends on it, and a use the
probe could not see (a branch the first step did not take) shows as NaN, never as a quiet zero.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from lightning_parallel._collectives import settled
from lightning_parallel.pipeline.capture import _forwards, split_hidden, wrap_output
from lightning_parallel.trunk import Trunk


class _Touches(TorchFunctionMode):
    """Taint tracking over torch ops: which watched parameters each tensor was computed from.

    Every op's outputs carry the union of its inputs' taints (a watched parameter taints itself), whatever
    the op (``detach``, ``argmax`` and ops under ``no_grad`` included). ``used[phase]`` collects the
    parameters an op of that phase consumed, directly or through a tainted tensor."""

    def __init__(self, watched: dict[int, str]) -> None:
        super().__init__()
        self.watched, self.phase = watched, "pre"
        self.taint = WeakIdKeyDictionary()  # tensor -> frozenset of parameter names
        self.used: dict[str, set[str]] = {"pre": set(), "trunk": set(), "post": set()}

    def of(self, value: Any) -> frozenset[str]:
        """The parameters ``value`` (any nesting of tensors) was computed from."""
        out: frozenset[str] = frozenset()
        for a in tree_leaves(value):
            if isinstance(a, Tensor):
                name = self.watched.get(id(a))
                out |= self.taint.get(a, frozenset()) | ({name} if name is not None else frozenset())
        return out

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        sources = self.of((args, kwargs))
        self.used[self.phase] |= sources
        out = func(*args, **kwargs)
        if sources:
            for t in tree_leaves(out):
                if isinstance(t, Tensor):
                    self.taint[t] = self.taint.get(t, frozenset()) | sources
        return out


def touched(
    trunk: Trunk,
    step: Callable[[], Any],
    watched: dict[str, nn.Parameter],
    trunk_input: Tensor,
    output_like: Any,
) -> tuple[set[str], set[str], set[str]]:
    """``(pre, post, arguments)``: the names in ``watched`` whose values the step uses before the trunk, after
    it, and in the blocks' side arguments (see the module docstring).

    ``step`` runs the user's step once more with the blocks as pass-throughs, the last one returning a
    fresh stand-in of ``trunk_input``'s shape in the structure ``output_like``."""
    mode = _Touches({id(p): n for n, p in watched.items()})
    stand_in = torch.zeros_like(trunk_input)
    last = len(trunk) - 1
    arguments: set[str] = set()

    def make(j: int, block: nn.Module) -> Callable[..., Any]:
        def passthrough(*a: Any, **kw: Any) -> Any:
            hidden, rest = split_hidden(trunk, a, kw)
            arguments.update(mode.of(rest))
            if j == 0:
                settled(hidden)  # (dropped)
                mode.phase = "trunk"
            if j == last:
                mode.phase = "post"
                return wrap_output(stand_in, output_like)
            return wrap_output(hidden, output_like)

        return passthrough

    with _forwards(trunk.blocks, make, hooks=False), mode:
        step()
    return set(mode.used["pre"]), set(mode.used["post"]), arguments


def set_(p: nn.Parameter, value: Tensor) -> None:
    """Make ``p`` hold ``value`` (any device, ``meta`` included) keeping the object: tied modules, optimizer
    keys and the names that point at it stay valid (``torch.utils.swap_tensors``)."""
    new = nn.Parameter(value, requires_grad=p.requires_grad)
    new.__dict__.update(p.__dict__)  # attributes set on the parameter object survive the swap
    torch.utils.swap_tensors(p, new)


def free_(params: list[nn.Parameter]) -> None:
    """Move ``params`` to ``meta`` (their objects stay; the memory goes)."""
    for p in params:
        set_(p, torch.empty(p.shape, dtype=p.dtype, device="meta"))


@contextmanager
def placeholders(params: list[nn.Parameter], device: torch.device) -> Iterator[None]:
    """While inside, each meta parameter of ``params`` is a stride-0 NaN tensor of its shape on ``device``."""
    for p in params:
        fill = float("nan") if p.is_floating_point() or p.is_complex() else 0
        set_(p, torch.full((), fill, dtype=p.dtype, device=device).expand(p.shape))
    try:
        yield
    finally:
        free_(params)
