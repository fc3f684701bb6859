"""Model and optimizer state for every strategy: sharded checkpoints by parameter name
(:mod:`lightning_parallel.checkpoint`), tensor-parallel shards converted to and from the original
layout, and the full model gathered by name (tests, export)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from typing import Any, Optional

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import ParallelStrategy
from torch import Tensor
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim import Optimizer

from lightning_parallel import _collectives, rng
from lightning_parallel import checkpoint as _checkpoint
from lightning_parallel.errors import CheckpointError
from lightning_parallel.strategies._pending import DeferredInit, OptimizerSource, Source
from lightning_parallel.tensor_parallel import TensorParallelLayout


class StateMixin(ParallelStrategy):
    """``HybridParallelStrategy``'s model and optimizer state hooks (typed against Lightning's base, which they
    override); ``_tp_layout`` is set when blocks are tensor-parallel."""

    _tp_layout: Optional[TensorParallelLayout]
    _group_names: list[list[list[str]]]  # per optimizer, its groups' full parameter names (set-up's)
    _save_distributed: bool
    _deferred: DeferredInit

    def materialize_deferred(self) -> None:
        """Deferred blocks still on meta get their values (:class:`DeferredInit`; eager ones kept on the host stay
        there, readable and writable): the methods below that read the model's values whole first call this (no
        collective)."""
        self._deferred.materialize(self._deferred.on_meta())

    def defer_restore(self, model: Optional[Source] = None, optimizer: Optional[OptimizerSource] = None) -> None:
        """Values loaded now for blocks still pending, read when each materialises
        (:meth:`DeferredInit.defer_restore`)."""
        self._deferred.defer_restore(model, optimizer)

    def pending_names(self) -> set[str]:
        """The LightningModule's state-dict names of the deferred (meta) pending blocks' tensors."""
        return self._deferred.names()

    def setup_optimizers(self, trainer: Trainer) -> None:
        super().setup_optimizers(trainer)
        lm = self.lightning_module
        # the full, ordered parameter names of every group, before a pipeline drops other stages' parameters
        self._group_names = [_checkpoint.group_names(lm, opt) for opt in self.optimizers]

    def _on_disk(self, name: str, value: Any) -> Any:
        """A tensor as the checkpoint holds it: DTensor shards stay shards (DCP writes each once), except a
        permuted fused projection, which is gathered back to its original order."""
        layout = self._tp_layout
        if layout is not None and isinstance(value, DTensor) and name in layout.permuted:
            return layout.to_full(name, value)
        return value

    def _in_memory(self, name: str, value: Any, like: Tensor) -> Any:
        """A tensor read from a checkpoint (whole, original order) placed like the parameter ``like``."""
        if isinstance(like, DTensor) and isinstance(value, Tensor) and value.shape == like.shape:
            if self._tp_layout is not None:
                return self._tp_layout.shard(name, value, like)
            value = value.to(device=like.device, dtype=like.dtype)  # a shard of full data parallelism (FSDP's)
            return distribute_tensor(value, like.device_mesh, like.placements, src_data_rank=None)
        return value

    def placed_like(self, name: str, value: Any, like: Tensor) -> Any:
        """A whole tensor (original order) placed like the model's tensor ``like`` of that name: the slice a
        DTensor shard holds (tensor-parallel permutation undone), anything else unchanged."""
        return self._in_memory(name, value, like)

    # ------------------------------------------------------------------------------- save
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """This rank's part of the model under the original names."""
        self.materialize_deferred()
        local = _checkpoint.local_state_dict(self.lightning_module)
        return {k: self._on_disk(k, v) for k, v in local.items()}

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        self.materialize_deferred()
        state = _checkpoint.optimizer_state_by_name(self.lightning_module, optimizer)
        state["state"] = {n: {k: self._on_disk(n, v) for k, v in s.items()} for n, s in state["state"].items()}
        return state

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} saves DCP directories; storage_options are not supported")
        names = self._group_names
        checkpoint = {  # each rank's generators (dropout masks after a resume): written by that rank
            **checkpoint,
            _checkpoint.RNG: {str(self.global_rank): rng.states(self.root_device)},
            "lp_rng_world_size": _collectives.world_size(),
        }
        if self._save_distributed:
            _checkpoint.save_sharded(checkpoint, filepath, names, self.is_global_zero)
            return
        # one consolidated file (like ModelParallelStrategy(save_distributed_checkpoint=False)): the shards are
        # written as usual next to it, then rank 0 reads them whole, writes the plain checkpoint atomically, and
        # removes them
        path = os.fspath(filepath)
        shards = path + ".shards"
        _checkpoint.save_sharded(checkpoint, shards, names, self.is_global_zero)
        error = None
        if self.is_global_zero:
            try:
                _checkpoint.export(shards, path + ".partial", weights_only=False)  # written just now, here
                os.replace(path + ".partial", path)
                shutil.rmtree(shards)
            except Exception as err:  # noqa: BLE001  (raised on every rank below, never on rank 0 alone)
                error = f"writing the consolidated checkpoint {path!r} failed: {type(err).__name__}: {err}"
        error = _collectives.broadcast_object(error, 0, None)
        if error is not None:
            raise CheckpointError(error)

    # ------------------------------------------------------------------------------- load
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        # restore into the placed, sharded, precision-converted model: each rank copies only what it holds,
        # and float64 values are not rounded through the float32 module the user built
        return True

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """A sharded directory (any layout) or a plain single-file Lightning checkpoint."""
        path = os.fspath(checkpoint_path)
        if os.path.isdir(path):
            lm = self.lightning_module
            held = [n for n, t in lm.state_dict(keep_vars=True).items() if not t.is_meta] if lm is not None else None
            # only what this rank holds is read; a block still pending (on meta) reads its keys when it
            # materialises (``lp_deferred``: the restore below registers the directory as its source)
            checkpoint = _checkpoint.load_sharded(path, held, weights_only)
            if self._deferred.blocks:
                checkpoint["lp_deferred"] = path
            return checkpoint
        self.materialize_deferred()  # a plain file is read whole: restored into the blocks whole
        return super().load_checkpoint(path, weights_only=weights_only)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        deferred = checkpoint.get("lp_deferred")
        if deferred is None:
            self.materialize_deferred()
        else:  # the pending blocks read their values from the directory when they materialise
            self.defer_restore(model=lambda names: _checkpoint.read_entries(deferred, names, 0)[0])
        lm = self.lightning_module
        state = checkpoint["state_dict"]
        if strict:
            present = checkpoint.get("lp_state_keys", state)  # a partial read lists every key it skipped too
            _checkpoint.check_state_dict(dict.fromkeys(present), lm.state_dict().keys(), type(lm).__name__)
        mine = lm.state_dict(keep_vars=True)
        plain = {}
        for name, value in state.items():
            target = mine.get(name)
            if target is None or target.is_meta:
                continue
            if isinstance(target, DTensor):
                with torch.no_grad():
                    target.to_local().copy_(self._in_memory(name, value, target).to_local())
            else:
                plain[name] = value
        lm.load_state_dict(plain, strict=False)
        self._restore_rng(checkpoint)

    def _restore_rng(self, checkpoint: Mapping[str, Any]) -> None:
        """This rank's default generators as they were at the save (:mod:`lightning_parallel.rng`), under the same
        number of processes only (another layout draws other numbers whatever the state)."""
        saved = checkpoint.get(_checkpoint.RNG) or {}
        mine = saved.get(str(self.global_rank))
        if mine is not None and checkpoint.get("lp_rng_world_size") == _collectives.world_size():
            rng.restore(mine, self.root_device)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Optimizer state by parameter name onto the parameters each rank's optimizer holds; a plain
        checkpoint's positional state is first named with the full groups of ``configure_optimizers``. The state
        of a block still pending is read from the directory when the block materialises."""
        deferred = checkpoint.get("lp_deferred")
        if deferred is None:
            self.materialize_deferred()
        lm, saved_states = self.lightning_module, checkpoint["optimizer_states"]
        optimizers = self.optimizers
        if len(saved_states) != len(optimizers):
            raise CheckpointError(
                f"the checkpoint holds {len(saved_states)} optimizer state(s), configure_optimizers returned"
                f" {len(optimizers)}"
            )
        params = dict(lm.named_parameters())
        for opt, saved, full in zip(optimizers, saved_states, self._group_names):
            if "lp_format" not in checkpoint:
                saved = _checkpoint.to_by_name(saved, full)
            state = {
                n: {k: self._in_memory(n, v, params[n]) for k, v in s.items()} if n in params else s
                for n, s in saved["state"].items()
            }
            opt.load_state_dict(_checkpoint.to_positional({**saved, "state": state}, _checkpoint.group_names(lm, opt)))
        if deferred is not None:
            count = len(saved_states)
            self.defer_restore(optimizer=lambda names: _checkpoint.read_entries(deferred, names, count)[1])

    # ------------------------------------------------------------------------------ gather
    def _full_local_parameters(self) -> dict[str, Tensor]:
        """This rank's materialised parameters, whole (tensor-parallel shards gathered: a collective)."""
        self.materialize_deferred()
        lm = self.lightning_module
        layout = self._tp_layout
        out = {}
        for name, p in lm.named_parameters():
            if p.is_meta:
                continue
            value = layout.to_full(name, p.detach()) if layout is not None else p.detach()
            value = value.full_tensor() if isinstance(value, DTensor) else value  # FSDP's shards
            out[name] = value.cpu().clone()
        return out

    def full_state_dict(self) -> dict[str, Tensor]:
        """The whole model's state dict by original name, on global rank 0 (``{}`` on the other ranks):
        tensor-parallel shards gathered, the blocks of other pipeline stages received. A collective: call it
        on every rank, e.g. after ``trainer.fit`` (the in-memory module then holds only this rank's part)."""
        from lightning_parallel.partial import partial_allowed

        self.materialize_deferred()
        lm, layout = self.lightning_module, self._tp_layout
        with partial_allowed():
            state = lm.state_dict()
        # one copy of each tensor is sent: from the ranks at dp, sp and tp coordinate 0 (every stage has one);
        # where each rank of an ep group holds its own experts, from every rank of the first group
        coordinate, experts = getattr(self, "coordinate", {}), self._experts.layout
        sends = all(coordinate.get(axis, 0) == 0 for axis in ("dp", "sp"))
        sends |= self._experts.holds_parts and experts is not None and experts.rank < experts.size
        sends &= coordinate.get("tp", 0) == 0
        local = {}
        for name, value in state.items():
            if torch.is_tensor(value) and value.is_meta:
                continue
            if isinstance(value, DTensor):
                value = layout.to_full(name, value) if layout is not None else value
                value = value.full_tensor() if isinstance(value, DTensor) else value  # (experts, FSDP's shards)
            local[name] = value.detach().cpu().clone() if torch.is_tensor(value) else value
        if not sends:
            local = {}
        parts = _collectives.gather_object_to_zero(local)
        if parts is None:
            return {}
        merged = {k: v for part in parts for k, v in part.items()}
        return {name: merged[name] for name in state if name in merged}

    def gather_named_parameters(self) -> dict[str, Tensor]:
        """Every parameter of the full model under its original name, as a detached copy, on every rank (a
        collective over the groups whose ranks hold different parts: each its own experts, its stage)."""
        lm = self.lightning_module
        merged = self._full_local_parameters()
        for group in self._part_groups():
            merged = {k: v for part in _collectives.all_gather_object(merged, group) for k, v in part.items()}
        return {n: merged[n] for n, _ in lm.named_parameters()}

    def _part_groups(self) -> list[Any]:
        """The groups whose ranks hold different parts of the model: the ep group where each rank keeps only
        its experts of a home-written mixture (the pipeline strategies add their stages')."""
        return [self._experts.layout.group] if self._experts.holds_parts and self._experts.layout else []
