"""Sharded data parallelism inside the strategies: which mode is on, the backward's gradient buckets, the
full-sharding (FSDP2) units at set-up, checkpointed optimizer state, and the error for a sharded weight used
outside its module (the dp average and the norm's counting are :mod:`lightning_parallel.strategies.gradients`).
The mechanisms themselves are :mod:`lightning_parallel.strategies._sharding` (``"optimizer"``) and
:mod:`lightning_parallel.strategies._full_shard` (``"full"``)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from typing import Any, Optional

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import ParallelStrategy
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_parallel import _collectives
from lightning_parallel.errors import ConfigurationError
from lightning_parallel.expert_parallel import EP_AXIS, REPLICA_AXIS
from lightning_parallel.materialize import materialize_
from lightning_parallel.mesh import DP
from lightning_parallel.strategies import _sharding
from lightning_parallel.strategies._full_shard import fully_shard_experts, fully_shard_model
from lightning_parallel.strategies._logging import (
    LogRecorder,
    MetricStepper,
    recording,
    restore_metrics,
    snapshot_metrics,
)
from lightning_parallel.strategies._optimizers import replace_parameters
from lightning_parallel.strategies._overlap import GradientBuckets, overlappable
from lightning_parallel.strategies._pending import DeferredInit
from lightning_parallel.strategies._sharding import Sharding
from lightning_parallel.tensor_parallel import local
from lightning_parallel.trunk import Trunk, discover_trunk


class DataParallel:
    """The data-parallel axis's state, one part: the mode (``data_parallel_sharding``), the backward's gradient
    buckets and their size cap, FSDP2's root once applied, ZeRO's chunks per optimizer and this step's reduced
    chunks. Validated when the strategy is built."""

    def __init__(self, mode: Sharding, bucket_cap_mb: float) -> None:
        _sharding.check_sharding(mode)
        if bucket_cap_mb < 0:
            raise ValueError(f"bucket_cap_mb={bucket_cap_mb}; give a size in MiB, or 0 to average after the backward")
        self.mode, self.bucket_cap_mb = mode, bucket_cap_mb
        self.buckets: Optional[GradientBuckets] = None
        self.fsdp_root: list[torch.nn.Module] = []  # mode "full": the units' root, once applied
        self.shards: dict[int, _sharding.ShardedOptimizer] = {}  # id(optimizer) -> its chunks on this dp rank
        self.reduced: dict[int, dict[int, Tensor]] = {}  # id(optimizer) -> this step's reduced gradient chunks

    def buckets_for(
        self, units: list[list[torch.nn.Parameter]], keys: list[int], group: Any
    ) -> Optional[GradientBuckets]:
        """The buckets serving ``units`` if those made earlier do; else new ones (serving from the next backward)
        and ``None``."""
        if self.buckets is not None and self.buckets.covers(units, keys):
            return self.buckets
        if self.buckets is not None:
            self.buckets.remove()
        self.buckets = GradientBuckets(units, group, self.bucket_cap_mb, keys)
        return None

    def shards_of(self, optimizer: Optimizer, group: Any, rank: int, size: int,
                  experts: Callable[[Tensor], Optional[_sharding.Axis]]) -> _sharding.ShardedOptimizer:  # fmt: skip
        if id(optimizer) not in self.shards:
            self.shards[id(optimizer)] = _sharding.ShardedOptimizer(optimizer, group, rank, size, experts)
        return self.shards[id(optimizer)]


class DataParallelShardingMixin(ParallelStrategy):
    """Mixed into ``HybridParallelStrategy`` ahead of the state and tensor-parallel mixins (its overrides
    call theirs); its state is the :class:`DataParallel` part, ``_dp``."""

    # the strategy's (annotations only: nothing here shadows its properties)
    _dp: DataParallel
    _deferred: DeferredInit
    _blocks: Any
    _mesh: Any
    _trunk_path: Optional[str]
    _vocabulary_parallel: bool
    _tp_layout: Any
    _gradient_plan: Any
    _experts: Any
    _shard_experts: Callable[[], None]
    _plan_gradients: Callable[[], Any]
    parallel_dims: Any
    coordinate: dict[str, int]
    dp_group: Any

    def _prepare_buckets(self, loss: torch.Tensor) -> None:
        """Before the step's backward: the buckets learn which parameters its graph reaches."""
        if self._dp.buckets is not None and overlappable(self):
            self._dp.buckets.prepare(loss)

    def _gradient_units(self, params: list[torch.nn.Parameter]) -> tuple[list[list[torch.nn.Parameter]], list[int]]:
        """The parameters the buckets serve, in units whose gradients are final together, and the units' keys:
        here one, the whole model."""
        return [params], [0]

    def _gradient_buckets(self, optimizer: Optimizer) -> Optional[GradientBuckets]:
        """This step's buckets (``_overlap``) when the layout allows them and ``optimizer`` is the only one;
        ``None``: average after the backward. Made at the first step's average (the parameters are
        final by then, deferred blocks and shards included), so buckets serve from the second backward on."""
        if not overlappable(self) or self.parallel_dims.dp == 1:
            return None
        if len(self.optimizers) != 1:
            return None  # one of several optimizers: each steps when its closure says
        experts = {id(p) for p in self._expert_params()}  # averaged over their replicas, after the backward
        params = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in experts and not p.is_meta]
        return self._dp.buckets_for(*self._gradient_units(params), self.dp_group)

    def _fully_shard_deferred(
        self, lm: LightningModule, freed: list[torch.nn.Module], trunk: Optional[Trunk], seed: int
    ) -> None:
        """Full sharding of a deferred model: materialise and shard one unit at a time, so a rank never holds
        more than its shards and one unit whole (a unit's eagerly built tensors take rank 0's values first)."""
        meta = any(t.is_meta for t in [*lm.parameters(), *lm.buffers()])
        if not (self._fully_sharded and meta and not self._dp.fsdp_root) or self._shards_after_commit:
            return
        gone = {id(b) for b in freed}
        held = [b for b in self._held_blocks(lm, trunk or self._trunk_or_none(lm)) if id(b) not in gone]
        device = self.root_device

        def materialize_unit(unit: list[torch.nn.Module]) -> None:
            eager = [t for m in unit for t in [*m.parameters(), *m.buffers()] if not t.is_meta]
            self._deferred.unchecked.append(materialize_(lm, device, seed, only=unit, tape=self._deferred.tape))
            _collectives.broadcast_([t.data for t in eager], self.dp_group)
            self._shard_experts()  # the unit's experts by ep, before FSDP2 shards the rest

        mesh = self._mesh[DP]
        self._dp.fsdp_root = fully_shard_model(
            lm, held, mesh, before=materialize_unit, exclude=freed, outer=self.parallel_dims.pp == 1,
            ignored=self._expert_params, inner=self._fully_shard_experts,
        )  # fmt: skip
        self._experts_refreshed()

    def _fully_shard_built(self, lm: LightningModule) -> None:
        """Full sharding of a model built eagerly (after the set-up broadcast, which must see whole tensors)."""
        if not self._fully_sharded or self._dp.fsdp_root or self._shards_after_commit:
            return
        held = self._held_blocks(lm)
        blocks = self._blocks.trunk.blocks if self._blocks is not None else []
        freed = [b for b in blocks if b not in held]
        self._shard_experts()  # each rank's experts by ep first: FSDP2 leaves them out
        self._dp.fsdp_root = fully_shard_model(
            lm, held, self._mesh[DP], exclude=freed, outer=self.parallel_dims.pp == 1, ignored=self._expert_params,
            inner=self._fully_shard_experts,
        )  # fmt: skip
        self._experts_refreshed()

    @property
    def _shards_after_commit(self) -> bool:
        """Full sharding above tensor or sequence parallelism: FSDP2 shards what the blocks' stacks made (tensor-
        parallel DTensors; torchtitan's order), and a stack is verified on a copy of its block, which FSDP2's
        modules refuse; so set-up shards nothing and :meth:`_commit_then_fully_shard` runs before the first step."""
        dims = self.parallel_dims
        return self._fully_sharded and (dims.tp > 1 or dims.sp > 1)

    def _commit_then_fully_shard(
        self, capture_step: Callable[[Callable[[], Any]], Any], step: Callable[[], Any]
    ) -> None:
        """Before the first step or evaluation under :attr:`_shards_after_commit`: the step is captured up to the
        trunk (no graph, logs and metric states untouched, the random state restored), every local block's stack
        is resolved, verified and committed on the captured trunk input with its own arguments (a deferred block
        materialised just before: one block whole at a time), and then FSDP2 shards the blocks and (without a
        pipeline) the modules outside them under one root, as at set-up otherwise. The optimizers take the new
        parameters; the layouts' lists of parameters whose gradients are partial follow them."""
        if not self._shards_after_commit or self._dp.fsdp_root:
            return
        lm, layer = self.lightning_module, self._blocks
        metrics = MetricStepper(lm, False).metrics
        saved = snapshot_metrics(metrics)
        try:
            with torch.random.fork_rng(), recording(lm, LogRecorder()), torch.no_grad():
                cap = capture_step(step)
        finally:
            restore_metrics(metrics, saved)
        x = cap.trunk_input.detach()
        if not torch.isfinite(x).all():  # a stage without the embedding computed it from placeholders (NaN)
            x = torch.randn(x.shape, generator=torch.Generator().manual_seed(0), dtype=x.dtype).to(x.device)
        held = [runner.block for _, runner in sorted(layer.runners.items())]
        freed = [b for b in layer.trunk.blocks if not any(b is h for h in held)]
        with torch.inference_mode(False):  # parameters for training, also when an evaluation comes first
            layer.commit_all(x, cap.block_args)
            before = dict(lm.named_parameters())  # the commits' shards (the optimizers hold these now)
            mesh, outer = self._mesh[DP], self.parallel_dims.pp == 1
            experts = dict(ignored=self._expert_params, inner=self._fully_shard_experts)
            self._dp.fsdp_root = fully_shard_model(lm, held, mesh, exclude=freed, outer=outer, **experts)
        after = dict(lm.named_parameters())
        replaced = [(before[n], after[n], n) for n in before if after[n] is not before[n]]
        replace_parameters(self.optimizers, replaced, self._as_fsdp_shard)  # restored state: sharded alike
        self._experts_refreshed()
        new_of = {id(old): new for old, new, _ in replaced}
        for part in (layer.layouts.tp, layer.layouts.sp):
            if part is not None:
                part.partial = [new_of.get(id(p), p) for p in part.partial]

    def _as_fsdp_shard(self, name: str, value: Any, like: Any) -> Any:
        """Optimizer state (restored before the first step) of a parameter FSDP2 has just sharded, cut like it:
        FSDP2 cuts each rank's local tensor (its tensor-parallel shard, or the whole tensor) in dim 0 into dp
        chunks as ``torch.chunk`` does and keeps chunk ``dp rank``, so the state's local tensor is cut the same
        way (no communication); an expert's (its ep shard) into as many chunks as ranks hold it."""
        if not (torch.is_tensor(value) and isinstance(like, DTensor) and value.dim() and value.shape == like.shape):
            return value
        mine, rank, size = local(value), self.coordinate[DP], self.parallel_dims.dp
        experts = self._experts.layout
        if experts is not None and REPLICA_AXIS in (like.device_mesh.mesh_dim_names or ()):
            # an expert FSDP2 cut over the ranks holding it: this rank's experts (the ep shard), cut over those
            if not isinstance(value, DTensor):
                mine = value.chunk(experts.size)[self._experts.mesh[EP_AXIS].get_local_rank()]
            rank, size = experts.replica, experts.replica_count
        chunks = mine.chunk(size, dim=0)
        piece = chunks[rank] if rank < len(chunks) else mine.new_empty((0, *mine.shape[1:]))
        return DTensor.from_local(piece.contiguous().to(like.device), like.device_mesh, like.placements,
                                  run_check=False, shape=like.shape, stride=like.stride())  # fmt: skip

    @contextmanager
    def _explain_sharded_use(self) -> Any:
        """torch's "mixed torch.Tensor and DTensor" error, when the step used a parameter this strategy shards
        outside its module's call, becomes an error that names the argument that fixes it."""
        try:
            yield
        except RuntimeError as err:
            hints = []
            if self._fully_sharded:
                hints.append(
                    "data_parallel_sharding='full' gathers a module's parameters only around that module's own"
                    " call; use data_parallel_sharding='optimizer'"
                )
            if self.parallel_dims.tp > 1 and self._vocabulary_parallel:
                hints.append(
                    "vocabulary_parallel=True shards the embedding and the head; pass vocabulary_parallel=False"
                )
            if "mixed torch.Tensor and DTensor" not in str(err) or not hints:
                raise
            raise ConfigurationError(
                "the step used a sharded parameter outside its module's forward (e.g. x @ self.wte.weight.T): "
                + "; or ".join(hints)
                + f" (torch: {str(err).splitlines()[0]})"
            ) from err

    @property
    def _sharded(self) -> bool:
        return self._dp.mode == "optimizer" and self.parallel_dims.dp > 1

    @property
    def _fully_sharded(self) -> bool:
        return self._dp.mode == "full" and self.parallel_dims.dp > 1

    #: whether the runtime calls parts of blocks rather than whole blocks (helix): FSDP2 cannot shard them
    _cuts_blocks = False

    def _held_blocks(self, lm: LightningModule, trunk: Optional[Trunk] = None) -> list[torch.nn.Module]:
        """The trunk blocks this rank holds (with ``trunk``: every block not freed, deferred ones included;
        none where the model has no trunk)."""
        if trunk is not None:
            return list(trunk.blocks)
        trunk = self._blocks.trunk if self._blocks is not None else self._trunk_or_none(lm)
        return [b for b in trunk.blocks if not any(p.is_meta for p in b.parameters())] if trunk else []

    def _trunk_or_none(self, lm: LightningModule) -> Optional[Trunk]:
        try:
            return discover_trunk(lm, self._trunk_path)
        except ValueError:
            return None

    def _fully_shard_experts(self, unit: list[torch.nn.Module]) -> None:
        """Expert FSDP over the ranks holding the same experts, when there are several (``fully_shard_experts``)."""
        mesh = self._experts.mesh
        if mesh is not None and mesh[REPLICA_AXIS].size() > 1:
            fully_shard_experts(unit, mesh[REPLICA_AXIS], self.parallel_dims.dp)

    def _experts_refreshed(self) -> None:
        """The experts' parameters (FSDP2's now, where it sharded them) in the layout and the gradient plan."""
        self._experts.shard(self.lightning_module, lambda replaced: None)
        if self._gradient_plan is not None:
            self._gradient_plan = self._plan_gradients()

    def _expert_params(self) -> set[torch.nn.Parameter]:
        """Expert parallelism's experts, this rank's and (of a home-written mixture) the others' on meta: FSDP2
        leaves them out."""
        layout = self._experts.layout
        elsewhere = [p for m in self._experts.elsewhere_modules for p in m.parameters()]
        return {*layout.params, *elsewhere} if layout is not None else set()

    def _shards_of(self, optimizer: Optimizer) -> _sharding.ShardedOptimizer:
        def expert(p: Tensor) -> Optional[_sharding.Axis]:  # (the plan's: a deferred block's join as it materialises)
            plan = self._gradient_plan
            if plan is None or plan.experts is None or id(p) not in plan.expert_ids():
                return None
            return _sharding.Axis(plan.experts.replicas, plan.experts.replica, plan.experts.replica_count)

        return self._dp.shards_of(optimizer, self.dp_group, self.coordinate[DP], self.parallel_dims.dp, expert)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if not self._sharded:
            return super().optimizer_state(optimizer)
        self.materialize_deferred()  # before the swap: state restored or built at materialisation goes to the chunks
        shards, inner = self._shards_of(optimizer), getattr(optimizer, "optimizer", optimizer)
        layout = self._tp_layout
        permuted = {
            id(p) for n, p in self.lightning_module.named_parameters() if layout is not None and n in layout.permuted
        }
        chunks = inner.state
        # each rank's chunks, written into whole tensors by DCP (no gather); a permuted fused projection's state is
        # gathered over dp, one tensor at a time, so that StateMixin can restore its original order
        inner.state = shards.checkpoint_state(gather=lambda p: id(p) in permuted)
        try:
            return super().optimizer_state(optimizer)
        finally:
            inner.state = chunks
