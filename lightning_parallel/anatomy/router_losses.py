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
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from lightning_parallel import _collectives
from lightning_parallel.errors import ConfigurationError

_NAME = "load_balancing_loss_func"


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


def pipeline_refusal(module: Any) -> str | None:
    """Why ``module`` cannot train under a pipeline (``None`` if it can): a transformers config with
    ``output_router_logits=True`` computes its balancing loss from every layer's router logits where the loss is
    computed, while each stage's layers run on their own ranks."""
    routed = [n for n, m in module.named_modules() if getattr(getattr(m, "config", None), "output_router_logits", 0)]
    if not routed:
        return None
    return (
        f"{routed[0] or type(module).__name__} has output_router_logits=True: its load-balancing loss reads every"
        " layer's router logits where the loss is computed, but under a pipeline each stage's layers run on their"
        " own ranks; set output_router_logits=False in the model's config, or train with data, expert, tensor or"
        " sequence parallelism"
    )


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


__all__ = ["over_the_batch", "pipeline_refusal"]
