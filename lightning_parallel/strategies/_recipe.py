"""The set-up recipe of every lightning-parallel strategy, once: find the trunk, prepare the model family, place
the stages (a hook: the pipeline strategies place them, data parallelism runs every block here), move what
this rank holds to the device, materialise the rest (deferred initialisation), then give the blocks this rank
runs their composed stack (:mod:`lightning_parallel.blocks`). Also: rank 0's values broadcast to the ranks that
hold a tensor in common, and an error raised on every rank alike (docs/design.md, "Deferred initialisation").
"""

from __future__ import annotations

import warnings
from collections.abc import MutableMapping
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Optional

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities import rank_zero_info
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_parallel import _collectives
from lightning_parallel import partial as _partial
from lightning_parallel.blocks import BlockConfig, BlockLayer, Layouts
from lightning_parallel.errors import ConfigurationError
from lightning_parallel.init_replay import InitTape, generator
from lightning_parallel.materialize import check_set, materialize_
from lightning_parallel.mesh import DP, SP, TP
from lightning_parallel.strategies._optimizers import Replaced, replace_parameters
from lightning_parallel.strategies._pending import Holder, pending_blocks
from lightning_parallel.tensor_parallel import TensorParallelLayout, local, shard_vocabulary
from lightning_parallel.trunk import Trunk, discover_trunk, materialised_to, prepare_model

_LOADED_ON_META = (
    "configure_model runs on the meta device under lightning-parallel's strategies (each rank then materialises"
    " only what it holds), so weights loaded there by {what} would be lost. Build the model there without weights"
    " (e.g. AutoModelForCausalLM.from_config) and load them after set-up with"
    " lightning_parallel.load_pretrained(self.model, directory, self.trainer) in on_fit_start (each rank reads"
    " its share), or restore a checkpoint with ckpt_path=; or pass configure_model_on_meta=False to the strategy"
    " (every rank then builds and loads the whole model in configure_model)"
)


def sharded_along(t: Tensor, axis: str) -> bool:
    """Whether ``t`` is a DTensor cut along the mesh axis ``axis`` (alone, or flattened with another: dp_pp)."""
    if not isinstance(t, DTensor):
        return False
    names = t.device_mesh.mesh_dim_names or ()
    return any(axis in n.split("_") and not p.is_replicate() for n, p in zip(names, t.placements))


