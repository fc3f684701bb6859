"""``PipelineParallelStrategy`` (``strategy="pipeline"``): pipeline parallelism for an unchanged
LightningModule, composable with data parallelism (mesh ``dp x pp``).

What it wires into Lightning (docs/design.md, "Pipeline parallelism"):

- ``setup`` (the base strategy's recipe, with this strategy's ``_place_stages``): place the trunk's
  blocks on stages (balanced, ``layers_per_stage``, virtual stages), free the other stages' blocks,
  compose the local blocks, then build optimizers without the freed parameters. The loss stage (last
  chunk) runs on pp coordinate 0, so global rank 0 sees the loss.
- ``training_step``: split the batch into micro-batches and hand them to the runtime with the chosen
  schedule. Lightning zeroes gradients *after* ``training_step``, so the schedule's gradients are
  stashed and put back in ``backward``, which still fires ``on_before_backward``/``on_after_backward``.
  ``self.log`` calls are recorded, reduced over micro-batches, and replayed on every rank.
- ``optimizer_step``: pre/post-trunk gradients are summed over the pipeline group (they are replicated;
  this also makes tied embeddings correct), then averaged over dp; clipping uses the global norm.
- ``validation/test/predict``: lock-step mode (every rank runs the same pre/post-trunk code).

Over 400 lines because it overrides the Lightning hooks a pipeline changes (set-up and placement, the step,
backward, evaluation in lock-step, teardown, failures) and holds the pipeline's argument checks; the runtime,
the schedules and the micro-batches are their own modules.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import replace
from typing import Any, Literal, Optional

import torch
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_parallel import _collectives
from lightning_parallel.anatomy.router_losses import Balancing, balancing_of
from lightning_parallel.blocks import BlockConfig
from lightning_parallel.errors import ConfigurationError
from lightning_parallel.mesh import DP, PP, SP, Size, check_size
from lightning_parallel.pipeline import outer
from lightning_parallel.pipeline.balancing import RouterSums, over_stages, stood_in
from lightning_parallel.pipeline.capture import loss_of
from lightning_parallel.pipeline.placement import place_blocks
from lightning_parallel.pipeline.runtime import PipelineRuntime
from lightning_parallel.pipeline.schedules import (
    SPLIT_BACKWARD,
    PipelineSettings,
    Simulation,
    build_schedule,
    chunk_stages,
    forwards_first,
    placement_style,
    simulate,
)
from lightning_parallel.strategies import _failures, gradients
from lightning_parallel.strategies._logging import (
    LogRecorder,
    MetricStepper,
    recording,
    reduce_records,
    replay_logs,
    restore_metrics,
    snapshot_metrics,
)
from lightning_parallel.strategies._overlap import GradientBuckets, overlappable
from lightning_parallel.strategies._processes import SIGTERM_EXIT_CODE
from lightning_parallel.strategies._stage_local import OuterShards
from lightning_parallel.strategies.hybrid import HybridParallelStrategy
from lightning_parallel.strategies.microbatches import (
    MicroBatchSteps,
    batch_checksum,
    check_padding,
    split_microbatches,
    step_extras,
)
from lightning_parallel.token_mean import TokenWeights, global_means, say_samples_once
from lightning_parallel.trunk import Trunk, free_blocks, materialised_to, no_fast_paths, parameter_bytes

ScheduleName = Literal["gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv"]


class PipelineParallelStrategy(HybridParallelStrategy):
    """Pipeline parallelism over ``pipeline_parallel_size`` stages (x ``data_parallel_size`` replicas).

    Args:
        pipeline_parallel_size: number of stages; ``"auto"``: every device not used for dp.
        data_parallel_size: number of replicas (default 1).
        num_microbatches: micro-batches per batch (default ``2 * pipeline_parallel_size``).
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``, or the zero-bubble ``"zb_h1"`` (1F1B with
            the weight gradients deferred into its bubble) and ``"zbv"`` (two chunks per stage in a V);
            see :mod:`lightning_parallel.pipeline.schedules`.
        virtual_stages: model chunks per stage for ``"interleaved_1f1b"`` (default 2) and ``"zbv"`` (2), else 1.
        layers_per_stage: blocks per chunk, in chunk order (default: balanced).
        loss_reduction: ``"mean"`` (the loss is a mean over samples: micro-batch losses are weighted by
            their share of the batch) or ``"sum"``.
        check_batches: for this many first steps, check that every pipeline rank got the same batch.
        **kwargs: the arguments of :class:`HybridParallelStrategy` (``recompute=``, ``mlp_chunks=``, ``trunk=``...).
    """

    strategy_name = "pipeline"
    strategy_description = "lightning-parallel: pipeline parallelism (GPipe, 1F1B, interleaved) for unchanged modules"

    def __init__(
        self,
        pipeline_parallel_size: Size = "auto",
        data_parallel_size: Size = 1,
        num_microbatches: Optional[int] = None,
        schedule: ScheduleName = "1f1b",
        virtual_stages: Optional[int] = None,
        layers_per_stage: Optional[list[int]] = None,
        loss_reduction: Literal["mean", "sum"] = "mean",
        check_batches: int = 2,
        **kwargs: Any,
    ) -> None:
        super().__init__(data_parallel_size=data_parallel_size, **kwargs)
        check_size(PP, pipeline_parallel_size)
        self._settings = PipelineSettings(
            schedule, num_microbatches, virtual_stages, layers_per_stage, loss_reduction, check_batches
        )
        if schedule in SPLIT_BACKWARD and self._dp.mode == "full":
            raise ValueError(
                f"schedule={schedule!r} splits the backward into input- and weight-gradient actions, which FSDP2's"
                " per-block gradient reduction (data_parallel_sharding='full') would run before the weights'"
                " gradients exist; use data_parallel_sharding='optimizer', or schedule='1f1b'"
            )
        self._sizes["pp"] = pipeline_parallel_size
        self.runtime: Optional[PipelineRuntime] = None
        self._balancing: Optional[Balancing] = None  # the model's balancing loss, found at set-up
        self._grad_buffer: dict[nn.Parameter, Tensor] = {}
        self._outer = OuterShards()  # the parameters outside the trunk, stored in shards over the stages
        self._report_pending = False  # the placement is reported once the outer part is sharded
        self._steps_done = 0

    # --------------------------------------------------------------------------------- layout
    @property
    def num_microbatches(self) -> int:
        return self._settings.num_microbatches or 2 * self.parallel_dims.pp

    @property
    def chunk_stages(self) -> list[int]:
        """The stage of each model chunk (loop placement; a V for ``"zbv"``)."""
        return chunk_stages(self.parallel_dims.pp, self._settings.virtual, placement_style(self._settings.schedule))

    @property
    def stage(self) -> int:
        """This rank's pipeline stage; the loss stage sits on pp coordinate 0 (global rank 0 logs)."""
        coordinate = self.coordinate[PP]
        return coordinate if self.loss_stage == 0 else self.parallel_dims.pp - 1 - coordinate

    def stage_rank(self, stage: int) -> int:
        coordinate = stage if self.loss_stage == 0 else self.parallel_dims.pp - 1 - stage
        return _collectives.group_ranks(self.pp_group)[coordinate]

    @property
    def loss_stage(self) -> int:
        """The stage that runs the user's post-trunk code and loss: the last chunk's (stage 0 in a V)."""
        return self.chunk_stages[-1]

    @property
    def is_loss_stage(self) -> bool:
        return self.stage == self.loss_stage

    @override
    def _configure_launcher(self) -> None:
        if getattr(self.precision_plugin, "precision", None) == "16-mixed":
            raise ValueError(
                "precision='16-mixed' is not supported under pipeline parallelism: each stage's loss scaler would"
                " skip steps on its own and their scales would diverge; use precision='bf16-mixed' or '32-true'"
            )
        super()._configure_launcher()
        self._validate_schedule()  # num_microbatches against the schedule, before any process starts

    def _validate_schedule(self) -> None:
        dims = self.parallel_dims
        self.schedule = build_schedule(self._settings.schedule, dims.pp, self.num_microbatches, self._settings.virtual)

    def simulate_schedule(self, cost: Callable[[str, int], float]) -> Simulation:
        """The schedule on a virtual clock, ``cost(kind, chunk)`` seconds per action (for the profilers)."""
        chunks = self.parallel_dims.pp * self._settings.virtual
        return simulate(
            self.schedule, chunks, self.num_microbatches, cost=lambda a: cost(a.kind, a.chunk), stages=self.chunk_stages
        )

    # ---------------------------------------------------------------------------------- setup
    @override
    def _check_module(self, lm: Any) -> None:
        if not lm.automatic_optimization:
            raise ValueError(
                "manual optimization is not supported under pipeline parallelism; use automatic optimization"
            )
        self._balancing = balancing_of(lm)  # a mixture's balancing loss from every layer's router logits
        if self._balancing is not None:
            self._check_balancing(self._balancing)

    def _check_balancing(self, spec: Balancing) -> None:
        """A balancing loss reads every micro-batch's router sums before the first backward
        (:mod:`lightning_parallel.pipeline.balancing`)."""
        if self._block_settings.mlp_chunks > 1:
            raise ConfigurationError(
                f"{type(spec.module).__name__} has output_router_logits=True: with mlp_chunks="
                f"{self._block_settings.mlp_chunks} each router runs once per slice of the sequence, and its"
                " load-balancing loss weighs each router's rows by the attention mask as one call; use mlp_chunks=1"
                " (or set output_router_logits=False in the model's config)"
            )
        if not forwards_first(self.schedule):
            raise ConfigurationError(
                f"{type(spec.module).__name__} has output_router_logits=True: its load-balancing loss is one value over"
                f" the whole batch, which schedule={self._settings.schedule!r} with num_microbatches="
                f"{self.num_microbatches} cannot give before its first backward; use schedule='gpipe' (every forward"
                " first), or set output_router_logits=False in the model's config"
            )

    @override
    def _needs_trunk(self) -> bool:
        return True

    @override
    def _block_config(self) -> BlockConfig:
        # a split backward unpacks a recomputed block's activations twice: one recomputation serves both
        return replace(super()._block_config(), split_backward=self._settings.schedule in SPLIT_BACKWARD)

    @override
    def _place_stages(self, lm: Any, trunk: Trunk) -> tuple[list[tuple[int, nn.Module]], list[nn.Module]]:
        """Place the trunk's blocks on model chunks, free the other stages' blocks, build the runtime."""
        dims, stage = self.parallel_dims, self.stage
        virtual, layers = self._settings.virtual, self._settings.layers_per_stage
        chunks = dims.pp * virtual
        if layers is None and len(trunk) < chunks:
            raise ValueError(
                f"pipeline_parallel_size={dims.pp} x virtual_stages={virtual} = {chunks} stages need at least"
                f" {chunks} blocks, but trunk {trunk.path!r} has {len(trunk)}"
            )
        if virtual > 1 and layers is None and len(trunk) % chunks:
            raise ValueError(
                f"schedule={self._settings.schedule!r} with pipeline_parallel_size={dims.pp} x"
                f" virtual_stages={virtual} needs the"
                f" {len(trunk)} blocks of {trunk.path!r} to divide into {chunks} equal chunks; change virtual_stages"
                " or give layers_per_stage"
            )
        placement, stages = place_blocks(len(trunk), chunks, layers), self.chunk_stages
        local = {j for c in range(chunks) if stages[c] == stage for j in placement[c]}
        if self._blocks is None:  # first placement: every rank still holds every (materialised) block
            self._receive_blocks(trunk, local)
        free_blocks([b for j, b in enumerate(trunk.blocks) if j not in local])
        ranks = [self.stage_rank(s) for s in range(dims.pp)]
        self.runtime = PipelineRuntime(trunk, placement, stage, ranks, self.pp_lanes, self.root_device, stages)
        self._metrics = MetricStepper(lm, self.is_loss_stage)
        self._placement = placement
        freed = [b for j, b in enumerate(trunk.blocks) if j not in local]
        return [(j, b) for j, b in enumerate(trunk.blocks) if j in local], freed

    def _receive_blocks(self, trunk: Trunk, local: set[int]) -> None:
        """Each stage takes its blocks' values from pp coordinate 0 (global rank 0's replica), block by block,
        freeing the others' as it goes: processes that initialised differently (no common seed) train the
        model rank 0 built, and a device holds at most its stage plus one block. Meta (deferred) blocks are
        skipped: they are materialised from a common seed."""
        for j, block in enumerate(trunk.blocks):
            tensors = [t for t in [*block.parameters(), *block.buffers()] if not t.is_meta]
            if not tensors:
                continue
            materialised_to(block, self.root_device)
            _collectives.broadcast_([t.data for t in tensors], self.pp_group)
            if j not in local:
                free_blocks([block])

    @override
    def _placed(self, lm: Any, trunk: Trunk) -> None:
        self._attach_outer(lm, trunk)
        self._report_pending = True

    @override
    def _shard_outer(self, lm: Any) -> None:
        if self.parallel_dims.pp > 1 and not self._outer.sharded:  # (set up again after a fit: sharded already)
            dp = self.parallel_dims.dp if self._fully_sharded else 1
            self._outer.shard(self._mesh[DP, PP]._flatten("dp_pp") if dp > 1 else self._mesh[PP], dp)  # type: ignore[index]
        if self._report_pending:  # what each rank holds once the outer part is sharded
            self._report_pending = False
            self._report_placement(self.runtime.trunk.path, self._placement, parameter_bytes(lm))  # type: ignore[union-attr]

    def _attach_outer(self, lm: Any, trunk: Trunk) -> None:
        """The pre/post-trunk parameters (every stage holds them), by name: sharding replaces the objects."""
        in_blocks = {id(p) for b in trunk.blocks for p in b.parameters()}
        names = frozenset(n for n, p in lm.named_parameters(remove_duplicate=False) if id(p) not in in_blocks)
        self._outer.attach(lm, names, self.stage, self.loss_stage)

    @property
    def outer_placement(self) -> dict[str, tuple[int, ...]]:
        """Each sharded pre/post-trunk parameter's name -> the stages that hold it whole during a training step
        (every stage stores ``1 / pp`` of it); parameters not listed are whole on every stage."""
        return self._outer.placement

    @property
    def outer_at_rest(self) -> bool:
        """Whether the module holds the stored shards (no training step or evaluation loop is using the whole
        copies of the parameters outside the trunk)."""
        return self._outer.state == "rest"

    @override
    def _outer_gradients(self) -> OuterShards:
        return self._outer

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        with self._outer.stored():
            return super().lightning_module_state_dict()

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        with self._outer.stored():
            return super().optimizer_state(optimizer)

    def _probe_outer(self, step: Callable[[], Any]) -> Callable[[dict[str, nn.Parameter]], Any]:
        """What the first step's code reads before and after the trunk (:func:`outer.touched`), run without a
        graph (a live one would pin the parameters), its logs and metric updates dropped."""
        lm, runtime = self.lightning_module, self.runtime
        assert runtime is not None

        def probe(watched: dict[str, nn.Parameter]) -> Any:
            saved = snapshot_metrics(self._metrics.metrics)
            try:
                with torch.random.fork_rng(), recording(lm, LogRecorder()), no_fast_paths(), torch.no_grad():
                    with self.precision_plugin.train_step_context(), stood_in(self._balancing):
                        trunk_input = runtime.capture_step(step).trunk_input
                        return outer.touched(runtime.trunk, step, watched, trunk_input, runtime.output_like)
            finally:
                restore_metrics(self._metrics.metrics, saved)

        return probe

    def _report_placement(self, path: str, placement: list[range], nbytes: int) -> None:
        table = _collectives.all_gather_object((self.global_rank, self.stage, nbytes))
        self.stage_parameter_bytes = {stage: b for _, stage, b in table}
        sizes = [len(r) for r in placement]
        lines = [f"{self.strategy_name} over {path!r}: {len(placement)} chunks, blocks per chunk {sizes}"]
        lines += [f"  rank {r}: stage {s}, {b / 2**20:.2f} MiB of parameters" for r, s, b in table]
        deferred = sum(any(p.is_meta for p in b.parameters()) for b in self._deferred.blocks)
        if deferred:  # the same count on every rank of this layout
            lines.append(f"  not counted yet: {deferred} deferred block(s) per rank, materialised at their first call")
        rank_zero_info("\n".join(lines))

    # ------------------------------------------------------------------------------- training
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        lm, runtime = self.lightning_module, self.runtime
        assert lm is not None and runtime is not None
        batch, rest = args[0], args[1:]
        if self._steps_done < self._settings.check_batches:
            self._check_same_batch(batch)
        self._steps_done += 1
        micro, shares = split_microbatches(batch, self.num_microbatches)
        if 0.0 in shares:
            check_padding(lm, len(micro) - shares.count(0.0), self.num_microbatches)
        self._outer.gather_for_step()  # the sharded pre/post-trunk parameters, whole where they run
        if not self._outer.decided:
            self._decide_at_first_step(lambda: lm.training_step(micro[0], *rest, **kwargs))
        if self._shards_after_commit and not self._dp.fsdp_root:  # full sharding above tp / sp: commit, then shard
            freed = outer.placeholders(self._outer.freed, self.root_device)
            with self.precision_plugin.train_step_context(), no_fast_paths(), freed:
                self._commit_then_fully_shard(runtime.capture_step, lambda: lm.training_step(micro[0], *rest, **kwargs))
        # each micro-batch's loss weight: its token count where the losses are token means (token_mean.py)
        replicas = self.dp_group if self.parallel_dims.dp > 1 else None  # one token unit for every replica
        weights = TokenWeights(shares, lm.trainer.accumulate_grad_batches, self._settings.loss_reduction, replicas)
        params = [p for p in lm.parameters() if p.device.type != "meta"]
        saved = gradients.stash(params)  # Lightning zeroes grads after training_step
        recorder = LogRecorder()
        user = MicroBatchSteps(self._metrics.metrics, lm, micro, shares, rest, kwargs, recorder, weights)
        self._metrics.before_step()
        freed = outer.placeholders(self._outer.freed, self.root_device)  # the capture pass runs the user's code
        runtime.gradients = self._armed_buckets(lm)  # the dp means go in the units' last backward actions
        runtime.balancing = self._router_sums(shares)
        self._grad_scale = None
        try:
            with self.precision_plugin.train_step_context(), recording(lm, recorder), no_fast_paths(), freed:
                with self._explain_sharded_use(), self._heads.active():
                    results = runtime.run(self.schedule, user, loss_of, weights)
        finally:
            armed, runtime.gradients, runtime.balancing = runtime.gradients is not None, None, None
        self._grad_buffer = gradients.restore(params, saved, [p for p in lm.parameters() if p.device.type != "meta"])
        return self._finish_step(results, recorder, shares, weights, armed)

    def _router_sums(self, shares: list[float]) -> Optional[RouterSums]:
        """This step's router sums where the model adds a balancing loss, else ``None``."""
        if self._balancing is None:
            return None
        dims = self.parallel_dims
        loss_rank = _collectives.group_ranks(self.pp_group).index(self.stage_rank(self.loss_stage))
        shards = self._mesh.get_group(SP) if dims.sp > 1 else None
        replicas = self.dp_group if dims.dp > 1 else None
        return RouterSums(self._balancing, shares, self.root_device, self.pp_group, loss_rank, shards, replicas)

    def _decide_at_first_step(self, step: Callable[[], Any]) -> None:
        """What the first training step decides, on its first micro-batch (``step``): which stages run each
        pre/post-trunk parameter."""
        self._outer.place(self._probe_outer(step))

    def _armed_buckets(self, lm: Any) -> Optional[GradientBuckets]:
        """The buckets this step's schedule issues (``strategies/_overlap.py``), or ``None``: none made yet (they
        are at the first step's sync), sharded data parallelism, or gradient accumulation (the schedule's
        gradients join the earlier batches' only in ``backward``)."""
        buckets = self._dp.buckets
        if buckets is None or not overlappable(self) or lm.trainer.accumulate_grad_batches != 1:
            return None
        return buckets if buckets.start() else None

    @override
    def _prepare_buckets(self, loss: Tensor) -> None:
        """The schedule ran the backward already (its runtime opens and closes the buckets' units)."""

    @override
    def _gradient_units(self, params: list[nn.Parameter]) -> tuple[list[list[nn.Parameter]], list[int]]:
        """One unit per gradient unit of this stage's schedule (a model chunk; a param chunk under helix), in the
        order their last weight-gradient actions come; a block parameter belongs to the last unit that may touch
        it. The pre/post-trunk parameters are in none (summed over the stages first, then averaged)."""
        assert self.runtime is not None
        units = self.runtime.gradient_units(self.schedule[self.stage])
        outer = {id(p) for p in self._outer.replicated()}
        mine = {id(p) for p in params if p.requires_grad and not p.is_meta and id(p) not in outer}
        owner: dict[int, int] = {}
        for k, (_, blocks) in enumerate(units):
            for b in blocks:
                owner.update({id(p): k for p in self.runtime.trunk.blocks[b].parameters() if id(p) in mine})
        grouped: list[list[nn.Parameter]] = [[] for _ in units]
        for p in params:
            if id(p) in owner:
                grouped[owner[id(p)]].append(p)
        return grouped, [key for key, _ in units]

    def _finish_step(
        self, results: dict, recorder: LogRecorder, shares: list[float], weights: TokenWeights, armed: bool
    ) -> Tensor:
        """Weight the micro-batch losses on the loss stage; share loss and logs with every rank. Token means: the
        step's loss over every replica's tokens, and the gradients scaled by ``replicas / tokens``
        (:mod:`lightning_parallel.token_mean`; after the buckets' dp means when they went during the schedule,
        ``armed``: the factor is the same on every replica)."""
        total, logged, scale, extras = None, None, None, None
        if self.is_loss_stage:
            extras = step_extras([results[i][1] for i in range(len(shares))], shares)
            losses = torch.stack([results[i][0].double() for i in range(len(shares))])
            loss_weights = torch.stack([torch.as_tensor(w, dtype=torch.float64).to(losses.device)
                                        for w in weights.loss_weights()])  # fmt: skip
            if weights.tokens:
                (total,), count = global_means([((losses * loss_weights).sum(), loss_weights.sum())], self.dp_group)
                scale = weights.scale(count, self.parallel_dims.dp)
            else:
                total = (losses * loss_weights).sum()
                if self._settings.loss_reduction == "mean" and (self.parallel_dims.dp > 1 or len(shares) > 1):
                    say_samples_once(f"{type(self).__name__} ({len(shares)} micro-batches, dp={self.parallel_dims.dp})")
            total = total.to(results[0][0].dtype).cpu()
            logged = reduce_records(recorder, shares, self.dp_group)
        src = self.stage_rank(self.loss_stage)
        total, scale, extras = replay_logs(self.lightning_module, logged, self._metrics, (total, scale, extras), src,
                                           self.pp_group, self.root_device)  # fmt: skip
        if scale is not None and scale != 1.0 and armed:
            self._grad_scale = scale
        elif scale is not None and scale != 1.0:  # seeds in token counts: over all tokens, x the replicas dp divides by
            for grad in self._grad_buffer.values():
                grad.mul_(scale)
        if extras is None:
            return total.to(self.root_device)
        extras = {k: v.to(self.root_device) if isinstance(v, Tensor) else v for k, v in extras.items()}
        return {"loss": total.to(self.root_device), **extras}

    def _check_same_batch(self, batch: Any) -> None:
        """Every rank of one replica must train on the same batch: compare a checksum."""
        sums = _collectives.all_gather_object(batch_checksum(batch), self.pp_group)
        if len(set(sums)) > 1:
            raise RuntimeError(
                f"the pipeline ranks of one replica received different batches (checksums {sums}); the data must be"
                " sharded by data-parallel rank only (use the sampler Lightning injects, or shard by"
                " trainer.strategy.distributed_sampler_kwargs)"
            )

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        """The schedule already ran backward: fire the hooks and put its gradients in place."""
        lm = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, lm)
        gradients.add_(self._grad_buffer)
        self._grad_buffer = {}
        closure_loss = self.precision_plugin.post_backward(closure_loss, lm)
        self.post_backward(closure_loss)
        return closure_loss

    # ----------------------------------------------------------------------------- evaluation
    @override
    def _shared_over_pp(self, module: nn.Module) -> list[Tensor]:
        # what every stage holds whole: not the shards of the pre/post-trunk parameters
        return [t for t in super()._shared_over_pp(module) if not self._outer.holds(t)]

    @override
    def _evaluation_starts(self) -> None:
        super()._evaluation_starts()
        self._outer.gather_for_evaluation()  # lock-step: every stage runs the pre- and post-trunk code

    @override
    def _evaluation_ends(self) -> None:
        self._outer.evaluation_ends()

    def _lockstep(self, hook: str, *args: Any, **kwargs: Any) -> Any:
        assert self.runtime is not None
        base = getattr(super(), hook)
        with no_fast_paths():
            if self._shards_after_commit and not self._dp.fsdp_root:  # full sharding above tp / sp: commit, then shard
                step = getattr(self.lightning_module, hook)
                self._commit_then_fully_shard(self.runtime.capture_step, lambda: step(*args, **kwargs))
            summed = self._balancing is not None and self.runtime._evaluates_in_parts()
            shards = self._mesh.get_group(SP) if self.parallel_dims.sp > 1 else None
            with over_stages(self._balancing, self.pp_group, shards) if summed else nullcontext():  # type: ignore[arg-type]
                return self.runtime.lockstep(lambda: base(*args, **kwargs))

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._lockstep("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._lockstep("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._lockstep("predict_step", *args, **kwargs)

    # ------------------------------------------------------------------------ state & failure
    @override
    def _part_groups(self) -> list[Any]:
        return [*super()._part_groups(), self.pp_group]

    @override
    def teardown(self) -> None:
        if self.lightning_module is not None:
            self._outer.to_rest()  # a fit that stopped while gradients accumulated (max_time=, should_stop)
        super().teardown()  # (the module guarded where it holds only its stages' blocks)
        self.runtime = None

    @override
    def _partial_message(self, lm: Any) -> str:
        tensors = [*lm.parameters(), *lm.buffers()]
        meta = sum(t.is_meta for t in tensors)
        return (
            f"{type(lm).__name__} holds only pipeline stage {self.stage} of {self.parallel_dims.pp} on rank"
            f" {self.global_rank} after {self.strategy_name} training ({meta} of {len(tensors)} parameters and buffers"
            " are on the meta device), so its state_dict() would be partial. For the whole model call"
            " trainer.strategy.full_state_dict() on every rank (rank 0 receives it), or save a checkpoint"
            " (trainer.save_checkpoint(path); MyModule.load_from_checkpoint(path) reads it, python -m"
            " lightning_parallel.export writes one plain file)"
        )

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Print the traceback and leave now: peers blocked on this rank see "connection closed" within
        about a second and fail in turn, instead of waiting for the process-group timeout."""
        if isinstance(exception, SIGTERMException) and self.world_size > 1:
            _failures.mark_raised(self._peers, self.global_rank)  # stopped, not killed
            sys.stderr.write(f"[rank {self.global_rank}] stopped by SIGTERM (exit code {SIGTERM_EXIT_CODE})\n")
            sys.stderr.flush()
            sys.stdout.flush()
            os._exit(SIGTERM_EXIT_CODE)
        if self.world_size > 1 and not isinstance(exception, KeyboardInterrupt):
            peers = self._peers
            # only a connection failure can mean a dead peer: looking for one waits up to 10 s, which every rank
            # of a job that raised the same error (bad input) would otherwise spend
            connection = peers and _failures.is_connection_failure(exception)
            line = _failures.dead_peers_line(peers, self.global_rank) if connection else None
            if line is None:  # no dead peer ("": one, named already by the launcher's watcher)
                _failures.mark_raised(peers, self.global_rank)
            sys.stderr.write(line or "")
            sys.stderr.write(f"[rank {self.global_rank}] {''.join(traceback.format_exception(exception))}")
            sys.stderr.flush()
            sys.stdout.flush()
            os._exit(1)
        super().on_exception(exception)
