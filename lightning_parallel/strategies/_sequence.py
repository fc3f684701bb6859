"""Sequence parallelism inside the strategies: each rank's local blocks run on 1/sp of the sequence
(after pipeline placement, before recomputation); block-parameter gradients are summed over sp."""

from __future__ import annotations

from typing import Any, Optional

from torch import nn
from torch.optim import Optimizer

from lightning_parallel import _collectives
from lightning_parallel.adapters import find_adapter
from lightning_parallel.mesh import SP
from lightning_parallel.pipeline.trunk import discover_trunk
from lightning_parallel.sequence_parallel import SequenceParallelLayout, parallelize_sequence
from lightning_parallel.tensor_parallel import local


class SequenceParallelMixin:
    """Mixed into ``HybridParallelStrategy``."""

    _sp_layout: Optional[SequenceParallelLayout] = None
    _sp_mode: str
    _adapter_arg: Optional[str]
    _trunk_path: Optional[str]

    @property
    def sp_group(self) -> Optional[Any]:
        mesh = self._mesh  # type: ignore[attr-defined]
        return mesh.get_group(SP) if mesh is not None else None

    def _apply_sequence_parallel(self, module: nn.Module) -> None:
        dims = self.parallel_dims  # type: ignore[attr-defined]
        if dims.sp == 1 or self._sp_layout is not None:
            return
        trunk = discover_trunk(module, self._trunk_path)
        adapter = find_adapter(trunk.blocks[0], self._adapter_arg)
        local = [block for _, block in trunk.materialised()]
        mesh = self.device_mesh[SP]  # type: ignore[attr-defined]
        self._sp_layout = parallelize_sequence(local, adapter, mesh, self._sp_mode, dims.tp)

    def _sum_sequence_gradients(self, optimizer: Optimizer) -> None:
        """Block parameters saw this rank's tokens only: sum their gradients over the sp group."""
        layout = self._sp_layout
        if layout is None:
            return
        mine = {id(p) for g in optimizer.param_groups for p in g["params"]}
        grads = [local(p.grad) for p in layout.partial if id(p) in mine and p.grad is not None]
        _collectives.all_reduce_sum_(grads, self.sp_group)
