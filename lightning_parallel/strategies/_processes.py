"""The processes of a lightning-parallel strategy: the resolved layout and its ``(dp, pp, sp, tp)`` mesh, this
rank's coordinate, the launcher, the process group, and what a failing or stopped rank says on the way out.

The layout is resolved and validated in ``_configure_launcher``, when the ``Trainer`` is built in the launching
process, so a bad layout fails before any process starts; it is checked again in ``setup_environment`` before
the process group exists. Every rank of one replica gets the same batch (``num_replicas = dp``).
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
)
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.distributed.device_mesh import DeviceMesh
from typing_extensions import override

from lightning_parallel import _collectives, _p2p, lightning_patches, watchdog
from lightning_parallel.mesh import AXES, DP, PP, ParallelDims
from lightning_parallel.strategies import _failures
from lightning_parallel.strategies._full_shard import check_full

#: the exit code of a job stopped by SIGTERM, on every strategy (128 + the signal's number, as a shell reports it)
SIGTERM_EXIT_CODE = 128 + signal.SIGTERM
START_METHODS = ("popen", "spawn", "fork", "forkserver")


@dataclass(frozen=True)
class ProcessSettings:
    """How the ranks start and talk (the constructor's ``process_group_backend``, ``timeout``,
    ``first_step_timeout``, ``start_method``), checked when the strategy is built."""

    backend: Optional[str] = None  # None: nccl on CUDA, gloo on CPU
    timeout: Optional[timedelta] = timedelta(minutes=30)
    first_step_timeout: Optional[timedelta] = timedelta(minutes=15)
    start_method: str = "popen"

    def __post_init__(self) -> None:
        if self.start_method not in START_METHODS:
            raise ValueError(f"start_method={self.start_method!r}; choose one of {START_METHODS}")


class ProcessesMixin(ParallelStrategy):
    """The layout, mesh, launcher and process group of :class:`~lightning_parallel.HybridParallelStrategy`
    (it sets ``_sizes``, ``_dims``, ``_mesh``, ``_num_nodes`` and ``_processes``, a :class:`ProcessSettings`, in its
    constructor)."""

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
    def pp_lanes(self) -> _p2p.Lanes:
        """The pipeline group's two point-to-point lanes (``_p2p.Lanes``), made with the mesh."""
        if self._lanes is None:
            raise RuntimeError("the pipeline's lanes are made in `setup_environment` when pipeline_parallel_size > 1")
        return self._lanes

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

    @override
    def _configure_launcher(self) -> None:
        # Resolve (and so validate) the layout now, when the Trainer is built, before any process starts.
        self._dims = None
        dims = self.parallel_dims
        self._refuse_unused(dims)
        if self._dp.mode == "full" and dims.dp > 1:
            check_full(self.strategy_name, self._cuts_blocks)
        self._experts.check(dims)
        assert self.cluster_environment is not None
        if self._processes.start_method == "popen":
            environment = self.cluster_environment
            self._launcher = _failures.NamingScriptLauncher(environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _MultiProcessingLauncher(self, start_method=self._processes.start_method)

    def _layout_line(self, dims: ParallelDims) -> str:
        """One line for the log: the sizes, and which sequence parallelism runs."""
        sizes = f"dp={dims.dp} pp={dims.pp} sp={dims.sp} tp={dims.tp} on {dims.world_size} processes"
        mode = self._block_settings.sp_mode  # type: ignore[attr-defined]
        if dims.sp > 1:
            what = "Ulysses (all-to-all, sp divides the heads)" if mode == "ulysses" else "ring attention (zig-zag)"
            sizes += f"; sequence parallelism: {what}"
        return sizes

    def _refuse_unused(self, dims: ParallelDims) -> None:
        """Every argument given must take effect in the resolved layout (an ignored one is an error)."""
        blocks = self._block_settings
        given = {  # argument: (whether given, the size argument it needs, that size)
            "tp_plan": (blocks.tp_plan is not None, "tensor_parallel_size", dims.tp),
            "tp_sequence_parallel": (blocks.tp_sequence_parallel, "tensor_parallel_size", dims.tp),
            "vocabulary_parallel": (not self._vocabulary_parallel, "tensor_parallel_size", dims.tp),
            "sequence_parallel_mode": (self._sp_mode_given, "sequence_parallel_size", dims.sp),
            "data_parallel_sharding": (self._dp.mode != "none", "data_parallel_size", dims.dp),
        }
        for arg, (is_given, size_arg, size) in given.items():
            if is_given and size == 1:
                raise ValueError(
                    f"{arg} was given, but {size_arg} resolves to 1 in the layout {dims}, so it would have no"
                    f" effect; set {size_arg} > 1 or drop {arg}"
                )

    @override
    def setup_environment(self) -> None:
        lightning_patches.install()  # before Lightning calls the callbacks' setup (ThroughputMonitor's)
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        dims = self.parallel_dims  # validated before the first collective
        if self.cluster_environment is not None and self.cluster_environment.world_size() != dims.world_size:
            raise ValueError(
                f"the layout {dims} needs {dims.world_size} processes, but the cluster environment reports"
                f" world size {self.cluster_environment.world_size()}"
            )
        backend = self._processes.backend or _get_default_process_group_backend_for_device(self.root_device)
        assert self.cluster_environment is not None
        _init_dist_connection(self.cluster_environment, backend, timeout=self._processes.timeout)
        self._mesh = dims.build_mesh(self.root_device.type)
        self._experts.connect(self._mesh, dims)
        rank_zero_info(f"lightning-parallel {self.strategy_name}: {self._layout_line(dims)}")
        self._lanes = None
        if dims.pp > 1:  # every rank makes every pipeline group's lanes
            grid = self._mesh.mesh.movedim(AXES.index(PP), -1).reshape(-1, dims.pp).tolist()
            self._lanes = _p2p.make_lanes(grid, self.pp_group)
        self._peers = _collectives.all_gather_object(_failures.whoami())  # to name a rank that dies
        bound = self._processes.first_step_timeout
        watchdog.configure(
            None if bound is None else bound.total_seconds(),
            self.global_rank,
            lambda: _failures.mark_raised(self._peers, self.global_rank),  # ended by its own hand, not killed
        )
        if self.local_rank == 0:
            _failures.remove_stale_markers()  # of jobs that ended (launched by torchrun, SLURM...)

    @override
    def on_exception(self, exception: BaseException) -> None:
        """A connection error caused by a peer that died: say which, first (its traceback never comes)."""
        watchdog.disarm()  # the error is reported from here on
        peers = self._peers
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
