"""The gradient recipe of every strategy: one step's gradients made one device's, then clipped, in one place.

Each rank's backward leaves a *part* of the true gradient: a pipeline stage's part of a pre/post-trunk parameter
that several stages run (a tied embedding and head), a tensor-parallel rank's partial sum of a replicated
parameter that saw its heads only, a sequence-parallel rank's sum over its tokens only, a replica's mean over its
samples only. :func:`sync_` joins them in one order, pp -> tp -> sp -> dp; every sum commutes with the dp mean, so
the dp means the backward's buckets already issued (:mod:`lightning_parallel.strategies._overlap`) are finished
first and the rest follow (expert parallelism's experts: over the ranks holding the same experts instead of sp and
dp). :func:`clip_norm_` is ``torch.nn.utils.clip_grad_norm_`` over the whole model with each
element counted on exactly one rank (:func:`counts_in_norm`). A :class:`GradientPlan` built at set-up says which
groups this rank reduces over and how data parallelism holds the gradients (docs/design.md, "Gradients").

Also here: the pipeline runtime's gradient algebra around Lightning's loop (:func:`stash`, :func:`restore`,
:func:`add_`: Lightning zeroes gradients *after* ``training_step``, where the schedule has already run backward)
and :func:`norms`, the per-parameter norms behind the strategies' ``grad_norm()``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_parallel import _collectives
from lightning_parallel.blocks import Layouts
from lightning_parallel.expert_parallel import REPLICA_AXIS
from lightning_parallel.mesh import DP, PP, SP, TP, ParallelDims
from lightning_parallel.strategies._experts import ExpertLayout
from lightning_parallel.strategies._full_shard import is_fully_sharded
from lightning_parallel.strategies._overlap import GradientBuckets
from lightning_parallel.strategies._sharding import ShardedOptimizer
from lightning_parallel.strategies._stage_local import OuterShards
from lightning_parallel.tensor_parallel import is_sharded, local


@dataclass(frozen=True)
class GradientPlan:
    """What set-up knows about this rank's gradients. ``layouts``' lists of partial-gradient parameters follow the
    blocks' commits (a block deferred to its first call adds its parameters then)."""

    dims: ParallelDims
    coordinate: Mapping[str, int]
    groups: Mapping[str, Any]  # axis -> process group (None without a mesh)
    dp_mode: str  # "replicate" (every replica holds every gradient), "optimizer" (ZeRO-1/2) or "full" (FSDP2)
    layouts: Optional[Layouts]
    outer: Optional[OuterShards]  # the pipeline strategies' pre/post-trunk parameters
    experts: Optional[ExpertLayout] = None  # expert parallelism's sharded experts

    def expert_ids(self) -> frozenset[int]:
        return self._expert_ids

    @functools.cached_property
    def _expert_ids(self) -> frozenset[int]:
        return frozenset(id(p) for p in self.experts.params) if self.experts is not None else frozenset()

    @functools.cached_property
    def fsdp_experts(self) -> frozenset[int]:
        """The experts FSDP2 shards over the ranks holding them (its reduce-scatter reduces their gradients)."""
        params = self.experts.params if self.experts is not None else []
        return frozenset(
            id(p) for p in params if isinstance(p, DTensor) and REPLICA_AXIS in (p.device_mesh.mesh_dim_names or ())
        )

    def group(self, axis: str) -> Any:
        """The group of ``axis`` when it has more than one rank, else ``None``."""
        return self.groups.get(axis) if getattr(self.dims, axis) > 1 else None


@dataclass
class StepGradients:
    """This step's data-parallel state: the backward's buckets, the optimizer's ZeRO chunks, a token-mean
    factor the pipeline defers until after the buckets' means (:mod:`lightning_parallel.token_mean`)."""

    buckets: Optional[GradientBuckets] = None
    shards: Optional[ShardedOptimizer] = None
    scale: Optional[float] = None
    module: Optional[nn.Module] = None  # whose gradients ``scale`` multiplies


