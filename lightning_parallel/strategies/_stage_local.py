"""Pre- and post-trunk parameters under the pipeline strategies (``pipeline``, ``helix``): stored in shards
over the stages, whole only where and while a step runs them (docs/design.md, "Where each parameter lives").

At set-up (:meth:`StageLocalMixin._shard_outer`) every parameter outside the trunk (plain, not 0-dim) is
*stored* cut in dim 0 over the pipeline stages (over dp x pp under ``data_parallel_sharding="full"``): a
``DTensor`` parameter, ``Shard(0)`` on that mesh, which the optimizer holds and steps, so parameters,
gradients and optimizer state per rank are ``1 / pp`` of them. This is ZeRO stage 3 (Rajbhandari et al.,
2020, arXiv 1910.02054) over the stages for the parameters outside the trunk, gathered once per step
rather than once per use. At the first training step (:meth:`StageLocalMixin._place_outer`) the strategy
finds which of them the step uses before the trunk and after it (:func:`lightning_parallel.pipeline.outer.touched`):
the first stage (which runs chunk 0) runs the pre-trunk ones, the loss stage the post-trunk ones, both a
parameter both parts use (a tied embedding and head); one the step does not use, and every one when a
block's side argument is computed from one (the blocks need the values everywhere), runs on every stage.

1. a training step starts: the ranks whose stage runs a sharded parameter gather it whole (one gather
   each; an all-gather when every rank runs it) and put it in the module (a plain parameter, so the
   user's code runs unchanged); the others only send their shard and hold a ``meta`` one, a stride-0 NaN
   placeholder while the schedule runs (:func:`outer.placeholders`);
2. after the schedule (and any gradient accumulation), ``sync_gradients`` reduces the gradient onto the
   shards over the same mesh (one scatter from each running rank, summed; a reduce-scatter when every
   rank ran it): the sum over the stages that used the parameter (a tied pair's two halves) and, over
   dp, the mean; the module gets the shard back with that gradient, so clipping and the optimizer see
   shards only;
3. an evaluation loop runs the user's code on every stage in lock-step: its start gathers every sharded
   parameter on every stage, its end puts the shards back.

Whole on every stage, the gradient summed over the pipeline group: 0-dim (and 0-row) parameters, and
parameters that are DTensors already (vocabulary-parallel ones under tensor parallelism).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

from lightning_parallel import _collectives
from lightning_parallel.anatomy.families import no_fast_paths
from lightning_parallel.mesh import DP, PP
from lightning_parallel.pipeline import outer
from lightning_parallel.strategies import gradients
from lightning_parallel.strategies._logging import LogRecorder, recording, restore_metrics, snapshot_metrics


@dataclass
class ShardedOuter:
    """One pre/post-trunk parameter stored in shards (a tied pair is one, under all its names)."""

    names: tuple[str, ...]
    holders: frozenset[int]  # the stages whose training step runs it (every stage until the first step decides)
    shard: nn.Parameter  # the DTensor parameter: the optimizer's; the module's between steps


class StageLocalMixin:
    """Mixed into ``PipelineParallelStrategy``; needs its ``runtime``, ``stage``, ``loss_stage``, ``pp_group``,
    ``_replicated_names`` and ``_metrics``."""

    _sharded_outer: list[ShardedOuter]
    _outer_decided: bool
    _outer_state: str  # "rest": the module holds the shards; "step": a step's tensors; "eval": every stage's whole
    _freed_outer: list[nn.Parameter]  # in "step": the meta parameters of the stages that do not use them

    def _init_stage_local(self) -> None:
        self._sharded_outer, self._outer_decided, self._outer_state, self._freed_outer = [], False, "rest", []
        self._outer_mesh_of: Optional[tuple[Any, DeviceMesh]] = None
        self._stage_of_rank: dict[int, list[tuple[int, int]]] = {}  # id(mesh group) -> (global rank, its stage)

    @property
    def first_stage(self) -> int:
        """The stage that runs chunk 0, and so the pre-trunk code whose values matter."""
        return 0

    @property
    def outer_placement(self) -> dict[str, tuple[int, ...]]:
        """Each sharded pre/post-trunk parameter's name -> the stages that hold it whole during a training step
        (every stage stores ``1 / pp`` of it); parameters not listed are whole on every stage."""
        return {n: tuple(sorted(s.holders)) for s in self._sharded_outer for n in s.names}

    @property
    def outer_at_rest(self) -> bool:
        """Whether the module holds the stored shards (no training step or evaluation loop is using the whole
        copies of the parameters outside the trunk)."""
        return self._outer_state == "rest"

    # ------------------------------------------------------------------------------ placement
    def _shard_outer(self, lm: Any) -> None:
        """At set-up, after the broadcast that makes every stage's values rank 0's: store each pre/post-trunk
        parameter (plain, not 0-dim) in shards; the optimizers are built on the shards."""
        if self.parallel_dims.pp == 1 or self._sharded_outer:  # type: ignore[attr-defined]
            return
        found: dict[int, tuple[nn.Parameter, list[str]]] = {}
        for n, p in lm.named_parameters(remove_duplicate=False):
            if n in self._replicated_names and not p.is_meta and type(p) is nn.Parameter and p.dim() > 0 and len(p):  # type: ignore[attr-defined]
                found.setdefault(id(p), (p, []))[1].append(n)
        everywhere = frozenset(range(self.parallel_dims.pp))  # type: ignore[attr-defined]
        for p, names in found.values():
            shard = self._new_shard(p)
            self._sharded_outer.append(ShardedOuter(tuple(names), everywhere, shard))
            _install(lm, names, shard)
        self._outer_ids = None

    def _place_outer(self, step: Any) -> None:
        """Decide which stages run each pre/post-trunk parameter (the first step, with every one of them whole
        on every stage; see the module docstring), and free the others' copies of this step."""
        self._outer_decided = True
        lm, runtime = self.lightning_module, self.runtime  # type: ignore[attr-defined]
        named = lm.named_parameters(remove_duplicate=False)
        watched = {  # plain parameters only: DTensors are sharded otherwise, subclasses may carry state
            n: p
            for n, p in named
            if n in self._replicated_names and not p.is_meta and type(p) is nn.Parameter  # type: ignore[attr-defined]
        }
        if self.parallel_dims.pp == 1 or not watched or not self._sharded_outer:  # type: ignore[attr-defined]
            return
        metrics = self._metrics.metrics  # type: ignore[attr-defined]
        saved = snapshot_metrics(metrics)
        message = None
        try:
            # no graph: the probe needs values only (a live graph would pin the parameters)
            with torch.random.fork_rng(), recording(lm, LogRecorder()), no_fast_paths(), torch.no_grad():
                with self.precision_plugin.train_step_context():  # type: ignore[attr-defined]
                    trunk_input = runtime.capture_step(step).trunk_input
                    found = outer.touched(runtime.trunk, step, watched, trunk_input, runtime.output_like)
                    del trunk_input
            decision: Any = tuple(sorted(names) for names in found)
        except Exception as err:  # noqa: BLE001  (every rank agrees below, then runs everything everywhere)
            decision, message = None, f"{type(err).__name__}: {err}"
        finally:
            restore_metrics(metrics, saved)
        # global rank 0's decision (a loss stage) for every replica: the optimizers' parameters must agree over dp
        decision = _collectives.broadcast_object(decision, 0, None)
        if decision is None:
            rank_zero_info(f"pre/post-trunk parameters run whole on every stage (the probe failed: {message})")
            return
        pre, post, arguments = set(decision[0]), set(decision[1]), decision[2]
        if arguments:
            rank_zero_info(
                "pre/post-trunk parameters run whole on every stage: the blocks' arguments are computed from"
                f" {arguments}"
            )
            return
        # by parameter, not by name: a tied pair has two names, and the probe reports one of them
        pre_ids, post_ids = {id(watched[n]) for n in pre}, {id(watched[n]) for n in post}
        for s in self._sharded_outer:
            p = watched[s.names[0]]
            holders = ({self.first_stage} if id(p) in pre_ids else set()) | (
                {self.loss_stage} if id(p) in post_ids else set()  # type: ignore[attr-defined]
            )
            if holders:  # one the step does not use runs whole everywhere (a branch the first step did not take)
                s.holders = frozenset(holders)
            if self.stage not in s.holders:  # type: ignore[attr-defined]
                outer.free_([p])
                self._freed_outer.append(p)
        lines = [f"{', '.join(s.names)}: stages {sorted(s.holders)}" for s in self._sharded_outer]
        rank_zero_info(
            f"pre/post-trunk parameters (stored in shards over {self._outer_mesh().size()} ranks) run whole"
            " during a training step on (decided at the first step):\n  " + "\n  ".join(lines)
        )

    def _outer_mesh(self) -> DeviceMesh:
        """The stages, times the dp replicas under full sharding (one flattened mesh dimension)."""
        mesh = self._mesh  # type: ignore[attr-defined]
        if self._outer_mesh_of is None or self._outer_mesh_of[0] is not mesh:
            sub = mesh[DP, PP]._flatten("dp_pp") if self._fully_sharded else mesh[PP]  # type: ignore[attr-defined]
            self._outer_mesh_of = (mesh, sub)
        return self._outer_mesh_of[1]

    def _new_shard(self, p: nn.Parameter) -> nn.Parameter:
        """``p``'s values as a ``Shard(0)`` DTensor parameter on the outer mesh (local slicing: every stage holds
        the same values, broadcast at set-up)."""
        value = distribute_tensor(p.detach(), self._outer_mesh(), [Shard(0)], src_data_rank=None)
        shard = nn.Parameter(value, requires_grad=p.requires_grad)
        shard.__dict__.update(p.__dict__)
        return shard

    # ------------------------------------------------------------------------------ the step
    def _gather_outer_for_step(self) -> None:
        """Step 1 of the module docstring (a no-op while gradients accumulate: the step's tensors stay)."""
        if self._outer_state != "rest" or not self._sharded_outer:
            return
        lm, self._freed_outer = self.lightning_module, []  # type: ignore[attr-defined]
        for s in self._sharded_outer:
            runs = self._running_ranks(s)
            if runs is None:  # every rank runs it: one all-gather
                whole: Optional[Tensor] = s.shard.full_tensor()
            else:  # only the running ranks receive it; the others send their shard and allocate nothing
                group = s.shard.device_mesh.get_group()
                whole = _collectives.gather_rows(s.shard.to_local(), s.shard.shape[0], group, runs)
            if whole is not None:
                param = nn.Parameter(whole, requires_grad=s.shard.requires_grad)
            else:
                placeholder = torch.empty(s.shard.shape, dtype=s.shard.dtype, device="meta")
                param = nn.Parameter(placeholder, s.shard.requires_grad)
                self._freed_outer.append(param)
            param.__dict__.update({k: v for k, v in s.shard.__dict__.items()})
            _install(lm, s.names, param)
        self._outer_state, self._outer_ids = "step", None

    def _reduce_outer_gradients(self) -> None:
        """Step 2 of the module docstring: reduce-scatter each gradient onto the shards; the module holds them
        again."""
        if self._outer_state != "step":
            return
        lm = self.lightning_module  # type: ignore[attr-defined]
        steps = [_module_param(lm, s.names[0]) for s in self._sharded_outer]
        group = self._sharded_outer[0].shard.device_mesh.get_group()
        used = _collectives.any_over_group([p.grad is not None for p in steps], group)
        dp = self.parallel_dims.dp if self._fully_sharded else 1  # type: ignore[attr-defined]
        for s, p, u in zip(self._sharded_outer, steps, used):
            mesh, runs = s.shard.device_mesh, self._running_ranks(s)
            if u:
                grad = p.grad
                if grad is None and not p.is_meta:  # a running stage that did not use it this step
                    grad = torch.zeros(s.shard.shape, dtype=s.shard.dtype, device=s.shard.device)
                if runs is None:  # every rank ran it: one reduce-scatter
                    partial = DTensor.from_local(grad, mesh, [Partial()], run_check=False)
                    reduced = partial.redistribute(mesh, [Shard(0)])
                else:  # the running ranks scatter their gradient; the others receive their chunk only
                    shard = s.shard.to_local()
                    chunk = _collectives.scatter_rows_sum(grad, shard, s.shard.shape[0], mesh.get_group(), runs)
                    reduced = DTensor.from_local(chunk, mesh, [Shard(0)], run_check=False, shape=s.shard.shape,
                                                 stride=s.shard.stride())  # fmt: skip
                if dp > 1:
                    reduced.to_local().div_(dp)  # the dp mean (FSDP's units average too)
                s.shard.grad = reduced if s.shard.grad is None else s.shard.grad + reduced
            _install(lm, s.names, s.shard)
        self._freed_outer, self._outer_state, self._outer_ids = [], "rest", None

    def _running_ranks(self, s: ShardedOuter) -> Optional[list[int]]:
        """The global ranks of ``s``'s mesh whose stage runs it in a training step, in group order; ``None``
        when that is every rank of the mesh."""
        group = s.shard.device_mesh.get_group()
        key = id(group)
        if key not in self._stage_of_rank:
            ranks = _collectives.group_ranks(group)
            stages = _collectives.all_gather_object(self.stage, group)  # type: ignore[attr-defined]
            self._stage_of_rank[key] = list(zip(ranks, stages))
        runs = [r for r, stage in self._stage_of_rank[key] if stage in s.holders]
        return None if len(runs) == len(self._stage_of_rank[key]) else runs

    @contextmanager
    def _outer_at_rest(self) -> Iterator[None]:
        """The shards in the module while inside, whatever it holds now: a checkpoint saved during an
        evaluation loop (``ModelCheckpoint`` at its end) or while gradients accumulate holds the shards and
        their optimizer state by name."""
        lm = self.lightning_module  # type: ignore[attr-defined]
        if self._outer_state == "rest" or lm is None:
            yield
            return
        now = [_module_param(lm, s.names[0]) for s in self._sharded_outer]
        for s in self._sharded_outer:
            _install(lm, s.names, s.shard)
        self._outer_ids = None
        try:
            yield
        finally:
            for s, p in zip(self._sharded_outer, now):
                _install(lm, s.names, p)
            self._outer_ids = None

    def lightning_module_state_dict(self) -> dict[str, Any]:
        with self._outer_at_rest():
            return super().lightning_module_state_dict()  # type: ignore[misc]

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        with self._outer_at_rest():
            return super().optimizer_state(optimizer)  # type: ignore[misc]

    def _outer_to_rest(self) -> None:
        """The shards back in the module, whatever it holds (teardown): a fit that stopped while gradients
        accumulated drops the step's partial gradients, as Lightning drops those of the whole model."""
        lm = self.lightning_module  # type: ignore[attr-defined]
        if self._outer_state == "rest" or lm is None:
            return
        for s in self._sharded_outer:
            _install(lm, s.names, s.shard)
        self._freed_outer, self._outer_state, self._outer_ids = [], "rest", None

    def _outer_gradients(self) -> gradients.OuterGradients:
        """The pre/post-trunk parameters for the gradient recipe (step 2 of the module docstring; the whole ones
        summed over the pipeline group)."""

        def whole() -> list[nn.Parameter]:
            sharded = {id(s.shard) for s in self._sharded_outer}
            return [p for p in self._replicated if id(p) not in sharded]  # type: ignore[attr-defined]

        return gradients.OuterGradients(whole, self._reduce_outer_gradients, self._counts_outer_here)

    def _outer_names(self) -> dict[int, str]:
        """id -> name of the pre/post-trunk parameters as the module holds them now (cached until they change)."""
        if getattr(self, "_outer_ids", None) is None:
            lm = self.lightning_module  # type: ignore[attr-defined]
            names = self._replicated_names  # type: ignore[attr-defined]
            self._outer_ids = {
                id(p): n for n, p in reversed(list(lm.named_parameters(remove_duplicate=False))) if n in names
            }
        return self._outer_ids  # type: ignore[return-value]

    def _counts_outer_here(self, p: nn.Parameter) -> Optional[bool]:
        """For a pre/post-trunk parameter: whether this stage counts it in the global norm (every stage its
        shard; during a step, before the gradients are reduced, a stage running it whole if it is the first
        such stage; a whole one on the first stage); ``None`` for any other parameter."""
        if any(p is s.shard for s in self._sharded_outer):
            return True
        name = self._outer_names().get(id(p))
        if name is None:
            return None
        running = next((s.holders for s in self._sharded_outer if name in s.names), None)
        return self.stage == (min(running) if running else self.first_stage)  # type: ignore[attr-defined]

    # ------------------------------------------------------------------------------ evaluation
    def _gather_outer(self) -> None:
        """Step 3 of the module docstring: every stage gets every sharded parameter whole."""
        if not self._sharded_outer:
            return
        lm = self.lightning_module  # type: ignore[attr-defined]
        for s in self._sharded_outer:
            whole = s.shard.full_tensor()  # every rank, in the same order
            if self._outer_state == "rest":
                param = nn.Parameter(whole, requires_grad=s.shard.requires_grad)
                param.__dict__.update(s.shard.__dict__)
                _install(lm, s.names, param)
            elif self.stage not in s.holders:  # type: ignore[attr-defined]
                outer.set_(_module_param(lm, s.names[0]), whole)  # mid-accumulation: the step's tensors stay
        self._outer_state = "eval" if self._outer_state == "rest" else "step-eval"
        self._outer_ids = None

    def _free_outer(self) -> None:
        lm = self.lightning_module  # type: ignore[attr-defined]
        if self._outer_state == "eval":
            for s in self._sharded_outer:
                _install(lm, s.names, s.shard)
            self._outer_state = "rest"
        elif self._outer_state == "step-eval":
            outer.free_(self._freed_outer)
            self._outer_state = "step"
        self._outer_ids = None

    def _is_sharded_outer(self, t: Tensor) -> bool:
        return any(t is s.shard for s in self._sharded_outer)


def _module_param(module: nn.Module, name: str) -> nn.Parameter:
    path, _, attr = name.rpartition(".")
    return (module.get_submodule(path) if path else module)._parameters[attr]  # type: ignore[return-value]


def _install(module: nn.Module, names: tuple[str, ...] | list[str], param: nn.Parameter) -> None:
    """Make every name in ``names`` (a tied pair has two) refer to ``param``."""
    for name in names:
        path, _, attr = name.rpartition(".")
        (module.get_submodule(path) if path else module)._parameters[attr] = param
