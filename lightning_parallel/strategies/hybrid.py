"""``HybridParallelStrategy``: the base every lightning-parallel strategy builds on.

It owns what all layouts share: the process group, the ``(dp, pp, sp, tp)`` device mesh
(:class:`~lightning_parallel.mesh.ParallelDims`), the sampler ranks (one replica = one dp rank),
reductions defaulting to the dp group, and gradient averaging over dp.

Data parallelism is done without ``DistributedDataParallel``: after the step's closure has run
(forward + backward, and for the pipeline the whole schedule) and before gradient clipping and the
optimizer step, the gradients are averaged over the dp group with one coalesced all-reduce per
dtype. The pipeline runtime calls blocks directly and moves gradients between buffers,
which DDP's autograd-hook reducer cannot follow; one explicit all-reduce at the step works for every
layout and, with gradient accumulation, runs once per optimizer step rather than per micro-batch.

Over 400 lines because it overrides the Lightning hooks every layout shares (set-up, the step, backward, the
optimizer step, reductions, the loops' starts and ends, teardown) and holds the constructor's argument reference;
the other hooks are grouped by concern in ``_processes``, ``_recipe``, ``_state`` and ``_dp_sharding``, and the
state lives in parts (docs/design.md, "Parts and hook groups") and :mod:`lightning_parallel.strategies.gradients`.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from datetime import timedelta
from typing import Any, Literal, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _sync_ddp_if_available,
)
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer
from typing_extensions import override

from lightning_parallel import _collectives, _p2p, watchdog
from lightning_parallel import partial as _partial
from lightning_parallel.anatomy.router_losses import over_the_batch
from lightning_parallel.blocks import BlockConfig, BlockLayer
from lightning_parallel.mesh import AXES, DP, SP, TP, ParallelDims, Size, check_size
from lightning_parallel.pipeline.capture import capture
from lightning_parallel.recompute import Policy
from lightning_parallel.strategies import _failures, _sharding, gradients
from lightning_parallel.strategies._dp_sharding import DataParallel, DataParallelShardingMixin
from lightning_parallel.strategies._experts import ExpertParallel
from lightning_parallel.strategies._head import ChunkedHeads
from lightning_parallel.strategies._logging import MetricStepper, TokenMeanLogs, recording
from lightning_parallel.strategies._optimizers import avoid_mixed_foreach, drop_parameters
from lightning_parallel.strategies._overlap import DEFAULT_BUCKET_CAP_MB
from lightning_parallel.strategies._pending import DeferredInit
from lightning_parallel.strategies._processes import ProcessesMixin, ProcessSettings
from lightning_parallel.strategies._recipe import SetupRecipeMixin
from lightning_parallel.strategies._sharding import Sharding
from lightning_parallel.strategies._stage_local import OuterShards
from lightning_parallel.strategies._state import StateMixin
from lightning_parallel.token_mean import CrossEntropyCalls, global_means, say_samples_once
from lightning_parallel.trunk import discover_trunk, materialised_to, packed_batch_note

log = logging.getLogger(__name__)

FIRST_STEP = "the first training step (its verification, placement and first messages included)"


def _blocks_of(module: LightningModule, path: Optional[str]) -> list[torch.nn.Module]:
    """The trunk's blocks, or none where the module has no trunk (data parallelism needs none)."""
    try:
        return discover_trunk(module, path).blocks
    except ValueError:
        return []


