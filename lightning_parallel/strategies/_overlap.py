"""Data parallelism's gradient average overlapped with the backward, as DDP's buckets do (Li et al., "PyTorch
Distributed: Experiences on Accelerating Data Parallel Training", VLDB 2020, arXiv 2006.15704, §3.2.3).

The parameters are cut into buckets of at most ``bucket_cap_mb`` in reverse registration order (the order a
backward usually reaches them), one dtype per bucket. Before the backward (:meth:`GradientBuckets.prepare`)
the loss's graph is walked, and the parameters it does not reach (an expert no token of this replica chose)
count as ready at once, with zeros (or what earlier accumulation steps left), as DDP's
``find_unused_parameters``: so every bucket completes on every rank. A hook after each gradient's accumulation
(``register_post_accumulate_grad_hook``) counts its bucket's ready gradients; a complete bucket is flattened and
its all-reduce (sum) issued asynchronously, **strictly in bucket order** (bucket k only after 0..k-1), so every
rank issues the same collectives in the same order whatever order its backward took. On CUDA the all-reduce
runs on NCCL's own stream while the backward goes on. At the optimizer step (:meth:`GradientBuckets.finish`)
every all-reduce is waited for and the sums divided by the group's size are copied back: the same arithmetic,
element by element, as one all-reduce after the backward. Which parameters any replica reached is agreed then
(one small all-reduce); the others get back ``None``, as on one device.

A parameter the walk missed that gets a gradient all the same (a reentrant checkpoint hides its region's
parameters from the forward graph) spoils the step: its bucket went with zeros. Every rank learns it at the
agreement, and the step's gradients are then averaged again in one all-reduce after the backward, as with
``bucket_cap_mb=0``, from then on (said once). Hooks issue nothing during gradient accumulation
(:attr:`GradientBuckets.accumulating`), as DDP's ``no_sync``.

Under tensor and sequence parallelism and pipelines the same buckets take the dp mean first; the layouts' sums
follow at the optimizer step (they commute with the mean). A pipeline stage's parameters are cut into units (a
model chunk; a param chunk under helix): the runtime opens a unit for its last weight-gradient action of the
step (:meth:`GradientBuckets.open`) and closes it after (:meth:`GradientBuckets.close`: what its hooks did not
issue goes then, in order). docs/design.md, "Buckets during the backward".
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
from torch._utils import _unflatten_dense_tensors

from lightning_parallel import _collectives
from lightning_parallel.tensor_parallel import local

DEFAULT_BUCKET_CAP_MB = 25.0  # DDP's default


class GradientBuckets:
    """The buckets of ``units`` (lists of parameters) over ``group``. Plain data parallelism has one unit, opened
    for the whole backward by :meth:`prepare`; a pipeline stage has one per model chunk, opened by the runtime for
    the chunk's last backward action (:meth:`open`) and closed after it (:meth:`close`). :meth:`finish` at the
    optimizer step."""

    def __init__(
        self,
        units: list[list[nn.Parameter]],
        group: Any,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        keys: list[int] | None = None,
    ) -> None:
        self.group, self.size = group, dist.get_world_size(group)
        self.keys = keys if keys is not None else list(range(len(units)))  # what open/close name each unit by
        self._index = {key: u for u, key in enumerate(self.keys)}
        self.units = [[p for p in unit if p.requires_grad] for unit in units]
        self.params = [p for unit in self.units for p in unit]
        self.buckets: list[list[nn.Parameter]] = []
        self.unit_buckets: list[list[int]] = []  # per unit, its buckets in issue order
        cap = bucket_cap_mb * 2**20
        for unit in self.units:
            mine: list[int] = []
            current: list[nn.Parameter] = []
            nbytes = 0.0
            for p in reversed(unit):
                if current and (nbytes + p.numel() * p.element_size() > cap or p.dtype != current[0].dtype):
                    mine.append(len(self.buckets))
                    self.buckets.append(current)
                    current, nbytes = [], 0.0
                current.append(p)
                nbytes += p.numel() * p.element_size()
            if current:
                mine.append(len(self.buckets))
                self.buckets.append(current)
            self.unit_buckets.append(mine)
        self.bucket_of = {id(p): b for b, bucket in enumerate(self.buckets) for p in bucket}
        self.unit_of = {id(p): u for u, unit in enumerate(self.units) for p in unit}
        self.accumulating = False
        self.enabled = True  # off for good once a step was spoiled
        self.comm_seconds = 0.0  # wall time the steps' finish waited for the all-reduces (what was not hidden)
        self.issued_in_backward = 0  # buckets issued by the hooks, during a backward (counted over the run)
        self._handles = [p.register_post_accumulate_grad_hook(self._ready) for p in self.params]
        self.zeroed: set[int] = set()  # ids of the parameters this rank lent zeros to a bucket, this step
        self._clear()

    def covers(self, units: list[list[nn.Parameter]], keys: list[int] | None = None) -> bool:
        """Whether these buckets are exactly ``units``' trainable parameters (parameters replaced since: rebuild)."""
        mine = [[id(p) for p in unit] for unit in self.units]
        return mine == [[id(p) for p in unit if p.requires_grad] for unit in units] and (
            keys is None or keys == self.keys
        )

    def remove(self) -> None:
        """Take the hooks off (the parameters were replaced); all-reduces a step issued and nobody waited for are
        waited for (their results are not used)."""
        for handle in self._handles:
            handle.remove()
        self._clear()

    def _clear(self) -> None:
        for work, *_ in getattr(self, "issued", ()):  # a step that issued buckets and never reached its sync
            work.wait()
        self.prepared = False
        self.spoiled = False
        self.waiting = [len(bucket) for bucket in self.buckets]
        self.done: set[int] = set()  # ids of the parameters counted ready this step
        self.next = [0] * len(self.units)  # per unit, the index of its next bucket to issue
        self.open_units: set[int] | None = None  # None: every unit open (plain data parallelism)
        self.closed: set[int] = set()
        self.issued: list[tuple[Any, Tensor, list[Tensor], list[nn.Parameter]]] = []  # (work, flat, grads, params)

    def prepare(self, loss: Tensor) -> None:
        """Before the step's last backward: the parameters ``loss``'s graph does not reach are ready now."""
        self._clear()
        if not self.enabled or self.accumulating:
            return
        self.prepared = True
        reached = _reached_parameters(loss)
        for p in self.params:
            if id(p) not in reached:
                self._count(p)

    def start(self) -> bool:
        """Before a pipeline step's schedule: units wait for :meth:`open`. Returns whether buckets serve this step."""
        self._clear()
        if not self.enabled or self.accumulating:
            return False
        self.prepared, self.open_units = True, set()
        return True

    def open(self, key: int) -> None:
        """Unit ``key``'s last backward action of the step starts: its gradients are final as they accumulate."""
        if self.prepared and self.open_units is not None and key in self._index:
            self.open_units.add(self._index[key])

    def close(self, key: int) -> None:
        """That action is over: issue the unit's remaining buckets in order (a parameter it did not reach: zeros)."""
        if not self.prepared or self.open_units is None or key not in self._index:
            return
        unit = self._index[key]
        self.open_units.discard(unit)
        self.closed.add(unit)
        while self.next[unit] < len(self.unit_buckets[unit]):
            self._issue(self.unit_buckets[unit][self.next[unit]])

    def _ready(self, p: Tensor) -> None:
        if not self.prepared or self.accumulating:
            return
        unit = self.unit_of[id(p)]
        if self.open_units is not None and unit not in self.open_units:
            if unit in self.closed:  # a gradient after its unit's last action: its bucket went without it
                self.spoiled = True
            return  # an earlier micro-batch's part: the gradient is not final yet
        if id(p) in self.done:  # its bucket already went (with zeros): this step is averaged again
            self.spoiled = True
            self.zeroed.discard(id(p))  # its gradient is real now (accumulated into the zeros)
            return
        self._count(p)

    def _count(self, p: Tensor) -> None:
        self.done.add(id(p))
        self.waiting[self.bucket_of[id(p)]] -= 1
        unit = self.unit_of[id(p)]
        order = self.unit_buckets[unit]
        while self.next[unit] < len(order) and self.waiting[order[self.next[unit]]] == 0:
            self._issue(order[self.next[unit]])

    def _issue(self, b: int, during: bool = True) -> None:
        for p in self.buckets[b]:
            if p.grad is None:  # not reached on this replica: it adds zeros to the others' sum
                p.grad = torch.zeros_like(p)
                self.zeroed.add(id(p))
            self.done.add(id(p))
        grads = [local(p.grad) for p in self.buckets[b]]
        flat = torch.cat([g.reshape(-1) for g in grads])  # a copy (flattening one tensor would give a view of it)
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        self.issued.append((work, flat, grads, self.buckets[b]))
        self.next[self.unit_of[id(self.buckets[b][0])]] += 1
        self.issued_in_backward += during

    def finish(self) -> bool:
        """Wait for the step's buckets and put each gradient's mean in place; parameters no replica reached get
        ``None`` back. Returns ``False`` when nothing was averaged (no prepared backward ran, or it was spoiled:
        the gradients are as the backward left them, to be averaged after it)."""
        if not self.prepared:  # no prepared backward ran: no rank issued a bucket
            self._clear()
            return False
        for unit, order in enumerate(self.unit_buckets):  # what never came: zeros, in order (unopened units last)
            while self.next[unit] < len(order):
                self._issue(order[self.next[unit]], during=False)
        t0 = time.perf_counter()
        for work, *_ in self.issued:
            work.wait()
        waited = time.perf_counter() - t0
        if self.open_units is not None and not self._kept():
            self.spoiled = True
        self.comm_seconds += waited
        _collectives.comm_seconds += waited
        used = [id(p) not in self.zeroed for p in self.params]
        agreed = _collectives.any_over_group([*used, self.spoiled], self.group)
        if agreed[-1]:  # a parameter got its gradient after its bucket went: average the real gradients again
            self._drop_zeroed()
            self.enabled = False
            rank_zero_warn(
                "a parameter received its gradient after its bucket was averaged (a reentrant checkpoint,"
                " `use_reentrant=True`, hides its region's parameters from the forward graph; or a pipeline chunk's"
                " parameter was used by a later action): the gradients are averaged after the backward from now on,"
                " as with bucket_cap_mb=0"
            )
            self._clear()
            return False
        for _, flat, grads, _ in self.issued:
            flat.div_(self.size)
            for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                g.copy_(reduced)
        for p, anyone in zip(self.params, agreed):
            if not anyone:
                p.grad = None  # no replica reached it: as one device leaves it
        self.zeroed = set()
        self._clear()
        return True

    def _kept(self) -> bool:
        """Whether every bucket's gradients are still the tensors it read. A pipeline's weight-gradient action
        (``W``) accumulates without autograd's hooks, into a new tensor: one that ran after its unit closed shows
        here, not in :meth:`_ready`."""
        for _, _, grads, params in self.issued:
            if any(p.grad is None or local(p.grad).data_ptr() != g.data_ptr() for p, g in zip(params, grads)):
                return False
        return True

    def _drop_zeroed(self) -> None:
        """The zeros this rank lent to buckets are not gradients: back to ``None``."""
        for p in self.params:
            if id(p) in self.zeroed:
                p.grad = None
        self.zeroed = set()


