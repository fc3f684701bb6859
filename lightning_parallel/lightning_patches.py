"""The patches to Lightning under lightning-parallel, each where a Lightning idiom would otherwise fail or be
silently partial:

- loading (:func:`install_loading`): ``MyModule.load_from_checkpoint(path)`` and Lightning's own strategies
  (``Trainer(strategy="auto").fit(..., ckpt_path=path)``) read checkpoints with
  ``lightning.fabric.utilities.cloud_io._load``, which cannot open a directory. The two module-level references
  to it (in ``lightning.pytorch.core.saving`` and ``lightning.fabric.plugins.io.torch_io``) are wrapped so that
  a sharded directory is read as the plain checkpoint :func:`lightning_parallel.checkpoint.export` would write
  (model state whole, optimizer state in ``configure_optimizers`` order); any other path goes to Lightning's
  loader unchanged. A directory that is not a complete checkpoint fails naming what it lacks and the export
  command. Installed when the package is imported: a process that loads a checkpoint may never set up one of
  this package's strategies, and Lightning has no hook for its loaders.
- throughput: ``ThroughputMonitor``'s global samples, batches, items and FLOPs per second multiply one device's
  by ``trainer.world_size``, which counts every pipeline, tensor- and sequence-parallel rank as a replica (x2 at
  pp=2: every rank of a replica sees the same batch). ``ThroughputMonitor.setup`` (a method of the class, so
  every instance, however imported) is wrapped so that under these strategies its counters multiply by the
  number of data-parallel replicas; with one replica it reports, like one device, the device values only.
- ``grad_norm``: Lightning's ``grad_norm(module, norm_type)`` reads ``module.named_parameters()`` gradients.
  Under ``pipeline`` and ``helix`` a rank holds one stage's blocks, and inside a
  ``data_parallel_sharding="optimizer"`` step the parameters have no gradients (the optimizer's chunks hold
  them), so the logged norms would be part of the model's. The utility then refuses, naming the whole-model
  view, ``trainer.strategy.grad_norm(norm_type)``. The function object keeps its identity (its code is
  swapped), so the refusal reaches every ``from lightning.pytorch.utilities import grad_norm``, whenever it was
  imported. Everywhere else it runs unchanged.

The last two are installed by :func:`install` when one of this package's strategies sets up its processes
(``setup_environment``, before Lightning calls the callbacks' ``setup``): a run without them is unchanged.
"""

from __future__ import annotations

import os
import types
from typing import Any

import torch
from torch.utils._pytree import tree_map

from lightning_parallel import checkpoint as _checkpoint
from lightning_parallel.errors import CheckpointError


def install() -> None:
    """Install every patch (idempotent)."""
    install_loading()
    _install_throughput()
    _install_grad_norm()


# ------------------------------------------------------------------------------------------- loading
def _wrap(original: Any) -> Any:
    def load(path_or_url: Any, map_location: Any = None, weights_only: Any = None) -> Any:
        if isinstance(path_or_url, (str, os.PathLike)) and os.path.isdir(path_or_url):
            if not _checkpoint.is_sharded(path_or_url):
                raise CheckpointError(
                    f"{os.fspath(path_or_url)!r} is a directory, not a complete lightning-parallel checkpoint (no"
                    f" {_checkpoint.META_FILE}); an interrupted save leaves '<path>.partial'. A complete one converts"
                    " to a single file with: python -m lightning_parallel.export <dir> <file.ckpt>"
                )
            plain = _checkpoint.to_plain(_checkpoint.load_sharded(path_or_url, weights_only=weights_only))
            if isinstance(map_location, (str, torch.device)):
                plain = tree_map(lambda t: t.to(map_location) if isinstance(t, torch.Tensor) else t, plain)
            return plain
        return original(path_or_url, map_location=map_location, weights_only=weights_only)

    load.wrapped = original  # type: ignore[attr-defined]
    return load


def install_loading() -> None:
    """Wrap Lightning's checkpoint loader where its loading idioms call it (idempotent)."""
    from lightning.fabric.plugins.io import torch_io
    from lightning.pytorch.core import saving

    for module in (saving, torch_io):
        if not hasattr(module.pl_load, "wrapped"):
            module.pl_load = _wrap(module.pl_load)


# ---------------------------------------------------------------------------------------- throughput
def _install_throughput() -> None:
    from lightning.pytorch.callbacks import ThroughputMonitor

    original = ThroughputMonitor.setup
    if getattr(original, "wrapped", None) is not None:
        return

    def setup(self: Any, trainer: Any, pl_module: Any, stage: str) -> None:
        original(self, trainer, pl_module, stage)
        dims = getattr(trainer.strategy, "parallel_dims", None)
        if dims is not None:
            for throughput in self._throughputs.values():
                throughput.world_size = dims.dp  # replicas: each one's samples are counted once

    setup.wrapped = original  # type: ignore[attr-defined]
    ThroughputMonitor.setup = setup  # type: ignore[method-assign]


# ----------------------------------------------------------------------------------------- grad_norm
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


def _install_grad_norm() -> None:
    from lightning.pytorch.utilities import grads

    fn = grads.grad_norm
    if "_lp_original_grad_norm" in fn.__globals__:
        return
    original = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    fn.__globals__["_lp_original_grad_norm"] = original
    fn.__globals__["_lp_check_grad_norm"] = _check
    fn.__code__ = _grad_norm.__code__


__all__ = ["install", "install_loading"]