def sync_(optimizer: Optimizer, plan: GradientPlan, step: StepGradients) -> Optional[dict[int, Tensor]]:
    """This optimizer's gradients as one device's. Returns the reduced ZeRO chunks under ``dp_mode="optimizer"``
    (``id(parameter) -> chunk``), else ``None``."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    mine = {id(p) for p in params}
    overlapped = step.buckets is not None and step.buckets.finish()  # dp means issued during the backward
    if step.scale is not None and step.module is not None:  # token mean: this replica's share of all tokens
        for p in step.module.parameters():
            if p.grad is not None:
                local(p.grad).mul_(step.scale)
    _place_(params)  # a DTensor gradient at its parameter's placement: a partial sum (vocabulary) becomes the sum
    # 1. pp: a pre/post-trunk parameter's gradient is the sum of the parts of the stages that ran it
    if plan.outer is not None:
        plan.outer.reduce_shards()
        _sum_used_([p for p in plan.outer.whole() if id(p) in mine], plan.group(PP), mean=False)
    # 2. tp: a replicated block parameter read by this rank's heads only (or its sequence shard) holds a partial sum
    # 3. sp: a block parameter saw this rank's tokens only (an expert: its ep group's, below)
    experts = plan.expert_ids()
    for axis in (TP, SP):
        layout = getattr(plan.layouts, axis, None)
        if layout is not None and layout.partial:
            grads = [local(p.grad) for p in layout.partial if id(p) in mine and p.grad is not None
                     and (axis == TP or id(p) not in experts)]  # fmt: skip
            _collectives.all_reduce_sum_(grads, plan.group(axis))
    # 4. an expert's gradient sums its ep group's tokens (of replicas and sequence shards): the sum over the ranks
    # holding the same experts is every replica's, divided by dp their mean
    if experts:
        assert plan.experts is not None
        held = [p for p in params if id(p) in experts and id(p) not in plan.fsdp_experts]  # (FSDP2's: reduced)
        _sum_used_(held, plan.experts.replicas, mean=False)
        for p in held:
            if p.grad is not None:
                local(p.grad).div_(plan.experts.dp)
        params = [p for p in params if id(p) not in experts]
    # 5. dp: the mean over the replicas, as each data-parallel mode holds the gradients
    group = plan.group(DP)
    if group is None:
        return None
    if plan.dp_mode == "optimizer":  # reduce-scattered: each rank keeps the mean of its chunk
        assert step.shards is not None
        return step.shards.reduce_scatter_gradients_()
    if plan.dp_mode == "full":  # FSDP2 averaged its shards during the backward
        _sum_used_([p for p in params if not is_fully_sharded(p)], group, mean=True)
    else:
        done = step.buckets.bucket_of if overlapped and step.buckets is not None else {}
        _sum_used_([p for p in params if id(p) not in done], group, mean=True)
    return None


def counts_in_norm(plan: GradientPlan, p: nn.Parameter, shards: Iterable[ShardedOptimizer] = ()) -> bool:
    """Whether this rank counts ``p``'s gradient in the global norm, so that each element counts on one rank."""
    if plan.coordinate[DP] != 0 and plan.dims.dp > 1:
        # dp: inside a ZeRO window the norm sums over dp; a 0-dim parameter, whole on every rank, counts on dp rank 0
        if any(s.open and s.is_whole(p) for s in shards):
            return False
        # FSDP2's shards count on every dp rank, what it does not hold on dp rank 0
        if plan.dp_mode == "full" and not is_fully_sharded(p):
            return False
    # pp: a pre/post-trunk parameter counts on the first stage that holds it (its shards on every stage)
    if plan.outer is not None and plan.outer.counted_here(p) is False:
        return False
    # tp: a shard on every tp rank, a replicated parameter on tp rank 0
    return is_sharded(p) or plan.coordinate[TP] == 0


def clip_norm_(
    optimizer: Optimizer, max_norm: float, plan: GradientPlan, shards: Mapping[int, ShardedOptimizer]
) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over the whole model: scale every gradient by
    ``min(1, max_norm / (total + 1e-6))`` as torch does, ``total`` the 2-norm of the gradients this rank counts
    (:func:`counts_in_norm`) summed over tp, pp and, where each rank holds a chunk of every gradient (a ZeRO
    window, FSDP2), dp. Returns ``total``."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    experts = plan.expert_ids()  # every expert counts once, on its rank of the ep group (a chunk: of its replicas)
    expert = {id(p) for p in params if id(_original(p, shards.values())) in experts}
    counted = [local(p.grad) for p in params if id(p) not in expert
               and counts_in_norm(plan, _original(p, shards.values()), shards.values())]  # fmt: skip
    chunked = any(s.open for s in shards.values()) or plan.dp_mode == "full"
    groups = [g for g in (plan.group(TP), plan.group(PP), plan.group(DP) if chunked else None) if g is not None]
    norms = [torch.linalg.vector_norm(g, 2) for g in counted]
    if norms:
        squares = torch.linalg.vector_norm(torch.stack(norms), 2).pow(2)
    else:  # this rank counts nothing: a zero on the device its groups' collectives take
        squares = torch.zeros((), device=_collectives.comm_device(groups[0]) if groups else None)
    dtype = squares.dtype
    for group in groups:
        squares = _collectives.sum_of_squares(squares, group)
    if plan.experts is not None:
        # each rank's experts over the ep group; those in chunks (a ZeRO window's, FSDP2's) over their replicas first
        window = any(s.open for s in shards.values())
        mine = [p for p in params if id(p) in expert]
        cut = [window or id(_original(p, shards.values())) in plan.fsdp_experts for p in mine]
        in_chunks = _squares([p for p, c in zip(mine, cut) if c], squares)
        if (window or plan.fsdp_experts) and plan.experts.replica_count > 1:
            in_chunks = _collectives.sum_of_squares(in_chunks, plan.experts.replicas)
        whole = _squares([p for p, c in zip(mine, cut) if not c], squares)
        expert_squares = _collectives.sum_of_squares(in_chunks + whole, plan.experts.group)
        if plan.group(PP) is not None:  # each stage's experts (over tp they are whole: counted once)
            expert_squares = _collectives.sum_of_squares(expert_squares, plan.group(PP))
        squares = squares + expert_squares
    total = squares.sqrt().to(dtype)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        grad = local(p.grad)
        grad.mul_(coef.to(grad.dtype))
    return total


