"""Tensor parallelism inside the strategies: gradients of sharded parameters and the global gradient norm
(the blocks themselves are sharded by the block layer, :mod:`lightning_parallel.blocks`)."""

from __future__ import annotations

from typing import Any, Optional

from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_parallel import _collectives
from lightning_parallel.mesh import TP
from lightning_parallel.pipeline import gradients
from lightning_parallel.tensor_parallel import TensorParallelLayout, is_sharded, local


class TensorParallelMixin:
    """Mixed into ``HybridParallelStrategy``."""

    _tp_layout: Optional[TensorParallelLayout]

    @property
    def tp_group(self) -> Optional[Any]:
        mesh = self._mesh  # type: ignore[attr-defined]
        return mesh.get_group(TP) if mesh is not None else None

    def _materialize_gradients(self, optimizer: Optimizer) -> None:
        """Bring each DTensor gradient to its parameter's placement (a partial sum becomes the sum); under
        sequence parallelism, sum the gradients of the replicated block parameters over the tp group."""
        for group in optimizer.param_groups:
            for p in group["params"]:
                g = p.grad
                if isinstance(g, DTensor) and tuple(g.placements) != tuple(p.placements):
                    p.grad = g.redistribute(placements=p.placements)
        layout = self._tp_layout
        if layout is not None and layout.partial:
            mine = {id(p) for g in optimizer.param_groups for p in g["params"]}
            grads = [p.grad for p in layout.partial if id(p) in mine and p.grad is not None]
            _collectives.all_reduce_sum_(grads, self.tp_group)

    def _counts_in_norm(self, p: nn.Parameter) -> bool:
        """Whether this rank counts ``p``'s gradient in the global norm: a tensor-parallel shard on every
        tp rank, a tp-replicated parameter on tp rank 0 only."""
        return is_sharded(p) or self.coordinate[TP] == 0  # type: ignore[attr-defined]

    def _original(self, p: nn.Parameter) -> nn.Parameter:
        """The model's parameter behind an optimizer's parameter (a chunk under sharded data parallelism)."""
        return p

    def _norm_groups(self) -> list[Any]:
        dims = self.parallel_dims  # type: ignore[attr-defined]
        return [g for g, n in ((self.tp_group, dims.tp), (getattr(self, "pp_group", None), dims.pp)) if n > 1]

    def _clip_grad_by_global_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        """``torch.nn.utils.clip_grad_norm_`` over the whole model, every parameter counted exactly once
        across the tensor- and pipeline-parallel ranks of a replica."""
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        counted = [local(p.grad) for p in params if self._counts_in_norm(self._original(p))]
        gradients.clip_grad_norm_(params, counted, clip_val, self._norm_groups())

    def _local_gradients(self, optimizer: Optimizer) -> list[Tensor]:
        return [local(p.grad) for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
