"""The routers' auxiliary losses of transformers' mixtures over the whole batch, as one device computes them
(family knowledge: it lives with the anatomy, where the strategies ask for it).

A load-balancing loss (Switch Transformer, Fedus et al., arXiv 2101.03961, eq. 4; transformers'
``load_balancing_loss_func``: ``E · Σ_e f_e · P_e``, ``f_e`` the share of the tokens routed to expert e, ``P_e``
the mean router probability of e, over the batch's tokens) is a product of two means: computed on each data-
parallel replica's part of the batch and averaged, it is not the whole batch's. While a training step runs over
several replicas (or sequence shards), each family's ``load_balancing_loss_func`` gets the routers' logits (and
the attention mask) of every rank holding other tokens of the batch, gathered along the tokens (with autograd),
so every rank computes the whole batch's loss. Its gradient on a rank's own logits then sums every rank's copy
(:func:`lightning_parallel._collectives.all_gather_rows`): over the data-parallel replicas, whose gradients are
averaged, that is the one device's gradient; over the sequence shards, whose gradients are summed, it is divided
by their number (each shard's gradient is then its own logits' part once).

Under a pipeline no rank sees every layer's logits: :class:`Balancing` holds what the family's function is made of
(its routers, and the loss as sums of every router call, :meth:`Balancing.sums` and :func:`value`, checked against
the family's function), which ``lightning_parallel.pipeline.balancing`` adds up over the stages.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_parallel import _collectives
from lightning_parallel.errors import ConfigurationError

_NAME = "load_balancing_loss_func"
_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts")  # transformers' configs' names for it


@contextmanager
def over_the_batch(groups: list[tuple[Any, bool]]) -> Iterator[None]:
    """While open, transformers' loaded mixtures compute their balancing losses over the ranks of ``groups``
    (the sequence shards, then the data-parallel replicas: each holds other tokens of the batch), each given
    with whether the ranks' gradients are summed (sequence shards) or averaged (replicas)."""
    patched = []
    if groups:
        for module in list(sys.modules.values()):
            original = getattr(module, _NAME, None) if _family(module) else None
            if callable(original) and not hasattr(original, "gathers"):
                setattr(module, _NAME, _gathering(original, groups))
                patched.append((module, original))
    try:
        yield
    finally:
        for module, original in patched:
            setattr(module, _NAME, original)


