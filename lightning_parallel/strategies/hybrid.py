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
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from datetime import timedelta
from typing import Any, Literal, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_parallel import _collectives
from lightning_parallel import recompute as recompute_lib
from lightning_parallel.anatomy.base import ConfigurationError
from lightning_parallel.anatomy.families import packed_batch_note, prepare_model
from lightning_parallel.blocks import BlockConfig, BlockLayer, Layouts
from lightning_parallel.materialize import check_set, materialize_
from lightning_parallel.mesh import DP, PP, SP, TP, ParallelDims, Size, check_size
from lightning_parallel.recompute import Policy
from lightning_parallel.sequence_parallel import MODES, SequenceParallelLayout
from lightning_parallel.strategies import _failures, _partial, _sharding
from lightning_parallel.strategies._dp_sharding import DataParallelShardingMixin
from lightning_parallel.strategies._full_shard import check_full
from lightning_parallel.strategies._head import ChunkedHeads
from lightning_parallel.strategies._logging import MetricStepper
from lightning_parallel.strategies._optimizers import Replaced, avoid_mixed_foreach, drop_parameters, replace_parameters
from lightning_parallel.strategies._pending import PendingBlocksMixin, pending_blocks
from lightning_parallel.strategies._sequence import SequenceParallelMixin
from lightning_parallel.strategies._sharding import Sharding, check_sharding
from lightning_parallel.strategies._state import StateMixin
from lightning_parallel.strategies._tensor import TensorParallelMixin
from lightning_parallel.tensor_parallel import TensorParallelLayout, local, shard_vocabulary
from lightning_parallel.trunk import Trunk, discover_trunk, materialised_to

log = logging.getLogger(__name__)

#: the exit code of a job stopped by SIGTERM, on every strategy (128 + the signal's number, as a shell reports it)
SIGTERM_EXIT_CODE = 128 + signal.SIGTERM


def _blocks_of(module: LightningModule, path: Optional[str]) -> list[torch.nn.Module]:
    """The trunk's blocks, or none where the module has no trunk (data parallelism needs none)."""
    try:
        return discover_trunk(module, path).blocks
    except ValueError:
        return []