class HybridParallelStrategy(
    DataParallelShardingMixin,
    StateMixin,
    SetupRecipeMixin,
    ProcessesMixin,
    ParallelStrategy,
):
    """Data and tensor parallelism over a named ``(dp, pp, sp, tp)`` mesh; the base of the other strategies.

    Args:
        data_parallel_size: number of model replicas; ``"auto"`` uses the devices the other axes leave.
        tensor_parallel_size: shard every block's projections over this many ranks (Megatron-style, on
            DTensor; see :mod:`lightning_parallel.tensor_parallel`); ``"auto"`` uses the remaining devices.
        tp_plan: ``{"name pattern inside a block": "colwise" | "rowwise" | "colwise_qkv"}``; replaces the
            plan of a hand-written adapter or of the Hugging Face metadata, or shards the block for its own
            forward (which must then be shape-agnostic; verification checks it). Default: the anatomy's plan
            (derived from the traced graph where no adapter or metadata has one).
        vocabulary_parallel: under tensor parallelism, shard the token embedding and the heads of the
            vocabulary's width by vocabulary rows (:func:`lightning_parallel.tensor_parallel.shard_vocabulary`);
            ``False`` keeps them whole (needed where the step uses their weights outside their modules, e.g.
            ``x @ self.wte.weight.T``).
        tp_sequence_parallel: Megatron-style sequence parallelism between the tensor-parallel regions: norms,
            residuals and dropout on 1/tp of the sequence per rank (the sequence length must divide by tp).
        sequence_parallel_size: split every block's sequence over this many ranks (context parallelism;
            see :mod:`lightning_parallel.sequence_parallel`).
        sequence_parallel_mode: ``"ulysses"`` (all-to-all between sequence and heads; sp divides the heads)
            or ``"ring"`` (k/v passed around the ring, zig-zag balanced; causal or unmasked attention).
        adapter: a hand-written block adapter's name (``"nanogpt"``, ``"llama"``, ``"torch_encoder"``) or an object
            implementing :class:`~lightning_parallel.anatomy.BlockAdapter`; default: the block's anatomy is
            derived (hand-written adapters, Hugging Face metadata, the traced graph; see
            :mod:`lightning_parallel.anatomy.resolve`).
        process_group_backend: ``"gloo"``, ``"nccl"``...; default: nccl on CUDA, gloo on CPU.
        timeout: timeout of the process group's collectives.
        first_step_timeout: a bound on the first training step and on each block's verification
            (:mod:`lightning_parallel.watchdog`): a rank still in one after this long prints what it was doing and
            ends, and its peers follow, instead of every rank waiting for ``timeout``; ``None``: unbounded.
        recompute: activation recomputation of the trunk's blocks: ``"none"``, ``"full"``, ``"every_n"``,
            ``"selective"`` or ``"no_attention"`` (see :mod:`lightning_parallel.recompute`).
        recompute_every_n: with ``"every_n"``, blocks 0, n, 2n, ... are recomputed.
        mlp_chunks: run each block's MLP over this many slices of the sequence (1: off).
        recompute_offload: what the ``recompute`` policy keeps of a block (``"none"``: everything autograd saves;
            ``"selective"``, ``"no_attention"``: the kept ops' outputs) waits in host memory between the forward and
            the backward (pinned, copied on a side stream on CUDA; :mod:`lightning_parallel.offload`).
        trunk: dotted path of the container of repeated blocks (default: discovered).
        mlp_module: path of the MLP inside a block, where it is not found by name.
        attention_kernels: further ops (``"namespace::op"``) the ``no_attention`` / ``selective`` policies keep,
            for blocks whose attention runs a custom kernel.
        start_method: ``"popen"`` re-runs the script per rank (like ``ddp``); ``"fork"``/``"spawn"``
            start ranks with multiprocessing.
        data_parallel_sharding: ``"none"`` (every replica holds the optimizer state), ``"optimizer"``
            (ZeRO-1/2: optimizer state and reduced gradients split over the dp ranks, parameters whole; see
            :mod:`lightning_parallel.strategies._sharding`) or ``"full"`` (ZeRO-3 by torch's FSDP2: parameters
            too, gathered per block around its forward and backward, gradients reduce-scattered during the
            backward; not with tensor or sequence parallelism or helix; see
            :mod:`lightning_parallel.strategies._full_shard`).
        save_distributed_checkpoint: ``True``: a checkpoint is a ``torch.distributed.checkpoint`` directory (one
            shard per rank, resumable under any layout); ``False``: one plain Lightning ``.ckpt`` file written by
            rank 0 (what ``python -m lightning_parallel.export`` makes of a directory; loadable without this
            package).
        loss_chunks: compute the LM head (every ``nn.Linear`` outside the trunk of the vocabulary's width) and the
            step's ``F.cross_entropy`` of its logits over this many chunks of the tokens, never holding the whole
            logits (1: off; :mod:`lightning_parallel.chunked_loss`; under tensor parallelism vocabulary-parallel).
        configure_model_on_meta: ``True``: ``configure_model`` runs on the meta device (as under
            ``torch.device("meta")``), and set-up materialises on each rank only what it holds, initialised by
            each module's ``reset_parameters()`` (:mod:`lightning_parallel.materialize`); weights loaded there are
            refused (load them with :func:`lightning_parallel.load_pretrained` or ``ckpt_path=``). ``False``: it
            runs as on one device (every rank builds the whole model first).
        bucket_cap_mb: plain data parallelism averages the gradients in buckets of at most this many MiB, each
            issued as soon as the backward has produced it (overlapped with the rest of the backward, as DDP's
            buckets; :mod:`lightning_parallel.strategies._overlap`); 0: one average after the backward.
        expert_parallel_size: shard a mixture's experts over this many data- and sequence-parallel ranks (each
            holds ``num_experts / ep`` experts; tokens go to their experts' ranks and back by all-to-all, dropless;
            :mod:`lightning_parallel.expert_parallel`); must divide ``data_parallel_size x sequence_parallel_size``
            and the experts. Composes with the pipeline, helix, tensor and sequence parallelism and both
            ``data_parallel_sharding`` modes (each expert then cut over the ranks holding the same experts).
    """

    strategy_name = "hybrid"
    strategy_description = "lightning-parallel: data parallelism over a (dp, pp, sp, tp) device mesh"

    def __init__(
        self,
        data_parallel_size: Size = "auto",
        tensor_parallel_size: Size = 1,
        tp_plan: Optional[dict[str, str]] = None,
        tp_sequence_parallel: bool = False,
        vocabulary_parallel: bool = True,
        sequence_parallel_size: Size = 1,
        sequence_parallel_mode: Optional[Literal["ulysses", "ring"]] = None,
        adapter: Optional[Any] = None,
        accelerator: Optional[Any] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = timedelta(minutes=30),
        first_step_timeout: Optional[timedelta] = timedelta(minutes=15),
        recompute: Policy = "none",
        recompute_every_n: Optional[int] = None,
        mlp_chunks: int = 1,
        recompute_offload: bool = False,
        trunk: Optional[str] = None,
        mlp_module: Optional[str] = None,
        attention_kernels: tuple[str, ...] = (),
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        data_parallel_sharding: Sharding = "none",
        save_distributed_checkpoint: bool = True,
        loss_chunks: int = 1,
        configure_model_on_meta: bool = True,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        expert_parallel_size: int = 1,
    ) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)  # fmt: skip
        # the settings, each checked here: a bad one fails when the strategy is built, not at launch
        sizes = {DP: data_parallel_size, TP: tensor_parallel_size, SP: sequence_parallel_size}
        self._sizes: dict[str, Size] = {axis: check_size(axis, size) for axis, size in sizes.items()}
        if recompute_every_n is not None and recompute != "every_n":
            raise ValueError(f"recompute_every_n={recompute_every_n} applies to recompute='every_n' only"
                             f" (got recompute={recompute!r})")  # fmt: skip
        if sequence_parallel_size not in (1, "1") and tp_sequence_parallel:
            raise ValueError(
                f"sequence_parallel_size={sequence_parallel_size} already splits every block's sequence; it cannot be"
                " combined with tp_sequence_parallel=True (which splits it between the tensor-parallel regions)"
            )
        # what every block of this rank gets (the meshes are added at set-up: _block_config)
        self._block_settings = BlockConfig(
            tp_plan=tp_plan, tp_sequence_parallel=tp_sequence_parallel, sp_mode=sequence_parallel_mode or "ulysses",
            recompute=recompute, every_n=2 if recompute_every_n is None else recompute_every_n, mlp_chunks=mlp_chunks,
            offload=recompute_offload, mlp_module=mlp_module, attention_kernels=tuple(attention_kernels),
            adapter=adapter,
        )  # fmt: skip
        self._sp_mode_given = sequence_parallel_mode is not None  # refused at launch where sp resolves to 1
        self._dp = DataParallel(data_parallel_sharding, bucket_cap_mb)  # the mode, buckets, FSDP2 root, ZeRO chunks
        self._heads = ChunkedHeads(loss_chunks)
        self._experts = ExpertParallel(expert_parallel_size)  # the ep axis, split from dp x sp
        self._vocabulary_parallel, self._trunk_path = vocabulary_parallel, trunk
        self._configure_on_meta, self._save_distributed = configure_model_on_meta, save_distributed_checkpoint
        self._processes = ProcessSettings(process_group_backend, timeout, first_step_timeout, start_method)
        self._num_nodes = 1
        # what set-up and the steps fill in
        self._deferred = DeferredInit()  # configure_model's tape, the seed, the blocks pending until their first call
        self._blocks: Optional[BlockLayer] = None
        self._gradient_plan: Optional[gradients.GradientPlan] = None
        self._group_names: list[list[list[str]]] = []  # set with the optimizers (StateMixin.setup_optimizers)
        self._token_scale: Optional[Tensor] = None  # this replica's share of a token-mean step (token_mean.py)
        self._grad_scale: Optional[float] = None  # the pipeline's token-mean factor, applied after the buckets' means
        self._cache_off: list[str] = []  # modules whose Hugging Face KV cache set-up turned off
        self._first_step = True  # the first training batch is still to start (bounded by the watchdog)
        self._peers: Optional[list[Any]] = None  # every rank's host and pid, once the process group exists
        self._dims: Optional[ParallelDims] = None
        self._mesh: Optional[DeviceMesh] = None
        self._lanes: Optional[_p2p.Lanes] = None

    @override
    def setup(self, trainer: Trainer) -> None:
        lm = self.lightning_module
        assert self.accelerator is not None and self.model is not None and lm is not None
        self._check_module(lm)
        self._dp.shards, self._dp.reduced = {}, {}  # the optimizers are built anew below
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self._parallelize(lm)
        self._sync_module_states(self.model)
        self._fully_shard_built(lm)  # after the broadcast above: it would overwrite the shards
        self._shard_outer(lm)  # likewise (the pipeline strategies' parameters outside the trunk)
        self._shard_experts()  # likewise (each rank keeps its experts)
        if self._heads.on:
            self._heads.find(lm, self._blocks.trunk.blocks if self._blocks else _blocks_of(lm, self._trunk_path))
        for metric in MetricStepper(lm, False).metrics.values():
            metric.process_group = self.dp_group  # a replica's samples are counted once, never per pp/sp/tp rank
        if trainer.state.fn == "fit":
            self.setup_optimizers(trainer)
            if not self._deferred.drop_constructed_state():  # Adagrad's sum made on meta, not to be built again
                self.materialize_deferred()
                self.setup_optimizers(trainer)
            pending = {id(p) for b in self._deferred.blocks for p in b.parameters()}  # replaced when they materialise
            drop_parameters(self.optimizers, {id(p) for p in lm.parameters() if p.is_meta and id(p) not in pending})
            if self._sharded or self._fully_sharded:
                if getattr(self.precision_plugin, "precision", None) == "16-mixed":
                    raise ValueError(
                        f"precision='16-mixed' with data_parallel_sharding={self._dp.mode!r} is not supported:"
                        " each rank's"
                        " loss scaler would see only its chunk of the gradients and skip steps on its own; use"
                        " precision='bf16-mixed' or '32-true'"
                    )
                for opt in self.optimizers:
                    _sharding.check_optimizer(opt, self._dp.mode)
        self.setup_precision_plugin()
        if trainer.state.fn == "fit":
            self.states_to_device()  # Lightning's _optimizers_to_device, not for the blocks kept on the host
        self._gradient_plan = self._plan_gradients()
        # Lightning's clipping asks the precision plugin, which would see this rank's part of the model only
        self.precision_plugin.clip_grad_by_norm = (  # type: ignore[method-assign]
            lambda opt, clip_val: gradients.clip_norm_(opt, clip_val, self._gradient_plan, self._dp.shards)
        )
        self.precision_plugin.clip_grad_by_value = gradients.clip_value_  # type: ignore[method-assign]

    def _shard_experts(self) -> None:
        """Expert parallelism's experts of what this rank holds, sharded (at set-up, after the broadcast; then as
        each deferred block materialises: the optimizers take the new parameters)."""
        lm = self.lightning_module
        assert lm is not None
        if self._experts.shard(lm, self._replace_parameters) and self._gradient_plan is not None:
            self._gradient_plan = self._plan_gradients()

    def _plan_gradients(self) -> gradients.GradientPlan:
        """What :mod:`lightning_parallel.strategies.gradients` reduces over on this rank."""
        dims = self.parallel_dims
        groups = {axis: self._mesh.get_group(axis) for axis in AXES} if self._mesh is not None else {}
        mode = self._dp.mode if dims.dp > 1 and self._dp.mode in ("optimizer", "full") else "replicate"
        layouts = self._blocks.layouts if self._blocks is not None else None
        outer, experts = self._outer_gradients(), self._experts.layout
        return gradients.GradientPlan(dims, self.coordinate, groups, mode, layouts, outer, experts)

    def _outer_gradients(self) -> Optional[OuterShards]:
        """The pre/post-trunk parameters the pipeline strategies hold per stage (none here)."""
        return None

    # ---------------------------------------------------------------- training
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._before_first_call("training_step", args, kwargs)
        self._token_scale = None
        if self.parallel_dims.dp == 1:
            with self._explain_sharded_use(), self._heads.active(), over_the_batch(self._token_groups()):
                return super().training_step(*args, **kwargs)
        # data parallelism: a token-mean loss is weighted by each replica's share of the tokens (token_mean.py)
        lm = self.lightning_module
        with self._explain_sharded_use(), self._heads.active(), over_the_batch(self._token_groups()), \
                CrossEntropyCalls() as calls:  # fmt: skip
            with recording(lm, TokenMeanLogs(lm, calls.count_of)) as logs:
                output = super().training_step(*args, **kwargs)
        self._token_scale = self._replicas_token_mean(output, calls, logs.deferred)
        return output

    def _token_groups(self) -> list[tuple[Any, bool]]:
        """The groups whose ranks hold other tokens of the batch, and whether their gradients are summed: the
        sequence shards (summed), the replicas (averaged); a mixture's balancing loss is computed over all of
        them (:mod:`lightning_parallel.anatomy.router_losses`)."""
        dims = self.parallel_dims
        groups = [(self._mesh.get_group(SP), True)] if dims.sp > 1 else []
        return groups + ([(self._mesh.get_group(DP), False)] if dims.dp > 1 else [])

    def _replicas_token_mean(self, output: Any, calls: CrossEntropyCalls, deferred: list) -> Optional[Tensor]:
        """Log the deferred token-mean values as their mean over every replica's tokens; return the factor that
        makes this replica's loss its share of the batch's token sum (``replicas x count / all tokens``), or
        ``None`` where the loss is not a token mean (said once)."""
        loss = output if isinstance(output, Tensor) else output.get("loss") if isinstance(output, dict) else None
        count = calls.count_of(loss) if loss is not None else None
        if count is None and loss is not None:
            say_samples_once(f"{type(self).__name__} (data_parallel_size={self.parallel_dims.dp})")
        first = count if count is not None else torch.ones((), dtype=torch.float64)
        pairs = [(first, first), *((value.detach().to(torch.float64) * c, c) for _, value, _, c in deferred)]
        means, tokens = global_means(pairs, self.dp_group)  # one all-reduce on every replica, counted or not
        lm = self.lightning_module
        for (name, value, kwargs, _), mean in zip(deferred, means[1:]):
            type(lm).log(lm, name, mean.to(value.device, value.dtype), **kwargs)
        if count is None:
            return None
        return self.parallel_dims.dp * count.to(tokens.device) / tokens

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        if self._token_scale is not None:  # this replica's share of the batch's tokens
            closure_loss = closure_loss * self._token_scale.to(closure_loss.dtype)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        self._before_first_call("validation_step", args, kwargs)
        with self._heads.active(training=False):
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        self._before_first_call("test_step", args, kwargs)
        return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        self._before_first_call("predict_step", args, kwargs)
        return super().predict_step(*args, **kwargs)

    def _before_first_call(self, hook: str, args: tuple, kwargs: dict) -> None:
        """Full sharding above tensor or sequence parallelism: commit the blocks, then shard (once, before the
        first step or evaluation; :meth:`_commit_then_fully_shard`)."""
        if self._shards_after_commit and not self._dp.fsdp_root:
            step = getattr(self.lightning_module, hook)
            self._commit_then_fully_shard(self._capture_trunk, lambda: step(*args, **kwargs))

    def _capture_trunk(self, step: Callable[[], Any]) -> Any:
        """``step`` captured up to the trunk (:func:`lightning_parallel.pipeline.capture.capture`)."""
        trunk = self._blocks.trunk
        return capture(trunk, step, None, lambda: copy.deepcopy(trunk.blocks[0]).to("meta"))[0]

    @override
    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0) -> Any:
        note = packed_batch_note(batch, self._cache_off)
        if note is not None:
            rank_zero_warn(note)
            self._cache_off = []  # said once
        return super().batch_to_device(batch, device, dataloader_idx)

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union[LightningModule, torch.nn.Module]] = None,
        **kwargs: Any,
    ) -> Any:
        try:
            return self._optimizer_step(optimizer, closure, model, **kwargs)
        finally:
            watchdog.disarm()  # the first step is over (a later step is not bounded)

    def _optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union[LightningModule, torch.nn.Module]],
        **kwargs: Any,
    ) -> Any:
        def closure_then_sync() -> Any:
            out = closure()  # forward + backward of the step (or of the whole pipeline schedule)
            self._deferred.materialize()  # a deferred block this step never called: the optimizer steps real tensors
            self.sync_gradients(optimizer)  # before the precision plugin clips and steps
            avoid_mixed_foreach(optimizer)  # the closure runs inside optimizer.step, before its update
            return out

        if not self._sharded:
            return super().optimizer_step(optimizer, closure_then_sync, model, **kwargs)

        # sharded: after the gradients are reduced, the optimizer, its clipping and its update see this rank's
        # chunk of every parameter; leaving the window gathers the chunks (lightning_parallel.strategies._sharding)
        with ExitStack() as window:

            def closure_then_window() -> Any:
                out = closure_then_sync()
                window.enter_context(self._shards_of(optimizer).window(self._dp.reduced.pop(id(optimizer))))
                return out

            return super().optimizer_step(optimizer, closure_then_window, model, **kwargs)

    def sync_gradients(self, optimizer: Optimizer) -> None:
        """This optimizer's gradients as one device's (:func:`lightning_parallel.strategies.gradients.sync_`)."""
        scale, self._grad_scale = self._grad_scale, None
        step = gradients.StepGradients(
            self._gradient_buckets(optimizer),
            self._shards_of(optimizer) if self._sharded else None,
            scale,
            self.lightning_module,
        )
        reduced = gradients.sync_(optimizer, self._gradient_plan, step)
        if reduced is not None:
            self._dp.reduced[id(optimizer)] = reduced

    def grad_norm(self, norm_type: Union[float, str] = 2.0, group_separator: str = "/") -> dict[str, Tensor]:
        """Lightning's ``grad_norm(module, norm_type)`` for the whole model, not this rank's part: each
        parameter's gradient norm under its original name (tensor-parallel shards combined, the other
        pipeline stages' parameters included, replicated ones counted once) and the total, the same dict on
        every rank. A collective: call it on every rank, e.g.
        ``self.log_dict(self.trainer.strategy.grad_norm(2))`` in ``on_before_optimizer_step``. Not inside a
        sharded data-parallel step (the gradients are chunks there)."""
        if any(shards.open for shards in self._dp.shards.values()) or self._fully_sharded:
            raise RuntimeError(
                f"grad_norm() under data_parallel_sharding={self._dp.mode!r} is not supported: in"
                " on_before_optimizer_step each rank holds only its chunk of every gradient"
            )
        assert self.lightning_module is not None and self._gradient_plan is not None
        return gradients.norms(self._gradient_plan, self.lightning_module, norm_type, group_separator)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        watchdog.disarm()  # a first batch that stepped no optimizer ends its bound here
        if self._first_step:
            self._first_step = False
            watchdog.arm(FIRST_STEP)
        super().on_train_batch_start(batch, batch_idx)

    # -------------------------------------------------------------- collectives
    @override
    def reduce(
        self, tensor: Tensor, group: Optional[Any] = None, reduce_op: Optional[Union[dist.ReduceOp, str]] = "mean"
    ) -> Tensor:
        """Reduce over ``group``; by default over the dp group (the replicas), as logged values need."""
        if not isinstance(tensor, Tensor):
            return tensor
        return _sync_ddp_if_available(tensor, group if group is not None else self.dp_group, reduce_op=reduce_op)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        # A decision (stop, save) must be the same on every rank of every replica: reduce over the world.
        flag = torch.tensor(int(decision), device=self.root_device)
        total = _sync_ddp_if_available(flag, None, reduce_op="sum")
        return bool(total == self.world_size) if all else bool(total)

    @override
    def barrier(self, name: Optional[str] = None) -> None:
        if _distributed_is_initialized():
            _collectives.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        return _collectives.broadcast_object(obj, src, None)

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        super().pre_backward(closure_loss)
        self._prepare_buckets(closure_loss)

    @contextmanager
    def block_backward_sync(self) -> Any:
        # an accumulation step: gradients are averaged once per optimizer step (no bucket goes during it)
        buckets = self._dp.buckets
        if buckets is not None:
            buckets.accumulating = True
        try:
            yield None
        finally:
            if buckets is not None:
                buckets.accumulating = False

    @override
    def teardown(self) -> None:
        # Strategy.teardown calls lightning_module.cpu(), which can neither copy freed (meta) blocks nor swap
        # tensor-parallel DTensor parameters (the error it raised hid the real one after a failure)
        watchdog.disarm()
        lm = self.lightning_module
        if lm is not None:
            state = lm._trainer.state if lm._trainer is not None else None
            fit_done = state is not None and state.fn == "fit" and state.status == "running"
            if fit_done and any(t.is_meta for t in [*lm.parameters(), *lm.buffers()]):
                _partial.guard(lm, self._partial_message(lm))
            lm.cpu = lambda: materialised_to(lm, torch.device("cpu"))  # type: ignore[method-assign]
        self._mesh, self._lanes = None, None
        try:
            super().teardown()
        finally:
            if lm is not None:
                del lm.cpu

    def _partial_message(self, lm: LightningModule) -> str:
        """Why the module's ``state_dict()`` would be partial after a fit (:mod:`lightning_parallel.partial`)."""
        return (
            f"{type(lm).__name__} holds only its expert-parallel rank's experts on rank {self.global_rank} after"
            f" {self.strategy_name} training (the others are on the meta device), so its state_dict() would be"
            " partial. For the whole model call trainer.strategy.full_state_dict() on every rank (rank 0 receives"
            " it), or save a checkpoint (trainer.save_checkpoint(path))"
        )

    # ---------------------------------------------------------------- loop starts
    @override
    def on_train_start(self) -> None:
        self._check_materialized()
        _failures.stop_on_sigterm(self)
        super().on_train_start()

    @override
    def on_validation_start(self) -> None:  # Lightning's hooks of the three loops are no-ops: one body serves all
        self._evaluation_starts()

    on_test_start = on_predict_start = on_validation_start

    @override
    def on_validation_end(self) -> None:
        self._evaluation_ends()

    on_test_end = on_predict_end = on_validation_end

    def _evaluation_starts(self) -> None:
        """A validation, test or predict loop starts (the pipeline also gathers what evaluation needs)."""
        self._check_materialized()

    def _evaluation_ends(self) -> None:
        """A validation, test or predict loop ended."""
