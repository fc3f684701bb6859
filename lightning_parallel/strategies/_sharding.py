"""Sharded data parallelism: optimizer state and reduced gradients split over the dp axis, element by
element (ZeRO stages 1 and 2 of Rajbhandari et al., 2020, "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models").

``data_parallel_sharding="optimizer"``. Every parameter ``p`` (its local tensor, under tensor parallelism
its shard) is cut, flattened, into ``dp`` chunks of ``ceil(numel / dp)`` elements (the last ones shorter
or empty); dp rank ``r`` owns chunk ``r`` of every parameter. The optimizer keeps the user's parameters
in its groups outside the step window, so what names, replaces, drops or checkpoints parameters works
unchanged; its state tensors hold only this rank's chunk (1-D). Per optimizer step:

1. after the backward and the tensor-, sequence- and pipeline-parallel gradient algebra, one
   reduce-scatter per dtype leaves on each rank the dp mean of its chunks' gradients; the parameters'
   full gradients are dropped;
2. the step window (:meth:`ShardedOptimizer.window`) opens: the optimizer's groups hold chunk views of
   the parameters (``nn.Parameter`` aliasing each parameter's own storage) with the reduced gradients,
   and its state is keyed by them. Gradient clipping (by norm: the dp group joins the norm's groups;
   by value) and the optimizer's update run on the chunks, in place in the parameters' storage;
3. the window closes (groups and state keyed by the parameters again) and one all-gather per dtype
   gives every rank every chunk.

Only element-wise optimizers give the same result on chunks as on the whole tensor; others are refused
(:func:`check_optimizer`). Per rank: optimizer state and, after step 1, gradients are 1/dp of a
replica's; parameters stay whole. Checkpoints hold whole optimizer state by parameter name: each rank
writes its chunks into the whole tensors on disk (:meth:`ShardedOptimizer.checkpoint_state`,
:mod:`lightning_parallel.flat_chunks`: no gather), and a restore's whole state is cut again when the first
step after it opens its window, so a checkpoint moves between every layout. 0-dim parameters are not cut: their
gradients are averaged whole and every rank steps them.

Expert parallelism's experts are cut over their own axis (``experts(p)``: the ranks holding the same experts, the
``dp·sp/ep`` replicas of an ep group), not over dp: each rank of an ep group holds other experts (1/ep of them),
their gradients are reduced over those ranks before (:func:`~lightning_parallel.strategies.gradients.sync_`, whole),
the window cuts each to this rank's chunk, and the all-gather after the update runs over that axis. So an expert's
optimizer state is ``1 / (ep · replicas)`` of one process's (ZeRO-1 of the experts over their replicas, as
torchtitan's and Megatron-Core's expert data parallelism shard it).

Inside the window the model's parameters have no ``.grad`` (the optimizer's chunk views in
``optimizer.param_groups`` hold the reduced gradients): a hook that reads ``pl_module.parameters()``
gradients in ``on_before_optimizer_step`` sees none.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.optim import Optimizer

from lightning_parallel import _collectives
from lightning_parallel.flat_chunks import FlatChunk
from lightning_parallel.tensor_parallel import local

Sharding = Literal["none", "optimizer", "full"]
SHARDINGS: tuple[str, ...] = ("none", "optimizer", "full")

#: torch optimizers whose update of an element depends on that element's parameter, gradient and state only
ELEMENTWISE = tuple(
    getattr(torch.optim, name)
    for name in ("SGD", "Adam", "AdamW", "Adamax", "Adagrad", "Adadelta", "RMSprop", "Rprop", "NAdam", "RAdam", "ASGD")
)


def check_sharding(value: str) -> None:
    if value not in SHARDINGS:
        raise ValueError(
            f"data_parallel_sharding={value!r}; choose one of {SHARDINGS} ('optimizer': optimizer state and"
            " reduced gradients split over the data-parallel ranks; 'full': parameters too)"
        )


def check_optimizer(optimizer: Optimizer, mode: str = "optimizer") -> None:
    inner = getattr(optimizer, "optimizer", optimizer)  # Lightning's LightningOptimizer wraps it
    if not isinstance(inner, ELEMENTWISE):
        raise ValueError(
            f"data_parallel_sharding={mode!r} updates each data-parallel rank's chunk of every parameter on its"
            f" own, which gives the optimizer's result only for element-wise optimizers"
            f" ({', '.join(c.__name__ for c in ELEMENTWISE)}); {type(inner).__name__} is not one of them: use"
            " data_parallel_sharding='none'"
        )


@dataclass(frozen=True)
class Axis:
    """The ranks a parameter's chunks are spread over: this rank is ``rank`` of ``size`` in ``group``."""

    group: Any
    rank: int
    size: int


