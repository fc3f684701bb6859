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
    """The buckets of ``params`` over ``group``: :meth:`prepare` before a step's last backward, :meth:`finish`
    at its optimizer step."""

    def __init__(self, params: list[nn.Parameter], group: Any, bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB) -> None:
        self.group, self.size = group, dist.get_world_size(group)
        self.params = [p for p in params if p.requires_grad]
        self.buckets: list[list[nn.Parameter]] = []
        cap, current, nbytes = bucket_cap_mb * 2**20, [], 0.0
        for p in reversed(self.params):
            if current and (nbytes + p.numel() * p.element_size() > cap or p.dtype != current[0].dtype):
                self.buckets.append(current)
                current, nbytes = [], 0.0
            current.append(p)
            nbytes += p.numel() * p.element_size()
        if current:
            self.buckets.append(current)
        self.bucket_of = {id(p): b for b, bucket in enumerate(self.buckets) for p in bucket}
        self.accumulating = False
        self.enabled = True  # off for good once a step was spoiled
        self.comm_seconds = 0.0  # wall time the steps' finish waited for the all-reduces (what was not hidden)
        self.issued_in_backward = 0  # buckets issued by the hooks, during a backward (counted over the run)
        self._handles = [p.register_post_accumulate_grad_hook(self._ready) for p in self.params]
        self.zeroed: set[int] = set()  # ids of the parameters this rank lent zeros to a bucket, this step
        self._clear()

    def covers(self, params: list[nn.Parameter]) -> bool:
        """Whether these buckets are exactly the trainable ``params`` (parameters replaced since: rebuild)."""
        return [id(p) for p in self.params] == [id(p) for p in params if p.requires_grad]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _clear(self) -> None:
        self.prepared = False
        self.spoiled = False
        self.waiting = [len(bucket) for bucket in self.buckets]
        self.done: set[int] = set()  # ids of the parameters counted ready this step
        self.next = 0  # the next bucket to issue
        self.issued: list[tuple[Any, Tensor, list[Tensor]]] = []

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

    def _ready(self, p: Tensor) -> None:
        if not self.prepared or self.accumulating:
            return
        if id(p) in self.done:  # its bucket already went (with zeros): this step is averaged again
            self.spoiled = True
            self.zeroed.discard(id(p))  # its gradient is real now (accumulated into the zeros)
            return
        self._count(p)

    def _count(self, p: Tensor) -> None:
        self.done.add(id(p))
        self.waiting[self.bucket_of[id(p)]] -= 1
        while self.next < len(self.buckets) and self.waiting[self.next] == 0:
            self._issue(self.next)

    def _issue(self, b: int) -> None:
        for p in self.buckets[b]:
            if p.grad is None:  # not reached on this replica: it adds zeros to the others' sum
                p.grad = torch.zeros_like(p)
                self.zeroed.add(id(p))
        grads = [local(p.grad) for p in self.buckets[b]]
        flat = torch.cat([g.reshape(-1) for g in grads])  # a copy (flattening one tensor would give a view of it)
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        self.issued.append((work, flat, grads))
        self.next = b + 1
        if self.prepared:
            self.issued_in_backward += 1

    def finish(self, fallback: Any) -> None:
        """Wait for the step's buckets and put each gradient's mean in place; parameters no replica reached get
        ``None`` back. Without a prepared backward, or after a spoiled one, ``fallback()`` averages instead."""
        if not self.prepared:  # no prepared backward ran: no rank issued a bucket
            self._clear()
            fallback()
            return
        while self.next < len(self.buckets):  # a reached parameter whose gradient never came: zeros, in order
            self._issue(self.next)
        t0 = time.perf_counter()
        for work, _, _ in self.issued:
            work.wait()
        waited = time.perf_counter() - t0
        self.comm_seconds += waited
        _collectives.comm_seconds += waited
        used = [id(p) not in self.zeroed for p in self.params]
        agreed = _collectives.any_over_group([*used, self.spoiled], self.group)
        if agreed[-1]:  # a parameter got its gradient after its bucket went: average the real gradients again
            self._drop_zeroed()
            self.enabled = False
            rank_zero_warn(
                "a parameter received its gradient after the forward graph said it would not (a reentrant"
                " checkpoint, `use_reentrant=True`, hides its region's parameters): the gradients are averaged"
                " after the backward from now on, as with bucket_cap_mb=0"
            )
            self._clear()
            fallback()
            return
        for _, flat, grads in self.issued:
            flat.div_(self.size)
            for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                g.copy_(reduced)
        for p, anyone in zip(self.params, agreed):
            if not anyone:
                p.grad = None  # no replica reached it: as one device leaves it
        self.zeroed = set()
        self._clear()

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
    """Plain data parallelism under automatic optimization: no pipeline (its runtime runs the backward), no tensor
    or sequence parallelism (their partial sums come first), no sharding (ZeRO reduce-scatters, FSDP2 overlaps its
    own)."""
    dims = strategy.parallel_dims
    lm = strategy.lightning_module
    return (
        strategy._bucket_cap_mb > 0
        and dims.dp > 1
        and dims.pp == 1
        and dims.tp == 1
        and dims.sp == 1
        and strategy._dp_sharding == "none"
        and lm is not None
        and lm.automatic_optimization
    )


__all__ = ["DEFAULT_BUCKET_CAP_MB", "GradientBuckets", "overlappable"]