@dataclass
class Balancing:
    """A transformers mixture whose forward adds its load-balancing loss (``config.output_router_logits``): where
    its routers are (``router``, their output's entry ``index`` holding the logits, as the family's
    ``_can_record_outputs`` tells transformers' own recorder), how many there are, its experts and top-k, and the
    family's ``load_balancing_loss_func`` (``original``)."""

    module: nn.Module
    family: Any  # the module (of transformers) whose load_balancing_loss_func the model's forward calls
    original: Callable[..., Any]
    router: type
    index: int
    layer_name: str | None
    routers: int
    experts: int
    top_k: int

    def is_router(self, name: str, module: nn.Module) -> bool:
        """As transformers' recorder matches: the class, then the layer name between dots where given."""
        if not isinstance(module, self.router):
            return False
        return self.layer_name is None or f".{self.layer_name.strip('.')}." in f".{name}."

    def mask_of(self, args: tuple, kwargs: dict) -> Tensor | None:
        """The attention mask a call of the model's forward passes (its ``load_balancing_loss_func`` gets the same)."""
        return inspect.signature(self.module.forward).bind_partial(*args, **kwargs).arguments.get("attention_mask")

    def sums(self, logits: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """One router call's share of the loss's sums: the top-k assignments per expert, the routing probabilities
        per expert (with its graph) and the rows counted, each row weighted by ``mask`` (flat) where given: the
        family's body, one layer at a time."""
        experts = logits.shape[-1]
        if experts != self.experts:
            raise ConfigurationError(
                f"a router of {type(self.module).__name__} gave {experts} logits per row; its config has"
                f" {self.experts} experts"
            )
        weights = torch.softmax(logits, dim=-1)
        _, selected = torch.topk(weights, self.top_k, dim=-1)
        flat = (
            torch.ones(logits.shape[0], dtype=torch.float32, device=logits.device)
            if mask is None
            else mask.to(torch.float32)
        )
        if flat.numel() != logits.shape[0]:
            raise ConfigurationError(
                f"a router of {type(self.module).__name__} routed {logits.shape[0]} rows while the model's"
                f" attention_mask has {flat.numel()} entries: its load-balancing loss weights each row by the mask"
            )
        assigned = torch.zeros(experts, dtype=torch.float32, device=logits.device)
        assigned = assigned.scatter_add_(0, selected.reshape(-1), flat.repeat_interleave(self.top_k))
        probabilities = (weights.float() * flat.unsqueeze(-1)).sum(dim=0)
        return assigned, probabilities, flat.sum()

    def check(self) -> None:
        """Refuse a family whose ``load_balancing_loss_func`` is not the Switch form :meth:`sums` and :func:`value`
        decompose (compared on random logits of two layers, with and without a mask)."""
        generator = torch.Generator().manual_seed(0)
        experts = self.experts
        logits = tuple(torch.randn(6, experts, generator=generator, dtype=torch.float64) for _ in range(2))
        mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
        for m in (None, mask):
            expected = self.original(logits, experts, self.top_k, m)
            parts = [self.sums(z, None if m is None else m.reshape(-1)) for z in logits]
            got = value(*(sum(p[k] for p in parts) for k in range(3)))  # type: ignore[misc]
            if not torch.allclose(torch.as_tensor(expected, dtype=torch.float32), got, rtol=1e-5, atol=0):
                raise ConfigurationError(
                    f"{type(self.module).__name__}'s load_balancing_loss_func ({float(expected):.6g} on random"
                    f" logits) is not the Switch Transformer form a pipeline computes from each stage's sums"
                    f" ({float(got):.6g}); set output_router_logits=False in the model's config, or train without"
                    " pipeline parallelism"
                )


def value(assigned: Tensor, probabilities: Tensor, rows: Tensor) -> Tensor:
    """The load-balancing loss ``E · Σ_e (assigned_e / rows) · (probabilities_e / rows)`` from the sums of every
    router call (transformers' ``load_balancing_loss_func``, in float32 as there)."""
    rows = rows.to(torch.float32)
    return (assigned.float() / rows * (probabilities.float() / rows)).sum() * assigned.shape[-1]


_uncounted = ContextVar("uncounted", default=False)


@contextmanager
def uncounted() -> Iterator[None]:
    """While open (a block's copies run for verification or tracing), no router call counts towards a balancing
    loss (:mod:`lightning_parallel.pipeline.balancing` asks :func:`counted`)."""
    token = _uncounted.set(True)
    try:
        yield
    finally:
        _uncounted.reset(token)


def counted() -> bool:
    return not _uncounted.get()


def balancing_of(module: nn.Module) -> Balancing | None:
    """The mixture in ``module`` that computes a load-balancing loss from every layer's router logits, or ``None``;
    a config asking for one that this cannot decompose is refused (:meth:`Balancing.check`)."""
    found = [
        (n, m) for n, m in module.named_modules() if getattr(getattr(m, "config", None), "output_router_logits", 0)
    ]
    if not found:
        return None
    name, model = found[0]
    # the family's module: the first class up the model's MRO whose module defines the function (a user's subclass
    # of a transformers model calls the family's)
    family = next((m for m in (sys.modules.get(c.__module__) for c in type(model).__mro__)
                   if callable(getattr(m, _NAME, None))), None)  # fmt: skip
    original = getattr(family, _NAME, None)
    recorders = getattr(model, "_can_record_outputs", None) or {}
    recorder = recorders.get("router_logits")
    router = getattr(recorder, "target_class", recorder)
    top_k = getattr(model.config, "num_experts_per_tok", None)
    experts = next(
        (getattr(model.config, k) for k in _EXPERTS if isinstance(getattr(model.config, k, None), int)), None
    )
    if original is None or not isinstance(router, type) or not isinstance(top_k, int) or experts is None:
        raise ConfigurationError(
            f"{name or type(model).__name__} has output_router_logits=True, but its family has no"
            f" {_NAME} with a router_logits recorder and config.num_experts_per_tok and a number of experts"
            f" ({', '.join(_EXPERTS)}) to compute it from each pipeline stage's routers; set"
            " output_router_logits=False, or train without pipeline parallelism"
        )
    index, layer_name = getattr(recorder, "index", 0), getattr(recorder, "layer_name", None)
    original = getattr(original, "__wrapped__", original)
    spec = Balancing(model, family, original, router, index or 0, layer_name, 0, experts, top_k)
    spec.routers = sum(spec.is_router(n, m) for n, m in model.named_modules())
    spec.check()
    return spec


@contextmanager
def computed_by(spec: Balancing, compute: Callable[[tuple, int, Any], Tensor]) -> Iterator[None]:
    """While open, the family's ``load_balancing_loss_func`` is ``compute(gate_logits, num_experts,
    attention_mask)`` (a pipeline's loss from every stage's sums; it checks the family's top-k is the config's)."""
    module = spec.family
    original = getattr(module, _NAME)
    signature = inspect.signature(spec.original)

    def load_balancing_loss_func(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        logits, experts, top_k, mask = bound.args[:4]
        if top_k != spec.top_k:
            raise ConfigurationError(f"{_NAME} was called with top_k={top_k}, the config says {spec.top_k}")
        return compute(logits, experts, mask)

    setattr(module, _NAME, load_balancing_loss_func)
    try:
        yield
    finally:
        setattr(module, _NAME, original)


def _family(module: Any) -> bool:
    return getattr(module, "__name__", "").startswith("transformers.models.")


def _gathering(original: Callable[..., Any], groups: list[tuple[Any, bool]]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    def load_balancing_loss_func(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        values = bound.arguments
        first = next(iter(values))  # the routers' logits: one (tokens, experts) tensor per layer
        if isinstance(values[first], (tuple, list)):
            values[first] = type(values[first])(_gather(t, groups) for t in values[first])
        mask = values.get("attention_mask")
        if isinstance(mask, Tensor):
            if any(summed for _, summed in groups):  # sequence shards: a rank's logits are its part of every row
                raise ConfigurationError(
                    "a mixture's load-balancing loss with an attention mask under sequence parallelism is not"
                    " supported: drop the mask (causal rows need none) or sequence_parallel_size"
                )
            # one row of every rank's tokens, in the logits' order (the replicas' rows may differ in length)
            values["attention_mask"] = _gather(mask.reshape(-1), groups).unsqueeze(0)
        return original(*bound.args, **bound.kwargs)

    load_balancing_loss_func.gathers = True  # type: ignore[attr-defined]
    return load_balancing_loss_func


def _gather(t: Tensor, groups: list[tuple[Any, bool]]) -> Tensor:
    for group, summed in groups:
        t = _collectives.all_gather_rows(_GradientOver.apply(t, group) if summed else t, group)
    return t


class _GradientOver(torch.autograd.Function):
    """Identity; the gradient divided by the group's size (the copies' sum over ranks whose gradients sum)."""

    @staticmethod
    def forward(ctx: Any, t: Tensor, group: Any) -> Tensor:
        ctx.size = _collectives.group_size(group)
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad / ctx.size, None


__all__ = ["Balancing", "balancing_of", "computed_by", "counted", "over_the_batch", "uncounted", "value"]
