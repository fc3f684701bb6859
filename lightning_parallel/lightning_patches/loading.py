"""Lightning's loading idioms on lightning-parallel's sharded checkpoint directories.

``MyModule.load_from_checkpoint(path)`` and Lightning's own strategies (``Trainer(strategy="auto").fit(...,
ckpt_path=path)``) read checkpoints with ``lightning.fabric.utilities.cloud_io._load``, which cannot open a
directory. Importing lightning-parallel wraps the two module-level references to it (in
``lightning.pytorch.core.saving`` and ``lightning.fabric.plugins.io.torch_io``) so that a sharded directory
is read as the plain checkpoint :func:`lightning_parallel.checkpoint.export` would write (model state
whole, optimizer state in ``configure_optimizers`` order); any other path goes to Lightning's loader
unchanged. A directory that is not a complete checkpoint fails naming what it lacks and the export command.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.utils._pytree import tree_map

from lightning_parallel import checkpoint as _checkpoint
from lightning_parallel.errors import CheckpointError


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


def install() -> None:
    """Wrap Lightning's checkpoint loader where its loading idioms call it (idempotent)."""
    from lightning.fabric.plugins.io import torch_io
    from lightning.pytorch.core import saving

    for module in (saving, torch_io):
        if not hasattr(module.pl_load, "wrapped"):
            module.pl_load = _wrap(module.pl_load)