def clip_value_(optimizer: Optimizer, clip_val: float) -> None:
    """``torch.nn.utils.clip_grad_value_`` element by element on each rank's local gradients (torch's foreach
    version refuses a list mixing DTensors and plain tensors)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                local(p.grad).clamp_(min=-clip_val, max=clip_val)


def norms(
    plan: GradientPlan, module: nn.Module, norm_type: Union[float, str], group_separator: str
) -> dict[str, Tensor]:
    """Lightning's ``grad_norm(module, norm_type)`` for the whole model, the same dict on every rank: each
    parameter's gradient norm under its original name (shards combined, the other stages' parameters included,
    replicated ones counted once) and the total. A collective over the world."""
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"norm_type must be a positive number or 'inf', got {norm_type}")
    inf = norm_type == float("inf")
    mine: dict[str, float] = {}
    experts = plan.expert_ids()
    first = plan.coordinate[DP] == 0 and plan.coordinate[SP] == 0  # replicas and sp ranks hold the same gradients
    if first or (plan.experts is not None and plan.experts.rank < plan.experts.size):
        for name, p in module.named_parameters():  # (each rank of the first ep group holds its own experts)
            if not first and id(p) not in experts:
                continue
            if p.grad is not None and counts_in_norm(plan, p):
                g = local(p.grad).detach().double()
                mine[name] = float(g.abs().max()) if inf else float(g.norm(norm_type) ** norm_type)
    merged: dict[str, float] = {}
    for part in _collectives.all_gather_object(mine):
        for name, value in part.items():
            merged[name] = max(merged.get(name, 0.0), value) if inf else merged.get(name, 0.0) + value
    root = (lambda v: v) if inf else (lambda v: v ** (1.0 / norm_type))  # noqa: E731
    out = {
        f"grad_{norm_type}_norm{group_separator}{n}": torch.tensor(root(merged[n]), dtype=torch.float64)
        for n, _ in module.named_parameters()
        if n in merged
    }
    if out:
        total = max(merged.values()) if inf else sum(merged.values()) ** (1.0 / norm_type)
        out[f"grad_{norm_type}_norm_total"] = torch.tensor(total, dtype=torch.float64)
    return out


# ----------------------------------------------------------------------- the pipeline runtime's algebra
def stash(params: list[nn.Parameter]) -> list[Optional[Tensor]]:
    """Take the current gradients off ``params`` (they become ``None``) and return them."""
    saved = [p.grad for p in params]
    for p in params:
        p.grad = None
    return saved


def restore(
    stashed: list[nn.Parameter], saved: list[Optional[Tensor]], params: list[nn.Parameter]
) -> dict[nn.Parameter, Tensor]:
    """Put ``saved`` back on the ``stashed`` parameters and return the gradients of ``params`` (the current
    ones: a block's first call may have replaced some, e.g. by their tensor-parallel shards) that
    accumulated since ``stash``."""
    new = {p: p.grad for p in params if p.grad is not None}
    current = {id(p) for p in params}
    for p, g in zip(stashed, saved):
        p.grad = g if id(p) in current else None
    return new


def add_(new: dict[nn.Parameter, Tensor]) -> None:
    """Add the schedule's gradients to those the module holds (earlier accumulation batches')."""
    for p, g in new.items():
        if p.grad is None:
            p.grad = g
        else:
            p.grad.add_(g)


# --------------------------------------------------------------------------------------- helpers
def _place_(params: list[nn.Parameter]) -> None:
    """Bring each DTensor gradient to its parameter's placement (idempotent)."""
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and tuple(g.placements) != tuple(p.placements):
            p.grad = g.redistribute(placements=p.placements)


def _sum_used_(params: list[nn.Parameter], group: Any, mean: bool) -> None:
    """Sum (or average) the gradients of ``params`` over ``group`` in one all-reduce. Which of them any rank has a
    gradient for is agreed first (a rank without one adds zeros), so every rank reduces the same tensors; one
    that no rank has stays ``None``, as on one device."""
    if not params or group is None:
        return
    used = _collectives.any_over_group([p.grad is not None for p in params], group)
    for p, u in zip(params, used):
        if u and p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [local(p.grad) for p, u in zip(params, used) if u]
    (_collectives.all_reduce_mean_ if mean else _collectives.all_reduce_sum_)(grads, group)


def _squares(params: list[nn.Parameter], like: Tensor) -> Tensor:
    """The sum of the squares of the local gradients of ``params`` (a zero like ``like`` without any)."""
    if not params:
        return torch.zeros_like(like)
    return torch.stack([torch.linalg.vector_norm(local(p.grad), 2) for p in params]).pow(2).sum().to(like)


def _original(p: nn.Parameter, shards: Iterable[ShardedOptimizer]) -> nn.Parameter:
    """The model's parameter behind an optimizer's parameter (a chunk view inside a ZeRO window)."""
    for s in shards:
        p = s.original(p)  # type: ignore[assignment]
    return p
