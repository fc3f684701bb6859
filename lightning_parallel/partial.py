"""The in-memory module after a pipelined fit: each rank holds only its stages' blocks (the others are on
the meta device). ``state_dict()`` would silently be partial (``torch.save`` succeeds, the reload fails),
so at the end of a fit the module is guarded: ``state_dict()`` raises, naming the ways to the whole model
(:meth:`~lightning_parallel.strategies.hybrid.HybridParallelStrategy.full_state_dict`, a checkpoint).
The guard goes when the strategy sets the module up again (``validate``/``test``/another ``fit``); the
library's own partial reads (saving a checkpoint) pass it with :func:`partial_allowed`."""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

_guards: weakref.WeakKeyDictionary[nn.Module, list[Any]] = weakref.WeakKeyDictionary()
_allowed = 0


@contextmanager
def partial_allowed() -> Iterator[None]:
    global _allowed
    _allowed += 1
    try:
        yield
    finally:
        _allowed -= 1


def guard(module: nn.Module, message: str) -> None:
    """Make ``state_dict()`` of ``module`` (and of any submodule holding meta tensors) raise ``message``."""
    unguard(module)

    def check(m: nn.Module, state: dict, prefix: str, local_metadata: Any) -> None:
        if not _allowed and any(k.startswith(prefix) and getattr(v, "is_meta", False) for k, v in state.items()):
            raise RuntimeError(message)

    holders = [m for m in module.modules() if m is module or any(t.is_meta for t in m.parameters(recurse=False))]
    _guards[module] = [m._register_state_dict_hook(check) for m in holders]


def unguard(module: nn.Module) -> None:
    for handle in _guards.pop(module, []):
        handle.remove()
