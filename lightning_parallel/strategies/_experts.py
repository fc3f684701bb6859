"""The expert-parallel axis of the strategies (``expert_parallel_size=``): a part that checks the layout, builds
the axis from the data- and sequence-parallel ranks, shards the model's experts at set-up and tells the gradient
recipe which parameters are experts (:mod:`lightning_parallel.expert_parallel` is the mechanism).

Expert parallelism reuses the data- and sequence-parallel ranks, as torchtitan does (its ep over ``dp_shard x
cp``): the ``dp x sp`` ranks of each pipeline stage and tensor-parallel rank, flattened (sp inner: a replica's
sequence shards adjacent), are split into ``dp·sp / ep`` groups of ``ep`` consecutive ranks (``DeviceMesh._flatten``
then ``_unflatten``: ``dp_sp_replicate`` x ``dp_sp_ep``); each rank of an ep group holds ``num_experts / ep`` experts
and computes them for every token of its group (a sequence shard's tokens are routed where they are: no split
before dispatch). An expert's gradient on its rank is then the sum over its group's tokens, of whichever replicas
and sequence shards; the step's gradient, a mean over the replicas of each replica's sum over its sequence shards,
is the sum over the ``dp·sp / ep`` ranks holding the same experts divided by ``dp``
(:func:`lightning_parallel.strategies.gradients.sync_`), and the norm counts each expert once (its squares summed
over the ep group).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Optional

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from lightning_parallel.anatomy.experts import find_expert_lists, find_experts
from lightning_parallel.errors import ConfigurationError
from lightning_parallel.expert_parallel import (
    EP_AXIS,
    REPLICA_AXIS,
    ExpertParallelForward,
    ListExperts,
    shard_expert_list,
    shard_experts,
)
from lightning_parallel.mesh import DP, SP, ParallelDims
from lightning_parallel.strategies._optimizers import Replaced


@dataclass(frozen=True)
class ExpertLayout:
    """What the gradient recipe needs: the expert parameters, the ep group (their squares sum over it in the norm),
    the group of the ranks holding the same experts (their gradients' sum; ZeRO's axis for them: this rank's place
    ``replica`` of ``replica_count``), ep, the dp size (the sum's divisor) and this rank's place in the flattened
    ``dp x sp`` ranks (``rank < ep``: the first ep group)."""

    params: list[nn.Parameter]
    group: Any
    replicas: Any
    size: int
    dp: int
    rank: int
    replica: int = 0
    replica_count: int = 1


class ExpertParallel:
    """The expert-parallel axis of one strategy (module docstring)."""

    def __init__(self, size: int) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"expert_parallel_size must be a positive int, got {size!r}")
        self.size = size
        self.mesh: Optional[DeviceMesh] = None  # the 2-D (dp_sp_replicate, dp_sp_ep) mesh, made with the strategy's
        self.dims: Optional[ParallelDims] = None
        self.layout: Optional[ExpertLayout] = None
        self.holds_parts = False  # each rank keeps only its experts of a home-written mixture (the rest on meta)
        self.elsewhere_modules: list[nn.Module] = []  # those other ranks' experts (on meta here)

    def check(self, dims: ParallelDims) -> None:
        """Refuse a layout the axis cannot take, before any process starts."""
        if self.size == 1:
            return
        if (dims.dp * dims.sp) % self.size:
            raise ValueError(
                f"expert_parallel_size={self.size} must divide data_parallel_size={dims.dp} x sequence_parallel_size"
                f"={dims.sp} = {dims.dp * dims.sp}: expert parallelism reuses the data- and sequence-parallel ranks;"
                f" give their product a multiple of {self.size}"
            )

    def connect(self, mesh: DeviceMesh, dims: ParallelDims) -> None:
        """Split the flattened dp x sp ranks of the strategy's mesh into (replicas, ep) (a collective on every
        rank)."""
        self.mesh, self.dims = None, dims
        if self.size > 1:
            flat = mesh[DP, SP]._flatten(f"{DP}_{SP}")
            self.mesh = flat._unflatten(0, (dims.dp * dims.sp // self.size, self.size), (REPLICA_AXIS, EP_AXIS))

    def shard(self, module: nn.Module, replace: Callable[[Replaced], None]) -> bool:
        """Shard the experts this rank holds over the ep axis, those not sharded yet: at set-up, after the
        broadcast, and as a deferred block materialises (``replace`` gives the optimizers the new parameters).
        Experts still on meta (another stage's, or a block not materialised yet) stay as they are. Returns
        whether any was sharded now."""
        if self.mesh is None:
            self.layout, self.holds_parts = None, False
            return False
        found, lists = find_experts(module), find_expert_lists(module)
        if not found and not lists:  # the model, not this stage's part of it: the same on every rank
            raise ConfigurationError(
                f"expert_parallel_size={self.size} found no experts in {type(module).__name__}: it shards modules"
                " with a num_experts count and parameters stacked by expert, called as experts(hidden, top_k_index,"
                " top_k_weights), as transformers 5's mixtures, and home-written mixtures (an nn.ModuleList of"
                " alike experts beside a router nn.Linear with one output per expert); drop expert_parallel_size"
            )
        replaced: Replaced = []
        for name, experts in found:
            if not isinstance(experts.forward, ExpertParallelForward) and not _on_meta(experts.parameters(False)):
                before = dict(experts.named_parameters(recurse=False))
                for n in shard_experts(experts, self.mesh[EP_AXIS], self.mesh[REPLICA_AXIS].get_group()):
                    replaced.append((before[n], getattr(experts, n), f"{name}.{n}"))
        cut = False
        for name, mixture, experts in lists:
            if not isinstance(mixture.__dict__.get("forward"), ListExperts) and not _on_meta(experts.parameters()):
                before = dict(experts.named_parameters())
                # (the other ranks' experts go to meta)
                shard_expert_list(mixture, experts, self.mesh[EP_AXIS], self.mesh[REPLICA_AXIS].get_group())
                prefix = f"{name}.{next(n for n, c in mixture.named_children() if c is experts)}"
                after = dict(experts.named_parameters())
                replaced += [(before[n], after[n], f"{prefix}.{n}") for n in before if after[n] is not before[n]]
                cut = True
        if replaced:  # (a deferred block's: the optimizers hold them; at set-up they are built after)
            replace(replaced)
        params = [
            p for p in module.parameters() if isinstance(p, DTensor) and EP_AXIS in (p.device_mesh.mesh_dim_names or ())
        ]
        params += [p for _, _, experts in lists for p in experts.parameters() if not p.is_meta]
        self.holds_parts = any(isinstance(m.__dict__.get("forward"), ListExperts) for _, m, _ in lists)
        cut_lists = [e for _, m, e in lists if isinstance(m.__dict__.get("forward"), ListExperts)]
        self.elsewhere_modules = [e for experts in cut_lists for e in experts if any(p.is_meta for p in e.parameters())]
        assert self.dims is not None
        across = self.mesh[REPLICA_AXIS]
        replica, count = across.get_local_rank(), across.size()
        rank = replica * self.size + self.mesh[EP_AXIS].get_local_rank()
        self.layout = ExpertLayout(params, self.mesh[EP_AXIS].get_group(), across.get_group(), self.size,
                                   self.dims.dp, rank, replica, count)  # fmt: skip
        return bool(replaced) or cut


def _on_meta(params: Iterator[nn.Parameter]) -> bool:
    """Whether these experts are another stage's, or their block's still to materialise."""
    return any(p.is_meta for p in params)