class HybridParallelStrategy(
    PendingBlocksMixin,
    DataParallelShardingMixin,
    StateMixin,
    TensorParallelMixin,
    SequenceParallelMixin,
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
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        check_size(DP, data_parallel_size)  # fail at construction, not at launch
        check_size(TP, tensor_parallel_size)
        check_size(SP, sequence_parallel_size)
        self._given = {  # arguments that only mean something with another one: checked once the sizes are known
            "tp_plan": tp_plan is not None,
            "tp_sequence_parallel": bool(tp_sequence_parallel),
            "vocabulary_parallel": not vocabulary_parallel,
            "sequence_parallel_mode": sequence_parallel_mode is not None,
            "data_parallel_sharding": data_parallel_sharding != "none",
        }
        if recompute_every_n is not None and recompute != "every_n":
            raise ValueError(
                f"recompute_every_n={recompute_every_n} applies to recompute='every_n' only"
                f" (got recompute={recompute!r})"
            )
        recompute_every_n = 2 if recompute_every_n is None else recompute_every_n
        sequence_parallel_mode = sequence_parallel_mode or "ulysses"
        if sequence_parallel_mode not in MODES:
            raise ValueError(f"sequence_parallel_mode={sequence_parallel_mode!r}; choose one of {MODES}")
        if sequence_parallel_size not in (1, "1") and tp_sequence_parallel:
            raise ValueError(
                f"sequence_parallel_size={sequence_parallel_size} already splits every block's sequence; it cannot be"
                " combined with tp_sequence_parallel=True (which splits it between the tensor-parallel regions)"
            )
        recompute_lib.validate(recompute, recompute_every_n, mlp_chunks, recompute_offload)
        self._save_distributed = save_distributed_checkpoint
        self._vocabulary_parallel = vocabulary_parallel
        check_sharding(data_parallel_sharding)
        self._dp_sharding = data_parallel_sharding
        self._materialized: list[Any] = []  # deferred tensors created at set-up, checked when the loop starts
        self._check_due = False  # set by every rank's set-up: the check's collective runs on all of them
        self._pending: list[torch.nn.Module] = []  # deferred blocks held here, materialised at their first call
        self._pending_hooks: dict[int, list[Any]] = {}  # id(block) -> its hooks (materialise; lent: give back)
        self._borrowed: dict[int, list[Any]] = {}  # id(block) -> its meta tensors, while lent for one call
        self._constructed: set[tuple[int, int]] = set()  # (optimizer, pending parameter): state made at construction
        self._lent: dict[int, bool] = {}  # id(block) -> whether its next lend (helix evaluation) broadcasts
        self._host_data: dict[int, list[Any]] = {}  # id(block) -> its host memory while lent to the device
        self._sources: list[Any] = []  # values loaded while blocks were pending, read as each materialises
        self._optimizer_source: Optional[Any] = None  # likewise, restored optimizer state
        self._init_seed = 0  # rank 0's seed, which deferred initialisation uses
        self._fsdp_root: list[torch.nn.Module] = []  # data_parallel_sharding="full": the units' root, once applied
        self._shards: dict[int, _sharding.ShardedOptimizer] = {}  # id(optimizer) -> its chunks on this dp rank
        self._reduced: dict[int, dict[int, Tensor]] = {}  # id(optimizer) -> this step's reduced gradient chunks
        self._recompute = dict(
            recompute=recompute,
            every_n=recompute_every_n,
            mlp_chunks=mlp_chunks,
            offload=recompute_offload,
            mlp_module=mlp_module,
            attention_kernels=tuple(attention_kernels),
        )
        self._trunk_path = trunk
        self._sizes: dict[str, Size] = {
            "dp": data_parallel_size,
            "tp": tensor_parallel_size,
            "sp": sequence_parallel_size,
        }
        self._sp_mode = sequence_parallel_mode
        self._tp_plan, self._adapter_arg, self._tp_sequence_parallel = tp_plan, adapter, tp_sequence_parallel
        self._blocks: Optional[BlockLayer] = None
        self._cache_off: list[str] = []  # modules whose Hugging Face KV cache set-up turned off
        self._heads = ChunkedHeads(loss_chunks)
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._start_method = start_method
        self._num_nodes = 1
        self._dims: Optional[ParallelDims] = None
        self._mesh: Optional[DeviceMesh] = None

    # ----------------------------------------------------------------- topology
    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def is_distributed(self) -> bool:
        # Lightning asks custom strategies this to decide whether to inject a DistributedSampler
        return True

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def parallel_dims(self) -> ParallelDims:
        """The resolved layout; available once the Trainer has configured this strategy."""
        if self._dims is None:
            self._dims = ParallelDims.resolve(self.num_nodes * self.num_processes, **self._sizes)
        return self._dims

    @property
    def device_mesh(self) -> DeviceMesh:
        """The ``(dp, pp, sp, tp)`` mesh; available after ``setup_environment``."""
        if self._mesh is None:
            raise RuntimeError("the device mesh is built in `setup_environment`; it does not exist yet")
        return self._mesh

    @property
    def dp_group(self) -> Optional[dist.ProcessGroup]:
        return self._mesh.get_group(DP) if self._mesh is not None else None

    @property
    def pp_group(self) -> Optional[dist.ProcessGroup]:
        return self._mesh.get_group(PP) if self._mesh is not None else None

    @property
    def coordinate(self) -> dict[str, int]:
        """This rank's (dp, pp, sp, tp) coordinate."""
        return self.parallel_dims.coordinate(self.global_rank)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # every rank of one replica (all its pp/sp/tp ranks) must see the same batch
        return {"num_replicas": self.parallel_dims.dp, "rank": self.coordinate[DP]}

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)

    # ------------------------------------------------------------- environment
    @override
    def _configure_launcher(self) -> None:
        # Resolve (and so validate) the layout now, when the Trainer is built, before any process starts.
        self._dims = None
        dims = self.parallel_dims
        self._refuse_unused(dims)
        if self._dp_sharding == "full" and dims.dp > 1:
            check_full(self.strategy_name, dims.tp, dims.sp, self._cuts_blocks)
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            environment = self.cluster_environment
            self._launcher = _failures.NamingScriptLauncher(environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _MultiProcessingLauncher(self, start_method=self._start_method)

    def _refuse_unused(self, dims: ParallelDims) -> None:
        """Every argument given must take effect in the resolved layout (an ignored one is an error)."""
        needs = {
            "tp_plan": ("tensor_parallel_size", dims.tp),
            "tp_sequence_parallel": ("tensor_parallel_size", dims.tp),
            "vocabulary_parallel": ("tensor_parallel_size", dims.tp),
            "sequence_parallel_mode": ("sequence_parallel_size", dims.sp),
            "data_parallel_sharding": ("data_parallel_size", dims.dp),
        }
        for arg, (size_arg, size) in needs.items():
            if self._given.get(arg) and size == 1:
                raise ValueError(
                    f"{arg} was given, but {size_arg} resolves to 1 in the layout {dims}, so it would have no"
                    f" effect; set {size_arg} > 1 or drop {arg}"
                )

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        dims = self.parallel_dims  # validated before the first collective
        if self.cluster_environment is not None and self.cluster_environment.world_size() != dims.world_size:
            raise ValueError(
                f"the layout {dims} needs {dims.world_size} processes, but the cluster environment reports"
                f" world size {self.cluster_environment.world_size()}"
            )
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        self._process_group_backend = backend
        assert self.cluster_environment is not None
        _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout)
        self._mesh = dims.build_mesh(self.root_device.type)
        self._peers = _collectives.all_gather_object(_failures.whoami())  # to name a rank that dies

    @override
    def on_exception(self, exception: BaseException) -> None:
        """A connection error caused by a peer that died: say which, first (its traceback never comes)."""
        peers = getattr(self, "_peers", None)
        if peers and _failures.is_connection_failure(exception):
            line = _failures.dead_peers_line(peers, self.global_rank)
            if line:
                sys.stderr.write(line)
                sys.stderr.flush()
        else:
            _failures.mark_raised(peers, self.global_rank)
        if isinstance(exception, SIGTERMException):  # a SystemExit with no code: Lightning's jobs would exit 0
            exception.code = SIGTERM_EXIT_CODE
            if self.world_size > 1:  # leave now, as the pipeline does: an interpreter exit with the process
                # group's threads alive sometimes ends in std::terminate (exit -6 instead of 143)
                sys.stderr.write(f"[rank {self.global_rank}] stopped by SIGTERM (exit code {SIGTERM_EXIT_CODE})\n")
                sys.stderr.flush()
                sys.stdout.flush()
                os._exit(SIGTERM_EXIT_CODE)
        super().on_exception(exception)

    @override
    def setup(self, trainer: Trainer) -> None:
        lm = self.lightning_module
        assert self.accelerator is not None and self.model is not None and lm is not None
        self._check_module(lm)
        self._shards, self._reduced = {}, {}  # the optimizers are built anew below
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self._parallelize(lm)
        self._sync_module_states(self.model)
        self._fully_shard_built(lm)  # after the broadcast above: it would overwrite the shards
        self._shard_outer(lm)  # likewise (the pipeline strategies' parameters outside the trunk)
        if self._heads.on:
            self._heads.find(lm, self._blocks.trunk.blocks if self._blocks else _blocks_of(lm, self._trunk_path))
        for metric in MetricStepper(lm, False).metrics.values():
            metric.process_group = self.dp_group  # a replica's samples are counted once, never per pp/sp/tp rank
        if trainer.state.fn == "fit":
            self.setup_optimizers(trainer)
            self._drop_constructed_state(trainer)  # Adagrad's sum made on meta
            pending = {id(p) for b in self._pending for p in b.parameters()}  # replaced when they materialise
            drop_parameters(self.optimizers, {id(p) for p in lm.parameters() if p.is_meta and id(p) not in pending})
            if self._sharded or self._fully_sharded:
                if getattr(self.precision_plugin, "precision", None) == "16-mixed":
                    raise ValueError(
                        f"precision='16-mixed' with data_parallel_sharding={self._dp_sharding!r} is not supported:"
                        " each rank's"
                        " loss scaler would see only its chunk of the gradients and skip steps on its own; use"
                        " precision='bf16-mixed' or '32-true'"
                    )
                for opt in self.optimizers:
                    _sharding.check_optimizer(opt, self._dp_sharding)
        self.setup_precision_plugin()
        if trainer.state.fn == "fit":
            self.states_to_device()  # Lightning's _optimizers_to_device, not for the blocks kept on the host
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_global_norm  # type: ignore[method-assign]
        self.precision_plugin.clip_grad_by_value = self._clip_grad_by_value  # type: ignore[method-assign]

    def _check_module(self, lm: LightningModule) -> None:
        """Refuse what this strategy cannot run (before anything is placed)."""

    # ------------------------------------------------------------------------------ the recipe
    def _parallelize(self, lm: LightningModule) -> None:
        """The set-up recipe, once for every strategy: find the trunk, prepare the model family, place the
        stages (a hook: all blocks here), then give the blocks this rank runs their composed stack
        (:mod:`lightning_parallel.blocks`: tensor, sequence parallelism, chunked MLP, recomputation)."""
        _partial.unguard(lm)  # set up again after a fit: the module is whole to the strategy once more
        config = self._block_config()
        self._cache_off += prepare_model(lm)  # every layout trains the same model (anatomy/families.py)
        if not (config.needs_anatomy or config.recompute != "none" or config.offload or self._needs_trunk()):
            self.model_to_device()
            self._materialize(lm, [], None)
            return  # data parallelism alone: the model needs no trunk
        # fit, then validate/test/predict with the same strategy: the blocks are placed and composed already
        first = self._blocks is None
        trunk = self._blocks.trunk if self._blocks is not None else discover_trunk(lm, self._trunk_path)
        local, freed = self._place_stages(lm, trunk)
        if first:
            # blocks whose first call replaces their parameters (by shards, or by the stage's part of a split)
            # stay on meta, or on the host, until then (:meth:`materialize_pending`): set-up holds this rank's
            # share only
            self._pending = pending_blocks(lm, self._deferred_blocks(config, trunk, local), self.keeps_on_host())
        self.model_to_device()  # only what this rank holds: the other stages' blocks are freed already
        if first:
            vocabulary = config.tp_mesh is not None and self._vocabulary_parallel
            # vocabulary parallelism: a deferred embedding and head are sharded before the blocks materialise,
            # so set-up never holds the whole embedding and every block at once
            self._materialize(lm, [*freed, *self._pending, *(trunk.blocks if vocabulary else [])], trunk)
            if vocabulary:
                sharded = shard_vocabulary(lm, trunk.blocks, config.tp_mesh)
                rank_zero_info(f"vocabulary-parallel over tp={self.parallel_dims.tp}: {sharded or 'nothing'}")
                self._materialize(lm, [*freed, *self._pending], trunk)
            self._placed(lm, trunk)
            self._hook_pending()
            layer = BlockLayer(trunk, config, Layouts.for_config(config), on_replace=self._replace_parameters)
            self._blocks = layer.install(local)

    def _materialize(self, lm: LightningModule, freed: list[torch.nn.Module], trunk: Optional[Trunk]) -> None:
        """Deferred initialisation (:mod:`lightning_parallel.materialize`) of what this rank holds, seeded by
        rank 0's seed; whether every tensor got a value is checked when training or evaluation starts (after
        Lightning has restored any checkpoint). A failure on any rank is raised on every rank. Under full
        sharding a deferred model is materialised and sharded one unit at a time (a block, an embedding)."""
        message = None
        seed = self._init_seed = self._seed()
        try:
            self._fully_shard_deferred(lm, freed, trunk, seed)
            self._materialized.append(materialize_(lm, self.root_device, seed, skip=freed))
            self._check_due = True
        except Exception as err:  # noqa: BLE001  (raised on every rank below, never on one alone)
            message = f"deferred initialisation failed: {type(err).__name__}: {err}"
        self._raise_on_every_rank(message)

    def _check_materialized(self) -> None:
        if not self._check_due:  # the same on every rank (records can be added on one rank alone, e.g. a state
            return  # dict read on rank 0 materialising pending blocks)
        self._check_due = False
        message = None
        for record in self._materialized:
            message = message or check_set(record)
        self._materialized = []
        self._raise_on_every_rank(message)

    def _raise_on_every_rank(self, message: Optional[str]) -> None:
        messages = _collectives.all_gather_object(message)
        failed = [(r, m) for r, m in enumerate(messages) if m is not None]
        if failed:
            rank, text = failed[0]
            raise ConfigurationError(f"{text} (rank {rank})" if len({m for _, m in failed}) > 1 else text)

    def _seed(self) -> int:
        """Rank 0's seed (``seed_everything``'s, or the process's own): every rank initialises alike."""
        return int(_collectives.broadcast_object(torch.initial_seed(), 0, None))

    def _shard_outer(self, lm: LightningModule) -> None:
        """After the set-up broadcast, before the optimizers: the pipeline strategies store the parameters
        outside the trunk in shards over the stages (:mod:`lightning_parallel.strategies._stage_local`)."""

    def _placed(self, lm: LightningModule, trunk: Trunk) -> None:
        """After placement and materialisation, before the block layer (the pipeline reports its layout)."""

    def _needs_trunk(self) -> bool:
        return False

    def _place_stages(
        self, lm: LightningModule, trunk: Trunk
    ) -> tuple[list[tuple[int, torch.nn.Module]], list[torch.nn.Module]]:
        """The ``(index, block)`` pairs this rank runs through the block layer, and the blocks it freed
        (every block runs here, none is freed; the pipeline places stages)."""
        return list(enumerate(trunk.blocks)), []

    def _block_config(self) -> BlockConfig:
        dims, mesh = self.parallel_dims, self._mesh
        return BlockConfig(
            tp_mesh=mesh[TP] if dims.tp > 1 and mesh is not None else None,
            tp_plan=self._tp_plan,
            tp_sequence_parallel=self._tp_sequence_parallel,
            sp_mesh=mesh[SP] if dims.sp > 1 and mesh is not None else None,
            sp_mode=self._sp_mode,
            adapter=self._adapter_arg,
            **self._recompute,
        )

    @property
    def _tp_layout(self) -> Optional[TensorParallelLayout]:
        return self._blocks.layouts.tp if self._blocks is not None else None

    @property
    def _sp_layout(self) -> Optional[SequenceParallelLayout]:
        return self._blocks.layouts.sp if self._blocks is not None else None

    def _replace_parameters(self, replaced: Replaced) -> None:
        replace_parameters(self.optimizers, replaced, self._in_memory)

    def _sync_module_states(self, module: torch.nn.Module) -> None:
        """Make every rank start from the values of rank 0 for what they hold in common (as DDP does for
        replicas): a model initialised without a common seed differs between processes, and the sequence-
        and tensor-parallel ranks (before sharding) and the pipeline stages (the pre/post-trunk part) each
        compute with their own copy. Along dp, sp and tp everything is broadcast from coordinate 0 (tensor-
        parallel shards only along dp and sp); along pp what every stage holds (:meth:`_shared_over_pp`)."""
        if self._mesh is None:
            return
        host = self._host_tensors()  # eager blocks kept on the host: broadcast one at a time, below
        held = [t for t in module.state_dict(keep_vars=True).values() if t.device.type != "meta" and id(t) not in host]
        dims = self.parallel_dims
        for axis, size in ((DP, dims.dp), (SP, dims.sp), (TP, dims.tp)):
            if size > 1:
                # a DTensor is a shard along tp, and along dp under full sharding (FSDP's)
                sharded_along = axis == TP or (axis == DP and self._fully_sharded)
                tensors = [local(t.data) for t in held if not (sharded_along and isinstance(t, DTensor))]
                _collectives.broadcast_(tensors, self._mesh.get_group(axis))
        if dims.pp > 1:
            shared = [t for t in self._shared_over_pp(module) if id(t) not in host]
            _collectives.broadcast_([local(t.data) for t in shared], self.pp_group)
        self._sync_host_blocks()

    def _shared_over_pp(self, module: torch.nn.Module) -> list[Tensor]:
        """The tensors every pipeline stage holds: those outside the trunk's blocks."""
        if self._blocks is None:
            return []
        in_blocks = {id(t) for b in self._blocks.trunk.blocks for t in [*b.parameters(), *b.buffers()]}
        return [t for t in module.state_dict(keep_vars=True).values() if id(t) not in in_blocks and not t.is_meta]

    @override
    def model_to_device(self) -> None:
        """Move what is materialised: freed blocks, deferred (meta) tensors and the eager blocks kept on the host
        until their first call stay where they are."""
        assert self.model is not None
        materialised_to(self.model, self.root_device, skip=self._host_tensors())

    @contextmanager
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Any:
        """``Trainer.init_module(empty_init=True)`` builds on the meta device; set-up materialises and
        initialises only what each rank holds (:mod:`lightning_parallel.materialize`)."""
        if not empty_init:
            with super().tensor_init_context(empty_init):
                yield
            return
        with torch.device("meta"), self.precision_plugin.tensor_init_context():
            yield

    # ---------------------------------------------------------------- training
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._explain_sharded_use(), self._heads.active():
            return super().training_step(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._heads.active(training=False):
            return super().validation_step(*args, **kwargs)

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
        def closure_then_sync() -> Any:
            out = closure()  # forward + backward of the step (or of the whole pipeline schedule)
            self.materialize_pending()  # a deferred block this step never called: the optimizer steps real tensors
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
                window.enter_context(self._shards_of(optimizer).window(self._reduced.pop(id(optimizer))))
                return out

            return super().optimizer_step(optimizer, closure_then_window, model, **kwargs)

    def sync_gradients(self, optimizer: Optimizer) -> None:
        """Average this optimizer's gradients over the dp group (tensor-parallel shards: their local parts)."""
        self._materialize_gradients(optimizer)
        self._sum_sequence_gradients(optimizer)
        group, dp = self.dp_group, self.parallel_dims.dp
        if group is None or dp == 1:
            return
        self._average_over_dp(optimizer, group)

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

    @contextmanager
    def block_backward_sync(self) -> Any:
        # gradients are synchronised once per optimizer step, never during backward
        yield None

    @override
    def teardown(self) -> None:
        # Strategy.teardown calls lightning_module.cpu(), which can neither copy freed (meta) blocks nor swap
        # tensor-parallel DTensor parameters (the error it raised hid the real one after a failure)
        lm = self.lightning_module
        if lm is not None:
            lm.cpu = lambda: materialised_to(lm, torch.device("cpu"))  # type: ignore[method-assign]
        self._mesh = None
        try:
            super().teardown()
        finally:
            if lm is not None:
                del lm.cpu

    # ---------------------------------------------------------------- loop starts
    @override
    def on_train_start(self) -> None:
        self._check_materialized()
        _failures.stop_on_sigterm(self)
        super().on_train_start()

    @override
    def on_validation_start(self) -> None:
        self._evaluation_starts()
        super().on_validation_start()

    @override
    def on_validation_end(self) -> None:
        self._evaluation_ends()
        super().on_validation_end()

    @override
    def on_test_start(self) -> None:
        self._evaluation_starts()
        super().on_test_start()

    @override
    def on_test_end(self) -> None:
        self._evaluation_ends()
        super().on_test_end()

    @override
    def on_predict_start(self) -> None:
        self._evaluation_starts()
        super().on_predict_start()

    @override
    def on_predict_end(self) -> None:
        self._evaluation_ends()
        super().on_predict_end()

    def _evaluation_starts(self) -> None:
        """A validation, test or predict loop starts (the pipeline also gathers what evaluation needs)."""
        self._check_materialized()

    def _evaluation_ends(self) -> None:
        """A validation, test or predict loop ended."""

    @classmethod
    def register(cls) -> None:
        from lightning.pytorch.strategies import StrategyRegistry

        StrategyRegistry.register(cls.strategy_name, cls, description=cls.strategy_description, override=True)

    @classmethod
    def register_alias(cls, name: str, description: str, **defaults: Any) -> None:
        """Register ``name`` as this strategy with ``defaults`` for its arguments."""
        from lightning.pytorch.strategies import StrategyRegistry

        StrategyRegistry.register(name, cls, description=description, override=True, **defaults)