class ShardedOptimizer:
    """One optimizer's chunks on one dp rank (``rank`` of ``size`` in ``group``; an expert's on its own axis,
    ``experts(p)``: module docstring)."""

    def __init__(self, optimizer: Optimizer, group: Any, rank: int, size: int,
                 experts: Callable[[Tensor], Axis | None] = lambda p: None) -> None:  # fmt: skip
        self.optimizer, self.group, self.rank, self.size = optimizer, group, rank, size
        self.dp = Axis(group, rank, size)
        self.experts = experts
        self._originals: dict[int, nn.Parameter] = {}  # id(chunk view) -> its parameter, while the window is open
        self._cut: set[int] = set()  # ids of the parameters whose optimizer state holds chunks

    # ---------------------------------------------------------------------------------- layout
    def params(self) -> list[nn.Parameter]:
        """The optimizer's parameters, each once, in order."""
        return list({id(p): p for group in self.optimizer.param_groups for p in group["params"]}.values())

    def axis(self, p: Tensor) -> Axis:
        """The ranks ``p``'s chunks are spread over: dp, or an expert's replicas."""
        return self.experts(p) or self.dp

    def _chunk(self, p: Tensor) -> int:
        return math.ceil(local(p).numel() / self.axis(p).size)

    def _bounds(self, p: Tensor) -> tuple[int, int]:
        """This rank's chunk of ``p``'s flattened local tensor."""
        n, c, rank = local(p).numel(), self._chunk(p), self.axis(p).rank
        return min(rank * c, n), min((rank + 1) * c, n)

    def cut(self, p: Tensor, whole: Tensor) -> Tensor:
        """This rank's chunk of ``whole`` (shaped like ``p``'s local tensor)."""
        start, end = self._bounds(p)
        return local(whole).reshape(-1)[start:end]

    # -------------------------------------------------------------------------------- gradients
    def reduce_scatter_gradients_(self) -> dict[int, Tensor]:
        """Step 1: ``id(parameter) -> the dp mean of this rank's chunk of its gradient``; drops the full ones.
        Which parameters have a gradient is agreed over the group first (one missing on a rank counts as
        zeros there), so every rank reduces the same tensors. A 0-dim parameter stays whole: its gradient
        is averaged in place and every rank steps it."""
        reduced: dict[int, Tensor] = {}
        params = [p for p in self.params() if self.experts(p) is None]  # (the experts': reduced already, whole)
        has = [p.grad is not None for p in params]
        agreed = _collectives.any_over_group(has, self.group) if self.size > 1 else has
        for p, mine, anyone in zip(params, has, agreed):
            if anyone and not mine:
                p.grad = torch.zeros_like(p)
        scalars = [local(p.grad) for p, anyone in zip(params, agreed) if anyone and local(p).dim() == 0]
        if scalars and self.size > 1:
            _collectives.all_reduce_mean_(scalars, self.group)
        with_grad = [p for p, anyone in zip(params, agreed) if anyone and local(p).dim() > 0]
        for same in _collectives.by_dtype(with_grad, lambda p: p.grad.dtype).values():
            chunks = [self._chunk(p) for p in same]
            rows = [_padded(local(p.grad), self.size * c).view(self.size, c) for p, c in zip(same, chunks)]
            out = _collectives.reduce_scatter_sum(torch.cat(rows, dim=1).reshape(-1), self.group)
            out.div_(self.size)
            offset = 0
            for p, c in zip(same, chunks):
                start, end = self._bounds(p)
                reduced[id(p)] = out[offset : offset + end - start]
                offset += c
                p.grad = None
        return reduced

    # ---------------------------------------------------------------------------------- window
    def _cut_whole_state(self) -> None:
        """State restored from a checkpoint (or created whole by an optimizer's ``__init__``, like Adagrad's
        sums) is cut to this rank's chunk once, when a step first opens the window for its parameter; from
        then on the optimizer creates and keeps chunks only."""
        for p in self._sharded():
            if id(p) in self._cut:
                continue
            state = self.optimizer.state.get(p)
            for k, v in list((state or {}).items()):
                if torch.is_tensor(v) and v.dim() >= 1 and tuple(local(v).shape) == tuple(local(p).shape):
                    state[k] = self.cut(p, v).clone()
            self._cut.add(id(p))

    def _sharded(self) -> list[nn.Parameter]:
        return [p for p in self.params() if local(p).dim() > 0]

    @property
    def open(self) -> bool:
        return bool(self._originals)

    def is_whole(self, p: Tensor) -> bool:
        """A 0-dim parameter of this optimizer: not cut, the same gradient on every dp rank."""
        return local(p).dim() == 0 and self.experts(p) is None and any(p is q for q in self.params())

    @contextmanager
    def window(self, reduced: dict[int, Tensor]) -> Iterator[None]:
        """Steps 2 and 3: the optimizer works on chunk views of the parameters; then every rank gets every
        chunk (not after an exception: groups and state are put back, nothing is exchanged)."""
        opt = self.optimizer
        saved_groups = [g["params"] for g in opt.param_groups]
        views: dict[int, nn.Parameter] = {}
        copied: list[nn.Parameter] = []  # a non-contiguous parameter's chunk is a copy, written back below
        done = False
        try:
            self._cut_whole_state()
            for p in self._sharded():
                start, end = self._bounds(p)
                data = local(p.data)
                chunk = data.view(-1)[start:end] if data.is_contiguous() else data.reshape(-1)[start:end].clone()
                views[id(p)] = nn.Parameter(chunk)
                views[id(p)].grad = reduced.get(id(p))
                if self.experts(p) is not None and p.grad is not None:  # reduced whole: this rank's chunk of it
                    views[id(p)].grad, p.grad = self.cut(p, p.grad).clone(), None
                if not data.is_contiguous():
                    copied.append(p)
            self._originals = {id(v): p for p in self._sharded() for v in [views[id(p)]]}
            for g in opt.param_groups:
                g["params"] = [views.get(id(q), q) for q in g["params"]]
            for p in list(opt.state):
                if id(p) in views:
                    opt.state[views[id(p)]] = opt.state.pop(p)
            yield
            done = True
        finally:
            for v in list(opt.state):
                if id(v) in self._originals:
                    opt.state[self._originals[id(v)]] = opt.state.pop(v)
            for g, saved in zip(opt.param_groups, saved_groups):
                g["params"] = saved
            self._originals = {}
        with torch.no_grad():
            for p in copied:
                start, end = self._bounds(p)
                flat = local(p.data).reshape(-1).clone()
                flat[start:end] = views[id(p)].data
                local(p.data).copy_(flat.view_as(local(p.data)))
        if done:
            self.all_gather_parameters_()

    def original(self, p: Tensor) -> Tensor:
        """The parameter a chunk view (inside the window) belongs to; anything else unchanged."""
        return self._originals.get(id(p), p)

    def all_gather_parameters_(self) -> None:
        by_axis: dict[Axis, list[nn.Parameter]] = {}
        for p in self._sharded():
            by_axis.setdefault(self.axis(p), []).append(p)
        for axis, params in by_axis.items():
            if axis.size > 1:
                self._all_gather(params, axis)

    def _all_gather(self, params: list[nn.Parameter], axis: Axis) -> None:
        for same in _collectives.by_dtype(params).values():
            chunks = [self._chunk(p) for p in same]
            mine = torch.cat([_padded(self.cut(p, p.data), c) for p, c in zip(same, chunks)])
            rows, offset = _collectives.all_gather_flat(mine, axis.group).view(axis.size, -1), 0
            with torch.no_grad():
                for p, c in zip(same, chunks):
                    data = local(p.data)
                    data.copy_(rows[:, offset : offset + c].reshape(-1)[: data.numel()].view_as(data))
                    offset += c

    # ----------------------------------------------------------------------------------- state
    def checkpoint_state(self, gather: Callable[[Tensor], bool] = lambda p: False) -> dict[Tensor, dict[str, Any]]:
        """The optimizer's state for a checkpoint, with no gather: a per-element tensor cut to this rank's chunk
        becomes a :class:`~lightning_parallel.flat_chunks.FlatChunk`, whose elements this rank writes into the
        whole tensor on disk (DCP), so no rank ever holds more than its chunks. A parameter for which
        ``gather(p)`` holds (a tensor-parallel projection whose rows the checkpoint keeps in another order) has
        its state gathered over the dp group instead, one tensor at a time. State not cut yet (restored, no step
        since) is whole already. A small collective checks that the ranks hold the same state; nothing in the
        optimizer changes."""
        out = {p: dict(self.optimizer.state[p]) for p in self.params() if p in self.optimizer.state}
        sharded = [p for p in self._sharded() if id(p) in self._cut and p in self.optimizer.state]
        per = [sorted(k for k, v in out[p].items() if torch.is_tensor(v) and v.dim() >= 1) for p in sharded]
        agreed = _collectives.all_gather_object(per, self.group) if self.size > 1 else [per]
        if any(a != per for a in agreed):
            raise RuntimeError("the data-parallel ranks hold different optimizer state for the same parameters")
        for p, names in zip(sharded, per):
            for k in names:
                if p.numel() == 0:  # no element to write a chunk of: DCP needs the (empty) tensor itself
                    out[p][k] = torch.zeros_like(p.detach())
                else:
                    out[p][k] = self._gather(p, out[p][k]) if gather(p) else self._flat_chunk(p, out[p][k])
        return out

    def _flat_chunk(self, p: Tensor, chunk: Tensor) -> FlatChunk:
        offset = (0,) * p.dim()
        if isinstance(p, DTensor):
            _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        start, _ = self._bounds(p)
        return FlatChunk(chunk, start, tuple(local(p).shape), tuple(offset), tuple(p.shape))

    def _gather(self, p: Tensor, chunk: Tensor) -> Tensor:
        out = _collectives.all_gather_flat(_padded(chunk, self._chunk(p)), self.axis(p).group)
        shaped = out[: local(p).numel()].view_as(local(p))
        if isinstance(p, DTensor):
            return DTensor.from_local(
                shaped, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
            )
        return shaped


def _padded(t: Tensor, n: int) -> Tensor:
    flat = t.reshape(-1)
    return flat if flat.numel() == n else torch.cat([flat, flat.new_zeros(n - flat.numel())])
