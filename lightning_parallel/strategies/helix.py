"""``HelixParallelStrategy`` (``strategy="helix"``): HelixPipe (Zhang et al., arXiv 2507.00394), the
attention-parallel pipeline, for an unchanged LightningModule.

Layer k's attention for the micro-batch at group offset d runs on stage (k + d) mod p, so the
attentions of one group run on all stages at once and attention leaves the pipeline's fill and drain;
param chunks ``post-attention(j) + pre-attention(j+1)`` run on stage j mod p; micro-batches go in the
two-fold first-in-last-out order (``pipeline/helix_schedule.py``). Each block is split at its attention
call by its anatomy (:mod:`lightning_parallel.anatomy`: a hand-written adapter, or the block's graph
traced and cut there), verified on the first real micro-batch against the block's own forward and
gradients before anything is freed. Each parameter then lives on exactly one stage: a
block's pre-attention part on stage (k-1) mod p, the rest on stage k mod p. Defaults: recomputation
without attention and a chunked MLP (both switchable). The loss stage is stage 0 (global rank 0).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Literal, Optional

import torch
from torch import Tensor, nn
from typing_extensions import override

from lightning_parallel import _collectives
from lightning_parallel.anatomy.verify import Verdicts
from lightning_parallel.blocks import BlockConfig
from lightning_parallel.errors import ConfigurationError
from lightning_parallel.mesh import DP, PP, SP, TP, Size
from lightning_parallel.pipeline.helix_runtime import HelixRuntime, place_block
from lightning_parallel.pipeline.helix_schedule import check_sizes, helix, simulate_helix
from lightning_parallel.pipeline.schedules import Simulation
from lightning_parallel.strategies._logging import (
    LogRecorder,
    MetricStepper,
    recording,
)
from lightning_parallel.strategies._optimizers import drop_parameters
from lightning_parallel.strategies.pipeline import PipelineParallelStrategy
from lightning_parallel.trunk import Trunk, parameter_bytes


class HelixParallelStrategy(PipelineParallelStrategy):
    """HelixPipe over ``pipeline_parallel_size`` stages (x ``data_parallel_size`` replicas).

    Args:
        pipeline_parallel_size: stages; ``"auto"``: every device not used for dp.
        data_parallel_size: replicas (default 1).
        num_microbatches: micro-batches per batch, a multiple of ``pipeline_parallel_size * folds``
            (default: exactly that).
        folds: 2 (two-fold: one micro-batch's messages overlap the other's compute) or 1.
        adapter: a hand-written block adapter's name (``"nanogpt"``, ``"llama"``, ``"torch_encoder"``) or object;
            default: derived from the block (see :mod:`lightning_parallel.anatomy.resolve`).
        recompute: ``"no_attention"`` (default: param chunks recomputed, attention kept) or ``"none"``.
        mlp_chunks: run each block's MLP over this many sequence slices (default 2; 1 turns it off).
        **kwargs: ``loss_reduction``, ``trunk``, ``check_batches`` and the base strategy's arguments.
    """

    strategy_name = "helix"
    _cuts_blocks = True
    strategy_description = "lightning-parallel: HelixPipe attention-parallel pipeline (arXiv 2507.00394)"
    _block_whole_over = (DP, PP, SP, TP)  # every helix rank holds a block whole until it is split

    def __init__(
        self,
        pipeline_parallel_size: Size = "auto",
        data_parallel_size: Size = 1,
        num_microbatches: Optional[int] = None,
        folds: int = 2,
        adapter: Optional[Any] = None,
        recompute: Literal["no_attention", "none"] = "no_attention",
        mlp_chunks: int = 2,
        **kwargs: Any,
    ) -> None:
        if recompute not in ("no_attention", "none"):
            raise ValueError(
                f"helix recomputes everything but attention ('no_attention') or nothing ('none'); got {recompute!r}"
            )
        ignored = [k for k in ("schedule", "virtual_stages", "layers_per_stage") if k in kwargs]
        if ignored:
            raise ValueError(
                f"helix does not take {', '.join(ignored)}: it runs its own two-fold schedule (folds=) over every block"
                " of the trunk, one layer at a time across the stages, and recomputes 'no_attention' or nothing;"
                " use strategy='pipeline' for GPipe / 1F1B / interleaved schedules and stage layouts"
            )
        if folds not in (1, 2):
            raise ValueError(f"folds must be 1 or 2, got {folds!r}")
        if kwargs.get("recompute_offload"):
            raise ValueError(
                "helix with recompute_offload=True is not supported: its runtime keeps each layer's attention output"
                " for the backward itself; use strategy='pipeline' or 'sequence_parallel' for offloaded activations"
            )
        if kwargs.get("tp_sequence_parallel"):
            raise ValueError(
                "helix with tp_sequence_parallel=True is not supported: its stages exchange each layer's residual"
                " whole; use sequence_parallel_size= (Ulysses or ring inside each helix stage) to split the sequence"
            )
        super().__init__(
            pipeline_parallel_size=pipeline_parallel_size,
            data_parallel_size=data_parallel_size,
            num_microbatches=num_microbatches,
            schedule="1f1b",  # given here, so neither the signature nor LightningCLI offers the pipeline's schedules
            virtual_stages=None,
            layers_per_stage=None,
            mlp_chunks=mlp_chunks,
            adapter=adapter,
            **kwargs,
        )
        self._folds, self._helix_recompute = folds, recompute == "no_attention"
        self._splits: list[Any] = []  # each layer's verified split, once the first step has placed the model
        self._verdicts: list[Verdicts] = []  # each layer's call structures its split is verified on
        self._evaluating = False  # a validation, test or predict loop runs

    @property
    def num_microbatches(self) -> int:
        return self._settings.num_microbatches or self.parallel_dims.pp * self._folds

    @property
    def stage(self) -> int:
        return self.coordinate[PP]  # the loss chunk P_L runs on stage 0: global rank 0 holds the loss

    def stage_rank(self, stage: int) -> int:
        return _collectives.group_ranks(self.pp_group)[stage]

    @property
    def loss_stage(self) -> int:
        return 0

    @override
    def _check_balancing(self, spec: Any) -> None:
        """Helix runs every forward first (FILO), so the balancing loss needs no schedule; but its loss chunk runs
        without a graph under ``recompute="no_attention"`` (rebuilt in the backward), where the loss stage reads
        the loss's coefficient before any backward (:mod:`lightning_parallel.pipeline.balancing`); and its default
        MLP chunks call each router once per slice."""
        if self.parallel_dims.tp > 1:  # its split blocks call the routers' forwards without their modules' hooks
            raise ConfigurationError(
                f"{type(spec.module).__name__} has output_router_logits=True: helix x tensor parallelism does not"
                " compute its load-balancing loss (the split blocks call the routers without the hooks that sum"
                " them); use helix without tensor_parallel_size, PipelineParallelStrategy(schedule='gpipe'), or set"
                " output_router_logits=False in the model's config"
            )
        if self._helix_recompute or self._block_settings.mlp_chunks > 1:
            raise ConfigurationError(
                f"{type(spec.module).__name__} has output_router_logits=True: under helix its load-balancing loss needs"
                " recompute='none' and mlp_chunks=1 (with 'no_attention' the last layer's routers and the loss run"
                " without a graph until the backward, after the loss's gradient must be known; with MLP chunks each"
                " router runs once per slice); or set output_router_logits=False in the model's config"
            )

    @override
    def _validate_schedule(self) -> None:
        # the schedule needs the block count: it is built in setup; the micro-batch count is checked now
        p, m = self.parallel_dims.pp, self.num_microbatches
        if m % (p * self._folds):
            raise ValueError(
                f"helix needs num_microbatches ({m}) to be a multiple of pipeline_parallel_size x folds"
                f" ({p} x {self._folds} = {p * self._folds})"
            )

    @override
    def _place_stages(self, lm: Any, trunk: Trunk) -> tuple[list[tuple[int, nn.Module]], list[nn.Module]]:
        """Build the runtime; every rank keeps the whole model until the first step verifies the splits
        (so no block runs through the block layer: the runtime drives each block's split itself)."""
        dims = self.parallel_dims
        check_sizes(dims.pp, len(trunk), self.num_microbatches, self._folds)
        ranks = [self.stage_rank(s) for s in range(dims.pp)]
        self.runtime = HelixRuntime(
            trunk, [range(len(trunk))], self.stage, ranks, self.pp_lanes, self.root_device,
            folds=self._folds, recompute=self._helix_recompute,
        )  # fmt: skip
        self.runtime.splits = self._splits  # placed by an earlier fit with this strategy, or filled at the first step
        self.runtime.verdicts = self._verdicts
        self.schedule = helix(dims.pp, len(trunk), self.num_microbatches, self._folds)
        self._metrics = MetricStepper(lm, self.is_loss_stage)
        return [], []

    @override
    def _shared_over_pp(self, module: nn.Module) -> list[Tensor]:
        # every stage holds the whole model until the first step has split and placed the blocks
        if self._splits:
            return super()._shared_over_pp(module)
        tensors = module.state_dict(keep_vars=True).values()
        return [t for t in tensors if not t.is_meta and not self._outer.holds(t)]

    @override
    def _deferred_blocks(self, config: BlockConfig, trunk: Trunk, local: list[tuple[int, nn.Module]]) -> list[Any]:
        # each stage keeps a part of every block, known once the first step has verified its split: a deferred
        # block materialises then, one at a time (evaluation before it borrows each block for one call)
        return list(trunk.blocks)

    @override
    def _lends_pending(self) -> bool:
        # evaluation before the first step has split the blocks runs every block on every stage: each deferred
        # block is lent for its call and goes back to meta, until the first step materialises and splits it
        return self._evaluating and not self._splits

    @override
    def setup(self, trainer: Any) -> None:
        self._evaluating = False  # a loop that failed before its end left it on
        super().setup(trainer)

    @override
    def _evaluation_starts(self) -> None:
        super()._evaluation_starts()
        self._evaluating = True

    @override
    def _evaluation_ends(self) -> None:
        self._evaluating = False
        super()._evaluation_ends()

    @override
    def _placed(self, lm: Any, trunk: Trunk) -> None:
        self._attach_outer(lm, trunk)  # the placement is reported once the first step has split the blocks

    @override
    def _block_config(self) -> BlockConfig:
        # helix recomputes inside its runtime (param chunks under checkpoint); the MLP chunking is the split's
        return replace(super()._block_config(), recompute="none", split=True)

    @override
    def simulate_schedule(self, cost: Callable[[str, int], float]) -> Simulation:
        assert self.runtime is not None, "the schedule is built when training starts"
        L, m = self.runtime.num_layers, self.num_microbatches
        return simulate_helix(self.schedule, L, m, self._folds, lambda a: cost(a.kind, a.chunk))

    @override
    def _decide_at_first_step(self, step: Callable[[], Any]) -> None:
        if not self._splits:  # placed by an earlier fit with this strategy otherwise
            self._verify_and_place(step)
        super()._decide_at_first_step(step)

    def _verify_and_place(self, step: Callable[[], Any]) -> None:
        """Split every block at its attention call, verified on the first real micro-batch (``step``), then free
        what this stage does not run and drop it from the optimizers, block by block: a deferred block
        materialises just before, so no rank holds more than its share and one block whole."""
        lm, runtime = self.lightning_module, self.runtime
        assert lm is not None and runtime is not None
        with torch.random.fork_rng(), recording(lm, LogRecorder()), self.precision_plugin.train_step_context():
            cap = runtime.capture_step(step, probe=copy.deepcopy(runtime.trunk.blocks[0]).to("meta"))
        layer = self._blocks
        assert layer is not None
        for j, block in enumerate(runtime.trunk.blocks):  # one block whole at a time
            # the block layer shards it under tensor parallelism (the optimizers take the new parameters)
            runner = layer.commit(j, block, cap.trunk_input.detach(), *cap.block_args[j])
            self._splits.append(runner.stack)
            self._verdicts.append(runner.verdicts)
            drop_parameters(self.optimizers, place_block(j, block, self._splits[j], self.stage, self.parallel_dims.pp))
        layers = len(runtime.trunk)
        with self._outer.stored():  # what the stage stores: the outer part's shards
            nbytes = parameter_bytes(lm)
        self._report_placement(runtime.trunk.path, [range(j, j + 1) for j in range(layers)], nbytes)
