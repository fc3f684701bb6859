"""Sequence parallelism inside the strategies: block-parameter gradients are summed over sp (the blocks
themselves run on 1/sp of the sequence through the block layer, :mod:`lightning_parallel.blocks`)."""

from __future__ import annotations

from typing import Any, Optional

from torch.optim import Optimizer

from lightning_parallel import _collectives
from lightning_parallel.mesh import SP
from lightning_parallel.sequence_parallel import SequenceParallelLayout
from lightning_parallel.tensor_parallel import local


class SequenceParallelMixin:
    """Mixed into ``HybridParallelStrategy``."""

    _sp_layout: Optional[SequenceParallelLayout]

    @property
    def sp_group(self) -> Optional[Any]:
        mesh = self._mesh  # type: ignore[attr-defined]
        return mesh.get_group(SP) if mesh is not None else None

    def _sum_sequence_gradients(self, optimizer: Optimizer) -> None:
        """Block parameters saw this rank's tokens only: sum their gradients over the sp group."""
        layout = self._sp_layout
        if layout is None:
            return
        mine = {id(p) for g in optimizer.param_groups for p in g["params"]}
        grads = [local(p.grad) for p in layout.partial if id(p) in mine and p.grad is not None]
        _collectives.all_reduce_sum_(grads, self.sp_group)
