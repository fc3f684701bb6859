"""Data parallelism's gradient average overlapped with the backward, as DDP's buckets do (Li et al., "PyTorch
Distributed: Experiences on Accelerating Data Parallel Training", VLDB 2020, arXiv 2006.15704, §3.2.3).

The parameters are cut into buckets of at most ``bucket_cap_mb`` in reverse registration order (the order a
backward usually reaches them), one dtype per bucket. A hook after each gradient's accumulation
(``register_post_accumulate_grad_hook``) counts the bucket's ready gradients; a bucket whose gradients are all
ready is flattened and its all-reduce (sum) issued asynchronously, **strictly in bucket order**: bucket k goes
only after buckets 0..k-1, so every rank issues the same collectives in the same order whatever order its
backward took (a data-dependent graph included), as NCCL and gloo both require. On CUDA the all-reduce runs on
NCCL's own stream, after the gradients' producers, while the backward goes on. At the optimizer step
(:meth:`GradientBuckets.finish`) the buckets the backward did not complete (a parameter it never reached) are
issued in order, every all-reduce is waited for, and the sums divided by the group's size are copied back: the
same arithmetic, element by element, as one all-reduce of every gradient after the backward.

Hooks launch nothing during gradient accumulation (:attr:`GradientBuckets.accumulating`), as DDP's ``no_sync``.
"""

from __future__ import annotations

import time
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from lightning_parallel import _collectives

DEFAULT_BUCKET_CAP_MB = 25.0  # DDP's default


class GradientBuckets:
    """The buckets of ``params`` over ``group``; :meth:`finish` completes a step's average."""

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
        self.comm_seconds = 0.0  # wall time the step's finish waited for the all-reduces (what was not hidden)
        self.issued_in_backward = 0  # buckets issued by the hooks, during a backward (counted over the run)
        self._handles = [p.register_post_accumulate_grad_hook(self._ready) for p in self.params]
        self._reset()

    def covers(self, params: list[nn.Parameter]) -> bool:
        """Whether these buckets are exactly the trainable ``params`` (parameters replaced since: rebuild)."""
        return [id(p) for p in self.params] == [id(p) for p in params if p.requires_grad]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _reset(self) -> None:
        self.waiting = [len(bucket) for bucket in self.buckets]
        self.next = 0  # the next bucket to issue
        self.issued: list[tuple[Any, Tensor, list[Tensor]]] = []

    def _ready(self, p: Tensor) -> None:
        if self.accumulating:
            return
        self.waiting[self.bucket_of[id(p)]] -= 1
        while self.next < len(self.buckets) and self.waiting[self.next] == 0:
            self._issue(self.next)
            self.issued_in_backward += 1

    def _issue(self, b: int) -> None:
        grads = [_local(p.grad) for p in self.buckets[b] if p.grad is not None]
        self.next = b + 1
        if not grads:
            return
        flat = _flatten_dense_tensors(grads)
        self.issued.append((dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True), flat, grads))

    def finish(self) -> None:
        """Issue what the backward left (in bucket order), wait, and put each gradient's mean in place."""
        while self.next < len(self.buckets):
            self._issue(self.next)
        t0 = time.perf_counter()
        for work, flat, grads in self.issued:
            work.wait()
            flat.div_(self.size)
            for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                g.copy_(reduced)
        waited = time.perf_counter() - t0
        self.comm_seconds += waited
        _collectives.comm_seconds += waited
        self._reset()


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def overlappable(strategy: Any) -> bool:
    """Plain data parallelism: no pipeline (its runtime runs the backward), no tensor or sequence parallelism (their
    partial sums come first), no sharding (ZeRO reduce-scatters, FSDP2 overlaps its own)."""
    dims = strategy.parallel_dims
    return (
        strategy._bucket_cap_mb > 0
        and dims.dp > 1
        and dims.pp == 1
        and dims.tp == 1
        and dims.sp == 1
        and strategy._dp_sharding == "none"
    )


__all__ = ["DEFAULT_BUCKET_CAP_MB", "GradientBuckets", "overlappable"]
