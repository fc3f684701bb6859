"""``HybridParallelStrategy``: the base every lightning-parallel strategy builds on.

It owns what all layouts share: the process group, the ``(dp, pp, sp, tp)`` device mesh
(:class:`~lightning_parallel.mesh.ParallelDims`), the sampler ranks (one replica = one dp rank),
reductions defaulting to the dp group, and gradient averaging over dp.

Data parallelism is done without ``DistributedDataParallel``: after the step's closure has run
(forward + backward, and for the pipeline the whole schedule) and before gradient clipping and the
optimizer step, the gradients are averaged over the dp group with one coalesced all-reduce per
dtype. The pipeline runtime calls blocks directly and moves gradients between buffers (review C1),
which DDP's autograd-hook reducer cannot follow; one explicit all-reduce at the step works for every
layout and, with gradient accumulation, runs once per optimizer step rather than per micro-batch.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from contextlib import contextmanager
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
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer
from typing_extensions import override

from lightning_parallel import _collectives
from lightning_parallel import checkpoint as _checkpoint
from lightning_parallel import recompute as recompute_lib
from lightning_parallel.mesh import DP, PP, ParallelDims, Size, check_size
from lightning_parallel.recompute import Policy

log = logging.getLogger(__name__)


class HybridParallelStrategy(ParallelStrategy):
    """Data parallelism over a named ``(dp, pp, sp, tp)`` mesh; the base of the other strategies.

    Args:
        data_parallel_size: number of model replicas; ``"auto"`` uses every device.
        process_group_backend: ``"gloo"``, ``"nccl"``...; default: nccl on CUDA, gloo on CPU.
        timeout: timeout of the process group's collectives.
        recompute: activation recomputation of the trunk's blocks: ``"none"``, ``"full"``, ``"every_n"``,
            ``"selective"`` or ``"no_attention"`` (see :mod:`lightning_parallel.recompute`).
        recompute_every_n: with ``"every_n"``, blocks 0, n, 2n, ... are recomputed.
        mlp_chunks: run each block's MLP over this many slices of the sequence (1: off).
        trunk: dotted path of the container of repeated blocks (default: discovered).
        mlp_module: path of the MLP inside a block, where it is not found by name.
        attention_kernels: further ops (``"namespace::op"``) the ``no_attention`` / ``selective`` policies keep,
            for blocks whose attention runs a custom kernel.
        start_method: ``"popen"`` re-runs the script per rank (like ``ddp``); ``"fork"``/``"spawn"``
            start ranks with multiprocessing.
    """

    strategy_name = "hybrid"
    strategy_description = "lightning-parallel: data parallelism over a (dp, pp, sp, tp) device mesh"

    def __init__(
        self,
        data_parallel_size: Size = "auto",
        accelerator: Optional[Any] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = timedelta(minutes=30),
        recompute: Policy = "none",
        recompute_every_n: int = 2,
        mlp_chunks: int = 1,
        trunk: Optional[str] = None,
        mlp_module: Optional[str] = None,
        attention_kernels: tuple[str, ...] = (),
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        check_size(DP, data_parallel_size)  # fail at construction, not at launch
        recompute_lib.validate(recompute, recompute_every_n, mlp_chunks)
        self._recompute = dict(
            policy=recompute,
            every_n=recompute_every_n,
            mlp_chunks=mlp_chunks,
            mlp_module=mlp_module,
            attention_kernels=tuple(attention_kernels),
        )
        self._trunk_path = trunk
        self._sizes: dict[str, Size] = {"dp": data_parallel_size}
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
        _ = self.parallel_dims
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _MultiProcessingLauncher(self, start_method=self._start_method)

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

    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._apply_recompute(self.lightning_module)
        self._sync_module_states(self.model)
        if trainer.state.fn == "fit":
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == "fit":
            _optimizers_to_device(self.optimizers, self.root_device)

    def _apply_recompute(self, module: torch.nn.Module) -> None:
        """Recomputation wrappers (and MLP chunking) around the trunk's blocks, when asked for."""
        if self._recompute["policy"] != "none" or self._recompute["mlp_chunks"] > 1:
            recompute_lib.apply_recompute(module, trunk=self._trunk_path, **self._recompute)

    def _sync_module_states(self, module: torch.nn.Module) -> None:
        """Make every replica start from dp rank 0's parameters and buffers (as DDP does)."""
        group = self.dp_group
        if group is not None:
            tensors = [t.data for t in module.state_dict(keep_vars=True).values() if t.device.type != "meta"]
            _collectives.broadcast_(tensors, group)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def setup_optimizers(self, trainer: Trainer) -> None:
        super().setup_optimizers(trainer)
        lm = self.lightning_module
        # the full, ordered parameter names of every group, before a pipeline drops other stages' parameters
        self._group_names = [_checkpoint.group_names(lm, opt) for opt in self.optimizers]

    # ------------------------------------------------------------------------- checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """This rank's part of the model under the original names (see :mod:`lightning_parallel.checkpoint`)."""
        return _checkpoint.local_state_dict(self.lightning_module)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return _checkpoint.optimizer_state_by_name(self.lightning_module, optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError(
                f"{type(self).__name__} writes torch.distributed.checkpoint directories: no storage_options"
            )
        names = getattr(self, "_group_names", [])
        _checkpoint.save_sharded(checkpoint, filepath, names, self.is_global_zero)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """A sharded directory (any layout) or a plain single-file Lightning checkpoint."""
        path = os.fspath(checkpoint_path)
        if os.path.isdir(path):
            return _checkpoint.load_sharded(path)
        return super().load_checkpoint(path, weights_only=weights_only)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # restore into the placed, precision-converted model: each rank copies only the parameters it holds,
        # and float64 values are not rounded through the float32 module the user built
        return True

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        lm = self.lightning_module
        assert lm is not None
        state = checkpoint["state_dict"]
        if strict:
            _checkpoint.check_state_dict(state, lm.state_dict().keys(), type(lm).__name__)
        local = _checkpoint.local_state_dict(lm).keys()
        lm.load_state_dict({k: v for k, v in state.items() if k in local}, strict=False)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Optimizer state by parameter name onto the parameters each rank's optimizer holds; a plain
        checkpoint's positional state is first named with the full groups of ``configure_optimizers``."""
        lm, saved_states = self.lightning_module, checkpoint["optimizer_states"]
        if len(saved_states) != len(self.optimizers):
            raise _checkpoint.CheckpointError(
                f"the checkpoint holds {len(saved_states)} optimizer state(s), configure_optimizers returned"
                f" {len(self.optimizers)}"
            )
        for opt, saved, full in zip(self.optimizers, saved_states, self._group_names):
            if "lp_format" not in checkpoint:
                saved = _checkpoint.to_by_name(saved, full)
            opt.load_state_dict(_checkpoint.to_positional(saved, _checkpoint.group_names(lm, opt)))

    # ---------------------------------------------------------------- training
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
            self.sync_gradients(optimizer)  # before the precision plugin clips and steps
            return out

        return super().optimizer_step(optimizer, closure_then_sync, model, **kwargs)

    def sync_gradients(self, optimizer: Optimizer) -> None:
        """Average this optimizer's gradients over the dp group."""
        group = self.dp_group
        if group is None or self.parallel_dims.dp == 1:
            return
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        _collectives.all_reduce_mean_(grads, group)

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

    # ------------------------------------------------------------------- state
    def gather_named_parameters(self) -> dict[str, Tensor]:
        """Every parameter of the full model under its original name, as a detached copy.

        Under data parallelism every rank holds the whole model; model-parallel layouts gather.
        """
        assert self.lightning_module is not None
        return {name: p.detach().clone() for name, p in self.lightning_module.named_parameters()}

    @override
    def teardown(self) -> None:
        self._mesh = None
        super().teardown()

    @classmethod
    def register(cls) -> None:
        from lightning.pytorch.strategies import StrategyRegistry

        StrategyRegistry.register(cls.strategy_name, cls, description=cls.strategy_description, override=True)
