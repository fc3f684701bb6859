"""Tensor parallelism inside the strategies: gradients of sharded parameters and the global gradient norm
(the blocks themselves are sharded by the block layer, :mod:`lightning_parallel.blocks`)."""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_parallel import _collectives
from lightning_parallel.mesh import DP, SP, TP
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
        self._place_gradients(optimizer)
        layout = self._tp_layout
        if layout is not None and layout.partial:
            mine = {id(p) for g in optimizer.param_groups for p in g["params"]}
            grads = [local(p.grad) for p in layout.partial if id(p) in mine and p.grad is not None]
            _collectives.all_reduce_sum_(grads, self.tp_group)

    @staticmethod
    def _place_gradients(optimizer: Optimizer) -> None:
        """Bring each DTensor gradient to its parameter's placement (idempotent)."""
        for group in optimizer.param_groups:
            for p in group["params"]:
                g = p.grad
                if isinstance(g, DTensor) and tuple(g.placements) != tuple(p.placements):
                    p.grad = g.redistribute(placements=p.placements)

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

    @staticmethod
    def _clip_grad_by_value(optimizer: Optimizer, clip_val: float) -> None:
        """``torch.nn.utils.clip_grad_value_`` element by element on each rank's local gradients (torch's
        foreach version refuses a list mixing DTensors and plain tensors)."""
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    local(p.grad).clamp_(min=-clip_val, max=clip_val)

    def grad_norm(self, norm_type: Union[float, str] = 2.0, group_separator: str = "/") -> dict[str, Tensor]:
        """Lightning's ``grad_norm(module, norm_type)`` for the whole model, not this rank's part: each
        parameter's gradient norm under its original name (tensor-parallel shards combined, the other
        pipeline stages' parameters included, replicated ones counted once) and the total, the same dict on
        every rank. A collective: call it on every rank, e.g.
        ``self.log_dict(self.trainer.strategy.grad_norm(2))`` in ``on_before_optimizer_step``. Not inside a
        sharded data-parallel step (the gradients are chunks there)."""
        norm_type = float(norm_type)
        if norm_type <= 0:
            raise ValueError(f"norm_type must be a positive number or 'inf', got {norm_type}")
        if any(shards.open for shards in getattr(self, "_shards", {}).values()) or getattr(
            self, "_fully_sharded", False
        ):
            raise RuntimeError(
                f"grad_norm() under data_parallel_sharding={self._dp_sharding!r} is not supported: in"  # type: ignore[attr-defined]
                " on_before_optimizer_step each rank holds only its chunk of every gradient"
            )
        lm = self.lightning_module  # type: ignore[attr-defined]
        assert lm is not None
        mine: dict[str, float] = {}
        if self.coordinate[DP] == 0 and self.coordinate[SP] == 0:  # type: ignore[attr-defined]
            # replicas and sp ranks hold the same gradients
            for name, p in lm.named_parameters():
                if p.grad is None or not self._counts_in_norm(p):
                    continue
                g = local(p.grad).detach().double()
                mine[name] = (
                    float(g.abs().max()) if norm_type == float("inf") else float(g.norm(norm_type) ** norm_type)
                )
        merged: dict[str, float] = {}
        for part in _collectives.all_gather_object(mine):
            for name, value in part.items():
                merged[name] = (
                    max(merged.get(name, 0.0), value) if norm_type == float("inf") else merged.get(name, 0.0) + value
                )
        order = [n for n, _ in lm.named_parameters() if n in merged]
        root = (lambda v: v) if norm_type == float("inf") else (lambda v: v ** (1.0 / norm_type))  # noqa: E731
        norms = {
            f"grad_{norm_type}_norm{group_separator}{n}": torch.tensor(root(merged[n]), dtype=torch.float64)
            for n in order
        }
        if norms:
            total = max(merged.values()) if norm_type == float("inf") else sum(merged.values()) ** (1.0 / norm_type)
            norms[f"grad_{norm_type}_norm_total"] = torch.tensor(total, dtype=torch.float64)
        return norms
