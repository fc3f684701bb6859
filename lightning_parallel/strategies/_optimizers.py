"""Keeping the optimizers in step with the parameters the block layer and the stage placement change."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from torch import Tensor, nn
from torch.optim import Optimizer

Replaced = list[tuple[nn.Parameter, nn.Parameter, str]]  # (old parameter, new parameter, full name)


def drop_parameters(optimizers: Iterable[Optimizer], freed: set[int]) -> None:
    """Take the parameters with ids in ``freed`` (not held by this rank) out of the optimizers and their
    state (restored from a checkpoint, possibly)."""
    if not freed:
        return
    for opt in optimizers:
        for group in opt.param_groups:
            for q in group["params"]:
                if id(q) in freed:
                    opt.state.pop(q, None)
            group["params"] = [q for q in group["params"] if id(q) not in freed]


def avoid_mixed_foreach(optimizer: Optimizer) -> None:
    """A param group that mixes DTensors (tensor-parallel shards, the pipeline's sharded embedding) with plain
    tensors steps tensor by tensor (``foreach=False``, the same update): torch's foreach kernels refuse
    such a list ("got mixed torch.Tensor and DTensor"), and optimizers default to them on CUDA."""
    from torch.distributed.tensor import DTensor

    for group in getattr(optimizer, "optimizer", optimizer).param_groups:
        kinds = {isinstance(p, DTensor) for p in group["params"]}
        if len(kinds) == 2 and "foreach" in group and not group.get("fused"):
            group["foreach"] = False


def replace_parameters(
    optimizers: Iterable[Optimizer], replaced: Replaced, convert: Callable[[str, Any, Tensor], Any]
) -> None:
    """A block's stack was committed and sharded some parameters: the optimizers hold the new ones, and
    state restored for a whole parameter is converted like it (``convert(name, value, new parameter)``)."""
    new_of = {id(old): new for old, new, _ in replaced}
    for opt in optimizers:
        for group in opt.param_groups:
            group["params"] = [new_of.get(id(q), q) for q in group["params"]]
        for old, new, name in replaced:
            if old in opt.state:
                opt.state[new] = {k: convert(name, v, new) for k, v in opt.state.pop(old).items()}
