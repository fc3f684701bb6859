"""Counting activation memory on any device, CPU included: a ``TorchDispatchMode`` that sees every op.

``LiveTensorTracker`` records each storage an op *allocates* (outputs that alias an input, i.e. views,
are skipped, so a transposed weight is not counted) and drops it when the storage is freed, via a weak
reference. It therefore counts every live storage once, whoever holds it: autograd's saved tensors,
selective checkpointing's cache of kept op outputs, the schedule's own buffers. Saved-tensor hooks
cannot do this: under checkpointing they see only the checkpoint's inputs.

``kept_for_backward`` is the number the recomputation policies are judged by: bytes still alive after a
forward, allocated during it (the output included), i.e. what backward will consume.
"""

from __future__ import annotations

import time
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves


class LiveTensorTracker(TorchDispatchMode):
    """Live bytes allocated by ops inside the mode: ``current``, ``peak``, ``largest`` single storage,
    and per-op call ``counts`` (aten kernel executions). With ``record=True``, ``series`` gets a
    ``(time.perf_counter(), current)`` point at every change."""

    def __init__(self, record: bool = False, width: int | None = None) -> None:
        super().__init__()
        self._live: dict[int, int] = {}
        self.current = self.peak = self.largest = 0
        # with ``width``: ``at_width`` counts the live bytes of tensors whose last dimension is ``width`` (a
        # block's hidden size: what tensor parallelism keeps whole on every rank)
        self.width, self.at_width, self._wide = width, 0, set()
        self.counts: Counter = Counter()
        self.series: list[tuple[float, int]] | None = [] if record else None

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.counts[func] += 1
        if any(r.alias_info is not None for r in func._schema.returns):
            return out  # a view or in-place result: no new storage
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                wide = self.width is not None and t.dim() > 0 and t.shape[-1] == self.width
                for storage in _storages(t):
                    self._track(storage, wide)
        return out

    def _track(self, storage: torch.UntypedStorage, wide: bool = False) -> None:
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if not key or key in self._live:
            return
        self._live[key] = nbytes
        self.current += nbytes
        if wide:
            self._wide.add(key)
            self.at_width += nbytes
        self.peak = max(self.peak, self.current)
        self.largest = max(self.largest, nbytes)
        if self.series is not None:
            self.series.append((time.perf_counter(), self.current))
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        nbytes = self._live.pop(key, 0)
        self.current -= nbytes
        if key in self._wide:
            self._wide.discard(key)
            self.at_width -= nbytes
        if nbytes and self.series is not None:
            self.series.append((time.perf_counter(), self.current))


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages behind ``t``: a wrapper subclass (DTensor) holds its data in inner tensors."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        inner = [getattr(t, name) for name in names]
        return [s for x in inner if isinstance(x, torch.Tensor) for s in _storages(x)]
    return [t.untyped_storage()]


def kept_for_backward(forward: Callable[[], Any]) -> tuple[int, Any]:
    """Bytes allocated by ``forward()`` and still alive when it returns (output included), and the output."""
    tracker = LiveTensorTracker()
    with tracker:
        out = forward()
    return tracker.current, out


def kept_at_width(forward: Callable[[], Any], width: int) -> tuple[int, int]:
    """Bytes ``forward()`` keeps (as :func:`kept_for_backward`), and those of them in tensors whose last
    dimension is ``width``."""
    tracker = LiveTensorTracker(width=width)
    with tracker:
        out = forward()  # noqa: F841  (alive while the bytes are read: it is part of what the forward keeps)
        return tracker.current, tracker.at_width


def time_forward_backward(forward: Callable[[], torch.Tensor], repeats: int = 3) -> float:
    """Median seconds of ``forward().sum().backward()`` over ``repeats`` runs (after one warm-up)."""
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        forward().sum().backward()
        if i:
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]
