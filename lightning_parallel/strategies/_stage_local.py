"""Stage-local pre- and post-trunk parameters for the pipeline strategies (``pipeline``, ``helix``).

At the first training step (:meth:`StageLocalMixin._place_outer`) the strategy finds which parameters
outside the trunk the step uses before the trunk and after it (:func:`lightning_parallel.pipeline.outer.touched`):
the first stage (which runs chunk 0) keeps the pre-trunk ones, the loss stage the post-trunk ones, both a
parameter both parts use (a tied embedding and head), the loss stage one that the step does not use. The
other stages free theirs to ``meta`` and drop them from the optimizers. Gradients: a parameter every stage
holds is summed over the pipeline group as before; one the first and the loss stage share is summed between
those two only. Evaluation runs the user's code on every stage in lock-step, so a loop's start gathers the
freed parameters from their holders and its end frees them again. Parameters that are DTensors (vocabulary-
parallel under tensor parallelism, FSDP's under full sharding) stay on every stage.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn

from lightning_parallel import _collectives
from lightning_parallel.anatomy.families import no_fast_paths
from lightning_parallel.pipeline import outer
from lightning_parallel.strategies._logging import LogRecorder, recording, restore_metrics, snapshot_metrics
from lightning_parallel.strategies._optimizers import drop_parameters


class StageLocalMixin:
    """Mixed into ``PipelineParallelStrategy``; needs its ``runtime``, ``stage``, ``loss_stage``, ``stage_rank``,
    ``pp_group``, ``_replicated_names`` and ``_metrics``."""

    _outer_holders: dict[str, frozenset[int]]  # outer parameter name -> the stages holding it (decided)
    _freed_outer: list[nn.Parameter]
    _outer_decided: bool

    def _init_stage_local(self) -> None:
        self._outer_holders, self._freed_outer, self._outer_decided = {}, [], False

    @property
    def first_stage(self) -> int:
        """The stage that runs chunk 0, and so the pre-trunk code whose values matter."""
        return 0

    def _holders(self, name: str) -> frozenset[int]:
        return self._outer_holders.get(name) or frozenset(range(self.parallel_dims.pp))  # type: ignore[attr-defined]

    def _place_outer(self, step: Any) -> None:
        """Decide where each pre/post-trunk parameter lives (the first step; see the module docstring)."""
        self._outer_decided = True
        lm, runtime = self.lightning_module, self.runtime  # type: ignore[attr-defined]
        named = lm.named_parameters(remove_duplicate=False)
        watched = {  # plain parameters only: DTensors are sharded otherwise, subclasses may carry state
            n: p
            for n, p in named
            if n in self._replicated_names and not p.is_meta and type(p) is nn.Parameter  # type: ignore[attr-defined]
        }
        if self.parallel_dims.pp == 1 or not watched:  # type: ignore[attr-defined]
            return
        metrics = self._metrics.metrics  # type: ignore[attr-defined]
        saved = snapshot_metrics(metrics)
        message = None
        try:
            # no graph: the probe needs values only, and a live graph would pin the parameters (swap_tensors
            # refuses a tensor an AccumulateGrad node still holds)
            with torch.random.fork_rng(), recording(lm, LogRecorder()), no_fast_paths(), torch.no_grad():
                with self.precision_plugin.train_step_context():  # type: ignore[attr-defined]
                    trunk_input = runtime.capture_step(step).trunk_input
                    found = outer.touched(runtime.trunk, step, watched, trunk_input, runtime.output_like)
                    del trunk_input
            decision: Any = tuple(sorted(names) for names in found)
        except Exception as err:  # noqa: BLE001  (every rank agrees below, then raises or keeps everything)
            decision, message = None, f"{type(err).__name__}: {err}"
        finally:
            restore_metrics(metrics, saved)
        # global rank 0's decision (a loss stage) for every replica: the optimizers' parameters must agree over dp
        decision = _collectives.broadcast_object(decision, 0, None)
        if decision is None:
            rank_zero_info(f"pre/post-trunk parameters stay on every stage (the probe failed: {message})")
            return
        pre, post, arguments = set(decision[0]), set(decision[1]), decision[2]
        if arguments:
            rank_zero_info(
                f"pre/post-trunk parameters stay on every stage: the blocks' arguments are computed from {arguments}"
            )
            return
        # by parameter, not by name: a tied pair has two names, and the probe reports one of them
        pre_ids, post_ids = {id(watched[n]) for n in pre}, {id(watched[n]) for n in post}
        first, last, everywhere = self.first_stage, self.loss_stage, range(self.parallel_dims.pp)  # type: ignore[attr-defined]
        by_param = {
            id(p): ({first} if id(p) in pre_ids else set()) | ({last} if id(p) in post_ids else set())
            or set(everywhere)
            for p in watched.values()
        }
        self._outer_holders = {n: frozenset(by_param[id(p)]) for n, p in watched.items()}
        freed = {id(p): p for n, p in watched.items() if self.stage not in self._outer_holders[n]}  # type: ignore[attr-defined]
        self._freed_outer = list(freed.values())
        outer.free_(self._freed_outer)
        drop_parameters(self.optimizers, set(freed))  # type: ignore[attr-defined]
        self._outer_ids = None
        lines = [f"{n}: stages {sorted(s)}" for n, s in self._outer_holders.items()]
        rank_zero_info("pre/post-trunk parameters placed (first step):\n  " + "\n  ".join(lines))

    def _sum_outer_gradients(self, params: list[nn.Parameter]) -> None:
        """Sum the gradients of pre/post-trunk parameters between the stages that hold them."""
        from lightning_parallel.pipeline import gradients
        from lightning_parallel.tensor_parallel import local

        name_of = self._outer_names()
        pp = self.parallel_dims.pp  # type: ignore[attr-defined]
        everywhere = [p for p in params if len(self._holders(name_of[id(p)])) == pp]
        gradients.sum_replicated_(everywhere, self.pp_group)  # type: ignore[attr-defined]
        shared = {self.first_stage, self.loss_stage}  # type: ignore[attr-defined]
        both = [p for p in params if len(shared) == 2 < pp and self._holders(name_of[id(p)]) == shared]
        if both:
            other = self.loss_stage if self.stage == self.first_stage else self.first_stage  # type: ignore[attr-defined]
            peer, group = self.stage_rank(other), self.pp_group  # type: ignore[attr-defined]
            mine = torch.tensor([p.grad is not None for p in both], dtype=torch.uint8, device=both[0].device)
            used = (mine | _collectives.exchange(mine, peer, group)).tolist()  # None stays None where neither used it
            for p, u in zip(both, used):
                if u and p.grad is None:
                    p.grad = torch.zeros_like(p)
            _collectives.exchange_sum_([local(p.grad) for p, u in zip(both, used) if u], peer, group)

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
        """For a pre/post-trunk parameter: whether this stage counts it in the global norm (its first holder);
        ``None`` for any other parameter."""
        name = self._outer_names().get(id(p))
        if name is None:
            return None
        return self.stage == min(self._holders(name))  # type: ignore[attr-defined]

    def _gather_outer(self) -> None:
        """Give every stage the freed pre/post-trunk parameters (lock-step evaluation runs them everywhere)."""
        if not self._outer_holders:
            return
        lm, device = self.lightning_module, self.root_device  # type: ignore[attr-defined]
        ranks = _collectives.group_ranks(self.pp_group)  # type: ignore[attr-defined]
        by_source: dict[int, list[Tensor]] = {}
        seen: set[int] = set()
        for n, p in lm.named_parameters(remove_duplicate=False):
            if n not in self._outer_holders or id(p) in seen:
                continue
            seen.add(id(p))
            holders = self._outer_holders[n]
            if len(holders) == self.parallel_dims.pp:  # type: ignore[attr-defined]
                continue
            if p.is_meta:
                outer.set_(p, torch.empty(p.shape, dtype=p.dtype, device=device))
            by_source.setdefault(min(holders), []).append(p.data)
        for stage in sorted(by_source):
            _collectives.broadcast_(by_source[stage], self.pp_group, ranks.index(self.stage_rank(stage)))  # type: ignore[attr-defined]

    def _free_outer(self) -> None:
        outer.free_(self._freed_outer)