def _reached_parameters(loss: Tensor) -> set[int]:
    """Ids of the leaf tensors ``loss``'s autograd graph accumulates into (its ``AccumulateGrad`` nodes)."""
    reached: set[int] = set()
    seen: set[Any] = set()
    stack = [loss.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        variable = getattr(fn, "variable", None)
        if variable is not None:
            reached.add(id(variable))
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return reached


def overlappable(strategy: Any) -> bool:
    """Data parallelism with replicated gradients under automatic optimization: not sharded (ZeRO
    reduce-scatters, FSDP2 overlaps its own). Tensor-, sequence- and pipeline-parallel sums of the same gradients
    come after the dp mean (sums and the mean commute); a pipeline's buckets go in its chunks' last backward
    actions, and only when a step is its window's only batch (``accumulate_grad_batches=1``: the schedule's
    gradients are added to the earlier batches' after the backward,
    :func:`lightning_parallel.strategies.gradients.add_`). Under expert parallelism the experts are in no bucket
    (their gradients are averaged over the ranks holding the same experts, after the backward)."""
    dims = strategy.parallel_dims
    lm = strategy.lightning_module
    return (
        strategy._dp.bucket_cap_mb > 0
        and dims.dp > 1
        and strategy._dp.mode == "none"
        and lm is not None
        and lm.automatic_optimization
    )


__all__ = ["DEFAULT_BUCKET_CAP_MB", "GradientBuckets", "overlappable"]
