"""Lightning's ``grad_norm(module, norm_type)`` where it would silently be partial.

The utility reads ``module.named_parameters()`` gradients. Under ``pipeline`` and ``helix`` a rank holds
one stage's blocks, and inside a ``data_parallel_sharding="optimizer"`` step the parameters have no
gradients (the optimizer's chunks hold them), so the logged norms would be part of the model's.
Once one of this package's strategies sets up, the utility refuses there, naming the whole-model view,
``trainer.strategy.grad_norm(norm_type)``. The function object keeps its identity (its code is swapped),
so the refusal reaches every ``from lightning.pytorch.utilities import grad_norm``, whenever it was
imported. Everywhere else it runs unchanged.
"""

from __future__ import annotations

import types
from typing import Any


def _check(module: Any) -> None:
    trainer = getattr(module, "_trainer", None)
    strategy = getattr(trainer, "strategy", None) if trainer is not None else None
    dims = getattr(strategy, "parallel_dims", None)  # this package's strategies (pp > 1: a pipeline's stage)
    partial = dims is not None and dims.pp > 1
    in_window = any(s.open for s in getattr(getattr(strategy, "_dp", None), "shards", {}).values())
    if partial or in_window:
        why = "this rank holds one pipeline stage" if partial else "the gradients are this rank's chunks"
        raise RuntimeError(
            f"grad_norm(module) under {type(strategy).__name__} would see only part of the model ({why});"
            " use trainer.strategy.grad_norm(norm_type) (on every rank) for the whole model's norms"
        )


def _grad_norm(module: Any, norm_type: Any, group_separator: str = "/") -> Any:
    """The code Lightning's ``grad_norm`` runs once installed (its globals are Lightning's module's)."""
    _lp_check_grad_norm(module)  # type: ignore[name-defined]  # noqa: F821
    return _lp_original_grad_norm(module, norm_type, group_separator)  # type: ignore[name-defined]  # noqa: F821


def install() -> None:
    from lightning.pytorch.utilities import grads

    fn = grads.grad_norm
    if "_lp_original_grad_norm" in fn.__globals__:
        return
    original = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    fn.__globals__["_lp_original_grad_norm"] = original
    fn.__globals__["_lp_check_grad_norm"] = _check
    fn.__code__ = _grad_norm.__code__