class SetupRecipeMixin(ParallelStrategy):
    """The set-up recipe of :class:`~lightning_parallel.HybridParallelStrategy` (module docstring); the pipeline
    strategies override its hooks ``_place_stages``, ``_placed``, ``_shard_outer`` and ``_needs_trunk``."""

    def _check_module(self, lm: LightningModule) -> None:
        """Refuse what this strategy cannot run (before anything is placed)."""

    def _parallelize(self, lm: LightningModule) -> None:
        """The set-up recipe, once for every strategy: find the trunk, prepare the model family, place the
        stages (a hook: all blocks here), then give the blocks this rank runs their composed stack
        (:mod:`lightning_parallel.blocks`: tensor, sequence parallelism, chunked MLP, recomputation)."""
        _partial.unguard(lm)  # set up again after a fit: the module is whole to the strategy once more
        config = self._block_config()
        self._cache_off += prepare_model(lm)  # every layout trains the same model (trunk.py)
        if not (config.needs_anatomy or config.recompute != "none" or config.offload or self._needs_trunk()):
            self.model_to_device()
            self._materialize(lm, self._experts.elsewhere_modules, None)
            return  # data parallelism alone: the model needs no trunk
        # fit, then validate/test/predict with the same strategy: the blocks are placed and composed already
        first = self._blocks is None
        trunk = self._blocks.trunk if self._blocks is not None else discover_trunk(lm, self._trunk_path)
        if first and config.tp > 1:  # what the model's config says, before anything is placed (every rank alike)
            check_config_heads(trunk.blocks[0], config.tp, config.sp if config.sp_mode == "ulysses" else 1)
        local, freed = self._place_stages(lm, trunk)
        if first:
            # blocks whose first call replaces their parameters (by shards, or by the stage's part of a split)
            # stay on meta, or on the host, until then (strategies/_pending.py): set-up holds this rank's share
            # (a block with a runner materialises when the block layer commits it; the others at their first call)
            blocks = pending_blocks(lm, self._deferred_blocks(config, trunk, local), self.keeps_on_host())
            holder = Holder(lm, self.root_device, lambda: self._mesh, self._block_whole_over, lambda: self.optimizers,
                            self._replace_parameters, self._materialize_at_first_call, self._lends_pending,
                            self._shard_experts)  # fmt: skip
            self._deferred.hold(blocks, holder, runners=[b for _, b in local])
        self.model_to_device()  # only what this rank holds: the other stages' blocks are freed already
        if first:
            vocabulary = config.tp_mesh is not None and self._vocabulary_parallel
            # vocabulary parallelism: a deferred embedding and head are sharded before the blocks materialise,
            # so set-up never holds the whole embedding and every block at once
            kept = [*freed, *self._deferred.blocks, *self._experts.elsewhere_modules]  # (other ranks' experts: a fit's)
            self._materialize(lm, [*kept, *(trunk.blocks if vocabulary else [])], trunk)
            if vocabulary:
                sharded = shard_vocabulary(lm, trunk.blocks, config.tp_mesh)
                rank_zero_info(f"vocabulary-parallel over tp={self.parallel_dims.tp}: {sharded or 'nothing'}")
                self._materialize(lm, [*freed, *self._deferred.blocks], trunk)
            self._placed(lm, trunk)
            layer = BlockLayer(trunk, config, Layouts.for_config(config), on_replace=self._replace_parameters,
                               before_commit=self._materialize_at_first_call)  # fmt: skip
            self._blocks = layer.install(local)

    def _materialize(self, lm: LightningModule, freed: list[torch.nn.Module], trunk: Optional[Trunk]) -> None:
        """Deferred initialisation (:mod:`lightning_parallel.materialize`) of what this rank holds, seeded by
        rank 0's seed; whether every tensor got a value is checked when training or evaluation starts (after
        Lightning has restored any checkpoint). A failure on any rank is raised on every rank. Under full
        sharding a deferred model is materialised and sharded one unit at a time (a block, an embedding)."""
        message = None
        deferred = self._deferred
        seed = deferred.seed = self._seed()
        try:
            self._fully_shard_deferred(lm, freed, trunk, seed)
            deferred.unchecked.append(materialize_(lm, self.root_device, seed, skip=freed, tape=deferred.tape))
            deferred.check_due = True
        except Exception as err:  # noqa: BLE001  (raised on every rank below, never on one alone)
            message = f"deferred initialisation failed: {type(err).__name__}: {err}"
        self._raise_on_every_rank(message)

    def _check_materialized(self) -> None:
        deferred = self._deferred
        if not deferred.check_due:  # the same on every rank (records can be added on one rank alone, e.g. a state
            return  # dict read on rank 0 materialising pending blocks)
        deferred.check_due = False
        message = None
        for record in deferred.unchecked:
            message = message or check_set(record)
        deferred.unchecked = []
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

    _block_whole_over: tuple[str, ...] = (DP, SP, TP)  # the mesh axes whose ranks hold a pending block whole

    def keeps_on_host(self) -> bool:
        """Whether eager blocks stay in host memory until their first call: where the device is not the host."""
        return self.root_device.type != "cpu"

    def _deferred_blocks(
        self, config: BlockConfig, trunk: Trunk, local: list[tuple[int, torch.nn.Module]]
    ) -> list[torch.nn.Module]:
        """The blocks of a deferred model materialised at their first call, not at set-up: tensor parallelism
        shards a block only once its first call has verified the stack, so materialising every block at set-up
        would hold them all whole."""
        return [b for _, b in local] if config.tp_mesh is not None or self._shards_after_commit else []

    def _materialize_at_first_call(self, block: torch.nn.Module) -> None:
        """What a pending block's first call runs: the block layer calls it just before it commits the block
        (``before_commit``); HelixPipe's blocks, which have no runner, through a forward pre-hook."""
        self._deferred.first_call(block)

    def _lends_pending(self) -> bool:
        """Whether a pending block called now is lent (materialised for this call only) rather than kept: helix
        evaluating before its first step has split the blocks (every stage runs every block then)."""
        return False

    def states_to_device(self) -> None:
        """Lightning's ``_optimizers_to_device`` at set-up, except for the parameters kept on the host (their
        state, e.g. built at construction, moves with them at their first call)."""
        host, device = self._deferred.host_tensors(), self.root_device
        for opt in self.optimizers:
            for p, state in opt.state.items():
                if id(p) in host:
                    continue
                if not isinstance(state, MutableMapping):  # a custom optimizer's state
                    opt.state[p] = apply_to_collection(state, torch.Tensor, move_data_to_device, device)
                    continue
                for key, value in state.items():
                    if key != "step":  # torch keeps a non-fused, non-capturable step on the host
                        state[key] = move_data_to_device(value, device)

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
        """The strategy's block settings with this rank's tensor- and sequence-parallel meshes."""
        dims, mesh = self.parallel_dims, self._mesh
        return replace(
            self._block_settings,
            tp_mesh=mesh[TP] if dims.tp > 1 and mesh is not None else None,
            sp_mesh=mesh[SP] if dims.sp > 1 and mesh is not None else None,
        )

    @property
    def _tp_layout(self) -> Optional[TensorParallelLayout]:
        return self._blocks.layouts.tp if self._blocks is not None else None

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
        host = self._deferred.host_tensors()  # eager blocks kept on the host: broadcast one at a time, below
        # a home-written mixture cut by an earlier set-up: each rank of an ep group holds other experts
        own = {id(p) for p in self._experts.layout.params} if self._experts.layout is not None else set()
        held = [t for t in module.state_dict(keep_vars=True).values()
                if t.device.type != "meta" and id(t) not in host and id(t) not in own]  # fmt: skip
        dims = self.parallel_dims
        for axis, size in ((DP, dims.dp), (SP, dims.sp), (TP, dims.tp)):
            if size > 1:
                # a shard along the axis (tensor parallelism's along tp, FSDP's along dp) stays as it is
                tensors = [local(t.data) for t in held if not sharded_along(t, axis)]
                _collectives.broadcast_(tensors, self._mesh.get_group(axis))
        if dims.pp > 1:
            shared = [t for t in self._shared_over_pp(module) if id(t) not in host]
            _collectives.broadcast_([local(t.data) for t in shared], self.pp_group)
        self._deferred.sync_host_blocks()

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
        materialised_to(self.model, self.root_device, skip=self._deferred.host_tensors())

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

    @contextmanager
    def model_sharded_context(self) -> Any:
        """Around ``configure_model``: the meta device (unless ``configure_model_on_meta=False``), so a module
        built there without any device context never exists whole; set-up materialises each rank's share.
        The calls that compute values there (constructors' resets, the model's own initialisation) are recorded
        (:class:`~lightning_parallel.init_replay.InitTape`) and replayed per tensor as each rank materialises its
        share: the values one process's eager ``configure_model`` gives, from rank 0's generator state.
        Weights loaded there would be lost on meta, so a load is refused, naming the ways that work:
        transformers' ``from_pretrained`` raises under a meta device (said here again with them), and a
        ``load_state_dict`` into meta parameters (torch warns that it is a no-op) is turned into the error. Every
        rank runs the same ``configure_model``, so every rank raises the same error, before any collective."""
        if not self._configure_on_meta:
            yield
            return
        start = generator(self.root_device).get_state()
        with torch.device("meta"), warnings.catch_warnings(record=True) as caught, InitTape(self.root_device) as tape:
            warnings.simplefilter("always")
            try:
                yield
            except RuntimeError as err:
                if "from_pretrained" in str(err) and "meta" in str(err):
                    raise ConfigurationError(_LOADED_ON_META.format(what="from_pretrained")) from err
                raise
        lost = [w for w in caught if "is a no-op" in str(w.message) and "meta" in str(w.message)]
        for w in caught:
            if w not in lost:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        if lost:
            raise ConfigurationError(_LOADED_ON_META.format(what="load_state_dict"))
        if tape.calls:  # (a configure_model called again after a fit builds nothing: the first tape stays)
            if _collectives.world_size() > 1:  # every rank replays from rank 0's state, as one process would
                start = _collectives.broadcast_object(start, 0, None)  # type: ignore[assignment]
            tape.close(self.root_device, start)
            self._deferred.tape = tape


def check_config_heads(block: torch.nn.Module, tp: int, ulysses: int) -> None:
    """Refuse head counts tensor parallelism (and Ulysses inside it) cannot split, where the block's Hugging Face
    config states them: at set-up, before any block is placed, instead of at the first step's verification."""
    from lightning_parallel.anatomy.hf_config import stated_heads
    from lightning_parallel.sequence_parallel import check_heads as check_sequence_heads
    from lightning_parallel.tensor_parallel import check_heads

    heads = stated_heads(block)
    if heads is not None:
        check_heads(block, heads, tp)
        check_sequence_heads(*heads, ulysses, "ulysses", type(block).__name__, tp)
