"""A mixture's load-balancing loss under a pipeline, as one device computes it over the whole batch.

transformers' ``load_balancing_loss_func`` (Switch Transformer, Fedus et al., arXiv 2101.03961, eq. 4) is
``E · Σ_e (a_e / n) · (p_e / n)`` over every router call of the batch: ``a_e`` the rows assigned to expert e (top-k),
``p_e`` the summed routing probabilities of e, ``n`` the rows counted (each weighted by the attention mask). These
are sums (:meth:`lightning_parallel.anatomy.router_losses.Balancing.sums`), so each stage adds up its own routers'
calls on its own micro-batches while its forward actions run (:class:`RouterSums`), and the loss needs only their
totals. One device's gradient on every router call's ``p`` is the same vector, ``c · E · a / n²`` (``c`` the
loss's coefficient in the step's loss: the router's ``router_aux_loss_coef`` where the model adds it, whatever the
user's step makes of it), which each stage adds to its sums' graphs in its backward actions.

The totals cover every micro-batch, so every forward must run before the first backward (GPipe; any schedule
with one micro-batch): at the turn between the two (:meth:`RouterSums.turn`), each stage's totals are summed over
the sequence shards and the stages (and, on the loss stage, the data-parallel replicas); the loss stage then runs
the micro-batches' losses (deferred from their forward actions) with the family's function returning the batch's
value as a leaf per micro-batch, reads ``c`` from each micro-batch's weighted loss (its gradient at that leaf,
summed over the micro-batches and the replicas: the step's weights and the data-parallel mean make it one
device's coefficient) and sends the gradient vector to every stage.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from lightning_parallel import _collectives
from lightning_parallel.anatomy.router_losses import Balancing, computed_by, counted, value
from lightning_parallel.errors import ConfigurationError

# the hooks find the step's sums here, so that a block's copy (deep-copied with its hooks, for verification) holds no
# reference to them; a copy's router calls are not counted (router_losses.uncounted)
_ACTIVE: RouterSums | None = None


def _router_hook(module: nn.Module, args: tuple, output: Any) -> None:
    if _ACTIVE is not None and counted():
        _ACTIVE._on_router(module, args, output)


def _model_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
    if _ACTIVE is not None:
        _ACTIVE._on_model(module, args, kwargs)


class RouterSums:
    """One training step's router sums on one stage (module docstring). ``shares[i]`` is micro-batch i's share of
    the batch (0: padding, left out); ``shards`` the sequence-parallel group (its sums add up), ``replicas`` the
    loss stage's data-parallel group, ``stages`` the pipeline's group and ``loss_rank`` the loss stage's rank in it."""

    def __init__(self, spec: Balancing, shares: list[float], device: torch.device, stages: Any, loss_rank: int,
                 shards: Any = None, replicas: Any = None) -> None:  # fmt: skip
        self.spec, self.shares, self.device = spec, shares, device
        self.stages, self.loss_rank, self.shards, self.replicas = stages, loss_rank, shards, replicas
        self.masks: dict[int, Tensor | None] = {}
        self.parts: dict[tuple[int, int], list[Tensor]] = {}  # (micro-batch, unit) -> its routers' probability sums
        self.totals: list[Tensor] | None = None  # assigned, probabilities, rows: this stage's, then the batch's
        self.calls = 0
        self.leaves: dict[int, list[Tensor]] = {}  # the loss's value, per micro-batch and call (loss stage)
        self.push: Tensor | None = None  # the gradient of every router call's probability sums
        self._at: tuple[int, int] | None = None
        self._logits: list[tuple[Tensor, bool]] = []  # the routers' logits (trainable?) while a forward runs
        self._capturing: int | None = None
        self._loss_of: int | None = None

    # ------------------------------------------------------------------ the forward actions
    @contextmanager
    def installed(self) -> Iterator[None]:
        """While open: the routers' outputs are summed (inside :meth:`running`), the model's attention mask kept
        per micro-batch (inside :meth:`capturing`)."""
        global _ACTIVE
        spec = self.spec
        routers = [m for n, m in spec.module.named_modules() if spec.is_router(n, m)]
        handles = [m.register_forward_hook(_router_hook) for m in routers]
        handles.append(spec.module.register_forward_pre_hook(_model_hook, with_kwargs=True))
        _ACTIVE = self
        try:
            yield
        finally:
            _ACTIVE = None
            for h in handles:
                h.remove()

    @contextmanager
    def capturing(self, i: int) -> Iterator[None]:
        """While open, micro-batch i's capture runs (the model's attention mask is kept for it)."""
        with _set(self, "_capturing", i):
            yield

    @contextmanager
    def running(self, i: int, unit: int) -> Iterator[None]:
        """While open, this stage's blocks run micro-batch i's forward through ``unit``: its routers' logits are
        kept, and summed once the blocks have run (outside any recomputation region: a checkpoint's recomputation,
        which runs the routers again, must not meet the sums' operations)."""
        self._at, self._logits = (i, unit), []
        try:
            yield
        finally:
            self._at = None
        if self.shares[i] > 0:
            for logits, trained in self._logits:
                self._add(i, unit, logits, trained)
        self._logits = []

    def _on_model(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._capturing is not None:
            self.masks[self._capturing] = self.spec.mask_of(args, kwargs)

    def _on_router(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self._at is not None:
            logits = output[self.spec.index] if isinstance(output, (tuple, list)) else output
            trained = torch.is_grad_enabled() and any(p.requires_grad for p in module.parameters())
            self._logits.append((logits, trained))

    def _add(self, i: int, unit: int, logits: Tensor, trained: bool) -> None:
        """Add one router call's sums; keep its probabilities' graph for the backward where it has one (a frozen
        router on frozen inputs has none, and gets no gradient, as on one device)."""
        mask = self.masks.get(i)
        assigned, probabilities, rows = self.spec.sums(logits, None if mask is None else mask.reshape(-1))
        if probabilities.requires_grad:
            self.parts.setdefault((i, unit), []).append(probabilities)
        elif trained:  # not reached: the pipeline runs its forward actions with a graph
            raise RuntimeError("a router with trainable parameters ran without a graph in a forward action")
        mine = [assigned.double(), probabilities.detach().double(), rows.double().reshape(1)]
        self.totals = mine if self.totals is None else [t + m for t, m in zip(self.totals, mine)]
        self.calls += 1

    # ------------------------------------------------------------------ the turn
    def turn(self, loss_stage: bool, run_losses: Callable[[], dict[int, Tensor]]) -> None:
        """Between the forward and the backward actions, on every stage: the batch's sums; on the loss stage the
        deferred losses (``run_losses()`` returns each real micro-batch's weighted loss) and the coefficient; the
        gradient of the probability sums on every stage."""
        device = _collectives.comm_device(self.stages)
        experts = self.spec.experts
        mine = self.totals if self.totals is not None else [torch.zeros(2 * experts + 1, dtype=torch.float64)]
        totals = torch.cat(mine).to(device)
        if self.shards is not None:
            _collectives.all_reduce_sum_([totals], self.shards)
        calls = torch.tensor([float(self.calls)], dtype=torch.float64, device=device)
        stacked = torch.cat([totals, calls])
        _collectives.all_reduce_sum_([stacked], self.stages)
        totals, calls = stacked[:-1], int(stacked[-1])
        real = sum(s > 0 for s in self.shares)
        if calls != self.spec.routers * real:
            raise ConfigurationError(
                f"{type(self.spec.module).__name__} has {self.spec.routers} routers, but the pipeline's stages saw"
                f" {calls} router calls in {real} micro-batches: its load-balancing loss needs each router called"
                " once per micro-batch, as a module (a block run through a traced forward calls it without its"
                " hooks); set output_router_logits=False"
            )
        push = torch.zeros(experts, dtype=torch.float64, device=device)
        if loss_stage:
            if self.replicas is not None:
                _collectives.all_reduce_sum_([totals], self.replicas)
            self.totals = [totals[:experts], totals[experts : 2 * experts], totals[-1]]
            coefficient = torch.zeros(1, dtype=torch.float64, device=device)
            for i, loss in run_losses().items():
                if self.leaves.get(i) and loss.requires_grad:
                    grads = torch.autograd.grad(loss, self.leaves[i], retain_graph=True, allow_unused=True)
                    for grad in grads:
                        if grad is not None:
                            coefficient += grad.double().to(device)
            if self.replicas is not None:
                _collectives.all_reduce_sum_([coefficient], self.replicas)
            # one device's backward of value(), in its float32 and its order: (c E) (a / n) / n
            assigned, rows = self.totals[0].float(), self.totals[2].float()
            push = ((coefficient.float() * experts) * (assigned / rows) / rows).double()
        _collectives.broadcast_([push], self.stages, group_src=self.loss_rank)
        self.push = push

    @contextmanager
    def losses(self) -> Iterator[None]:
        """While open (the loss stage's deferred losses), the family's function returns the batch's loss."""
        with computed_by(self.spec, self._loss):
            yield

    @contextmanager
    def loss_of(self, i: int) -> Iterator[None]:
        """While open, micro-batch i's deferred loss runs."""
        with _set(self, "_loss_of", i):
            yield

    def _loss(self, logits: Any, experts: int, mask: Any) -> Tensor:
        i = self._loss_of
        assert i is not None and self.totals is not None
        kept = self.masks.get(i)
        if (mask is None) != (kept is None) or (mask is not None and not torch.equal(mask, kept)):
            raise ConfigurationError(
                f"{type(self.spec.module).__name__} passed its load-balancing loss another attention mask than its"
                " forward's; the pipeline weights every stage's router rows by the forward's"
            )
        if experts != self.spec.experts:
            raise ConfigurationError(f"the load-balancing loss was called with {experts} experts; the config has"
                                     f" {self.spec.experts}")  # fmt: skip
        leaf = value(*self.totals).to(self.device).detach().requires_grad_(True)
        if self.shares[i] > 0:
            self.leaves.setdefault(i, []).append(leaf)
        return leaf

    # ------------------------------------------------------------------ the backward actions
    def roots(self, i: int, unit: int) -> tuple[list[Tensor], list[Tensor]]:
        """The extra roots of micro-batch i's backward through ``unit``: its routers' probability sums, with the
        gradient one device gives them."""
        parts = self.parts.pop((i, unit), None)
        if not parts or self.push is None:
            return [], []
        summed = torch.stack(parts).sum(0)
        return [summed], [self.push.to(summed.device, summed.dtype)]


@contextmanager
def _set(owner: Any, name: str, value: Any) -> Iterator[None]:
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, None)


@contextmanager
def over_stages(spec: Balancing, stages: Any, shards: Any = None) -> Iterator[None]:
    """While open (a lock-step evaluation, where every stage runs the post-trunk code with its own routers' logits),
    the family's function returns the loss from every stage's (and sequence shard's) sums."""

    def summed(logits: Any, experts: int, mask: Any) -> Tensor:
        flat = None if mask is None else mask.reshape(-1)
        device = _collectives.comm_device(stages)
        totals = torch.zeros(2 * experts + 1, dtype=torch.float64, device=device)
        with torch.no_grad():
            for z in logits or ():
                totals += torch.cat([t.double().reshape(-1) for t in spec.sums(z, flat)]).to(device)
        if shards is not None:
            _collectives.all_reduce_sum_([totals], shards)
        _collectives.all_reduce_sum_([totals], stages)
        out = value(totals[:experts], totals[experts : 2 * experts], totals[-1])
        return out.to(logits[0].device) if logits else out  # (a stage without routers: on the comm device)

    with computed_by(spec, summed):
        yield


@contextmanager
def stood_in(spec: Balancing | None) -> Iterator[None]:
    """While open (a pass whose blocks stand in and call no router: the first step's probe), the family's function
    returns 0 instead of failing on no router logits."""
    if spec is None:
        yield
        return
    with computed_by(spec, lambda logits, experts, mask: torch.zeros((), dtype=torch.float32)):
        yield


__all__ = ["RouterSums", "over_stages", "stood_in"]
