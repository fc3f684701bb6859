"""Float64 through a block's own casts, for verifying a transform that changes where a float32 sum is split.

Sequence parallelism's chained recurrence (:mod:`lightning_parallel.lasp`) runs a mixer's scan on each rank's
piece of the sequence: the same function, its float32 sums split at other places than one device splits them.
Qwen3-Next's gated delta rule casts to float32 itself, so compared as the block computes, the two differ by float32
rounding, which passes a float32 bound on the smallest gradient elements (a bound loose enough for it would let a
wrong result through). While verifying such a block, :func:`float64_through` keeps float64 where the block casts
down (``x.float()``, ``.to(torch.float32)``: a dispatch mode), and runs transformers' grouped-GEMM experts through
their batched implementation (the same products; the grouped kernel takes no float64), so that the reference and
the candidate compute the block's function in float64 alike and are compared at ``rtol=1e-9``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

_CASTS = (torch.float32, torch.float16, torch.bfloat16)


class _Wide(TorchDispatchMode):
    """A cast of a float64 tensor to a narrower float stays float64."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") in _CASTS:
            if isinstance(args[0], Tensor) and args[0].dtype == torch.float64:
                kwargs = {**kwargs, "dtype": torch.float64}
        return func(*args, **kwargs)


@contextmanager
def float64_through() -> Iterator[None]:
    """While open: float64 kept through casts, and grouped-GEMM experts run batched (module docstring)."""
    swapped = None
    if "transformers" in sys.modules:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        swapped = ALL_EXPERTS_FUNCTIONS._local_mapping.get("grouped_mm")
        ALL_EXPERTS_FUNCTIONS["grouped_mm"] = ALL_EXPERTS_FUNCTIONS["batched_mm"]
    try:
        with _Wide():
            yield
    finally:
        if "transformers" in sys.modules:
            from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

            if swapped is None:
                del ALL_EXPERTS_FUNCTIONS["grouped_mm"]
            else:
                ALL_EXPERTS_FUNCTIONS["grouped_mm"] = swapped
