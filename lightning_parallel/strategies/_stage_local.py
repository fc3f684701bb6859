"""Pre- and post-trunk parameters under the pipeline strategies (``pipeline``, ``helix``): stored in shards
over the stages, whole only where and while a step runs them (docs/design.md, "Where each parameter lives").

At set-up (:meth:`OuterShards.shard`) every parameter outside the trunk (plain, not 0-dim) is
*stored* cut in dim 0 over the pipeline stages (over dp x pp under ``data_parallel_sharding="full"``): a
``DTensor`` parameter, ``Shard(0)`` on that mesh, which the optimizer holds and steps, so parameters,
gradients and optimizer state per rank are ``1 / pp`` of them. This is ZeRO stage 3 (Rajbhandari et al.,
2020, arXiv 1910.02054) over the stages for the parameters outside the trunk, gathered once per step
rather than once per use. At the first training step (:meth:`OuterShards.place`) the strategy
finds which of them the step uses before the trunk and after it (:func:`lightning_parallel.pipeline.outer.touched`):
the first stage (which runs chunk 0) runs the pre-trunk ones, the loss stage the post-trunk ones, both a
parameter both parts use (a tied embedding and head); one the step does not use, and every one when a
block's side argument is computed from one (the blocks need the values everywhere), runs on every stage.

1. a training step starts: the ranks whose stage runs a sharded parameter gather it whole (one gather
   each; an all-gather when every rank runs it) and put it in the module (a plain parameter, so the
   user's code runs unchanged); the others only send their shard and hold a ``meta`` one, a stride-0 NaN
   placeholder while the schedule runs (:func:`outer.placeholders`);
2. after the schedule (and any gradient accumulation), the gradient recipe reduces the gradient onto the
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

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

from lightning_parallel import _collectives
from lightning_parallel.pipeline import outer

FIRST_STAGE = 0  # the stage that runs chunk 0, and so the pre-trunk code whose values matter

Probe = Callable[[dict[str, nn.Parameter]], Any]  # watched parameters -> outer.touched's (pre, post, arguments)


@dataclass
class ShardedOuter:
    """One pre/post-trunk parameter stored in shards (a tied pair is one, under all its names)."""

    names: tuple[str, ...]
    holders: frozenset[int]  # the stages whose training step runs it (every stage until the first step decides)
    shard: nn.Parameter  # the DTensor parameter: the optimizer's; the module's between steps


class OuterShards:
    """A pipeline strategy's parameters outside the trunk (module docstring): attached to the module at placement
    (:meth:`attach`), sharded at set-up (:meth:`shard`), placed at the first step (:meth:`place`); the gradient
    recipe (:mod:`lightning_parallel.strategies.gradients`) reads :meth:`whole`, :meth:`reduce_shards` and
    :meth:`counted_here`. Before :meth:`attach` it holds nothing and every method is a no-op (but :meth:`place`, which
    records that the first step has decided)."""

    def __init__(self) -> None:
        self.module: Optional[nn.Module] = None
        self.names: frozenset[str] = frozenset()  # the pre/post-trunk parameters' names (sharding replaces objects)
        self.stage = self.loss_stage = 0
        self.sharded: list[ShardedOuter] = []
        self.decided = False  # whether the first step has placed them
        self.state = "rest"  # "rest": the module holds the shards; "step": a step's tensors; "eval": every stage's
        self.freed: list[nn.Parameter] = []  # in "step": the meta parameters of the stages that do not use them
        self._dp = 1  # the dp replicas the shards' gradients are averaged over (full sharding)
        self._ids: Optional[dict[int, str]] = None
        self._stage_of_rank: dict[int, list[tuple[int, int]]] = {}  # id(mesh group) -> (global rank, its stage)

    def attach(self, module: nn.Module, names: frozenset[str], stage: int, loss_stage: int) -> None:
        """At placement: the module, its pre/post-trunk parameters' names and this rank's stages."""
        self.module, self.names, self.stage, self.loss_stage, self._ids = module, names, stage, loss_stage, None

    @property
    def placement(self) -> dict[str, tuple[int, ...]]:
        """Each sharded parameter's name -> the stages that hold it whole during a training step."""
        return {n: tuple(sorted(s.holders)) for s in self.sharded for n in s.names}

    def holds(self, t: Tensor) -> bool:
        """Whether ``t`` is one of the stored shards."""
        return any(t is s.shard for s in self.sharded)

    def replicated(self) -> list[nn.Parameter]:
        """The pre/post-trunk parameters as the module holds them now (a tied pair once)."""
        seen: dict[int, nn.Parameter] = {}
        for n, p in self._named():
            if n in self.names:
                seen.setdefault(id(p), p)
        return list(seen.values())

    def _named(self) -> list[tuple[str, nn.Parameter]]:
        return list(self.module.named_parameters(remove_duplicate=False)) if self.module is not None else []

    def _watched(self) -> dict[str, nn.Parameter]:
        # plain parameters only: DTensors are sharded otherwise, subclasses may carry state
        return {n: p for n, p in self._named() if n in self.names and not p.is_meta and type(p) is nn.Parameter}

    # ------------------------------------------------------------------------------ placement
    def shard(self, mesh: DeviceMesh, dp: int) -> None:
        """At set-up, after the broadcast that makes every stage's values rank 0's: store each pre/post-trunk
        parameter (plain, not 0-dim) in shards over ``mesh`` (the stages, x dp under full sharding: its
        gradients are then averaged over ``dp``); the optimizers are built on the shards."""
        if self.sharded or self.module is None:
            return
        self._dp = dp
        found: dict[int, tuple[nn.Parameter, list[str]]] = {}
        for n, p in self._watched().items():
            if p.dim() > 0 and len(p):
                found.setdefault(id(p), (p, []))[1].append(n)
        everywhere = frozenset(range(mesh.size() // dp))
        for p, names in found.values():
            value = distribute_tensor(p.detach(), mesh, [Shard(0)], src_data_rank=None)  # equal on every stage
            shard = nn.Parameter(value, requires_grad=p.requires_grad)
            shard.__dict__.update(p.__dict__)
            self.sharded.append(ShardedOuter(tuple(names), everywhere, shard))
            self._install(names, shard)

    def place(self, probe: Probe) -> None:
        """Decide which stages run each sharded parameter (the first step, with every one of them whole on every
        stage; see the module docstring), and free the others' copies of this step. ``probe(watched)`` runs
        :func:`outer.touched` on the step; global rank 0's answer holds for every rank."""
        self.decided = True
        watched = self._watched()
        if not self.sharded or not watched:
            return
        message = None
        try:
            decision: Any = tuple(sorted(names) for names in probe(watched))
        except Exception as err:  # noqa: BLE001  (every rank agrees below, then runs everything everywhere)
            decision, message = None, f"{type(err).__name__}: {err}"
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
        for s in self.sharded:
            p = watched[s.names[0]]
            holders = ({FIRST_STAGE} if id(p) in pre_ids else set()) | (
                {self.loss_stage} if id(p) in post_ids else set()
            )
            if holders:  # one the step does not use runs whole everywhere (a branch the first step did not take)
                s.holders = frozenset(holders)
            if self.stage not in s.holders:
                outer.free_([p])
                self.freed.append(p)
        lines = [f"{', '.join(s.names)}: stages {sorted(s.holders)}" for s in self.sharded]
        rank_zero_info(
            f"pre/post-trunk parameters (stored in shards over {self.sharded[0].shard.device_mesh.size()} ranks)"
            " run whole during a training step on (decided at the first step):\n  " + "\n  ".join(lines)
        )

    # ------------------------------------------------------------------------------ the step
    def gather_for_step(self) -> None:
        """Step 1 of the module docstring (a no-op while gradients accumulate: the step's tensors stay)."""
        if self.state != "rest" or not self.sharded:
            return
        self.freed = []
        for s in self.sharded:
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
                self.freed.append(param)
            param.__dict__.update(s.shard.__dict__)
            self._install(s.names, param)
        self.state = "step"

    def reduce_shards(self) -> None:
        """Step 2 of the module docstring: reduce-scatter each gradient onto the shards; the module holds them
        again."""
        if self.state != "step":
            return
        steps = [self._param(s.names[0]) for s in self.sharded]
        group = self.sharded[0].shard.device_mesh.get_group()
        used = _collectives.any_over_group([p.grad is not None for p in steps], group)
        for s, p, u in zip(self.sharded, steps, used):
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
                if self._dp > 1:
                    reduced.to_local().div_(self._dp)  # the dp mean (FSDP's units average too)
                s.shard.grad = reduced if s.shard.grad is None else s.shard.grad + reduced
            self._install(s.names, s.shard)
        self.freed, self.state = [], "rest"

    def whole(self) -> list[nn.Parameter]:
        """The pre/post-trunk parameters every stage holds whole (their gradients are summed over the stages)."""
        return [p for p in self.replicated() if not self.holds(p)]

    def counted_here(self, p: nn.Parameter) -> Optional[bool]:
        """For a pre/post-trunk parameter: whether this stage counts it in the global norm (every stage its
        shard; during a step, before the gradients are reduced, a stage running it whole if it is the first
        such stage; a whole one on the first stage); ``None`` for any other parameter."""
        if self.holds(p):
            return True
        if self._ids is None:  # id -> name as the module holds them now (cached until they change)
            self._ids = {id(q): n for n, q in reversed(self._named()) if n in self.names}
        name = self._ids.get(id(p))
        if name is None:
            return None
        running = next((s.holders for s in self.sharded if name in s.names), None)
        return self.stage == (min(running) if running else FIRST_STAGE)

    def _running_ranks(self, s: ShardedOuter) -> Optional[list[int]]:
        """The global ranks of ``s``'s mesh whose stage runs it in a training step, in group order; ``None``
        when that is every rank of the mesh."""
        group = s.shard.device_mesh.get_group()
        key = id(group)
        if key not in self._stage_of_rank:
            ranks = _collectives.group_ranks(group)
            self._stage_of_rank[key] = list(zip(ranks, _collectives.all_gather_object(self.stage, group)))
        runs = [r for r, stage in self._stage_of_rank[key] if stage in s.holders]
        return None if len(runs) == len(self._stage_of_rank[key]) else runs

    @contextmanager
    def stored(self) -> Iterator[None]:
        """The shards in the module while inside, whatever it holds now: a checkpoint saved during an
        evaluation loop (``ModelCheckpoint`` at its end) or while gradients accumulate holds the shards and
        their optimizer state by name."""
        if self.state == "rest":
            yield
            return
        now = [self._param(s.names[0]) for s in self.sharded]
        for s in self.sharded:
            self._install(s.names, s.shard)
        try:
            yield
        finally:
            for s, p in zip(self.sharded, now):
                self._install(s.names, p)

    def to_rest(self) -> None:
        """The shards back in the module, whatever it holds (teardown): a fit that stopped while gradients
        accumulated drops the step's partial gradients, as Lightning drops those of the whole model."""
        if self.state == "rest":
            return
        for s in self.sharded:
            self._install(s.names, s.shard)
        self.freed, self.state = [], "rest"

    # ------------------------------------------------------------------------------ evaluation
    def gather_for_evaluation(self) -> None:
        """Step 3 of the module docstring: every stage gets every sharded parameter whole."""
        if not self.sharded:
            return
        for s in self.sharded:
            whole = s.shard.full_tensor()  # every rank, in the same order
            if self.state == "rest":
                param = nn.Parameter(whole, requires_grad=s.shard.requires_grad)
                param.__dict__.update(s.shard.__dict__)
                self._install(s.names, param)
            elif self.stage not in s.holders:
                outer.set_(self._param(s.names[0]), whole)  # mid-accumulation: the step's tensors stay
        self.state = "eval" if self.state == "rest" else "step-eval"

    def evaluation_ends(self) -> None:
        if self.state == "eval":
            for s in self.sharded:
                self._install(s.names, s.shard)
            self.state = "rest"
        elif self.state == "step-eval":
            outer.free_(self.freed)
            self.state = "step"

    # ------------------------------------------------------------------------------ the module's slots
    def _slot(self, name: str) -> tuple[dict[str, Any], str]:
        """The parameter dict of the module that holds ``name``, and its key there."""
        assert self.module is not None
        path, _, attr = name.rpartition(".")
        return (self.module.get_submodule(path) if path else self.module)._parameters, attr

    def _param(self, name: str) -> nn.Parameter:
        params, attr = self._slot(name)
        return params[attr]

    def _install(self, names: tuple[str, ...] | list[str], param: nn.Parameter) -> None:
        """Make every name in ``names`` (a tied pair has two) refer to ``param``."""
        for name in names:
            params, attr = self._slot(name)
            params[attr] = param
        self._ids = None
