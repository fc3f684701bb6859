"""Sharded checkpoints for model-parallel layouts, through ``torch.distributed.checkpoint`` (DCP).

Each rank contributes its own parameters under their **original** names; parameters held by several
ranks (replicated pre/post-trunk) carry the same key everywhere and DCP writes them once. Optimizer
state is keyed by parameter name too, never by position (positions differ per stage). The rest of
Lightning's checkpoint (loops, callbacks, hyper-parameters) is written by global rank 0 as
``lightning.pt`` in the same directory. Never: rank 0 writing its own partial ``state_dict`` (review H8).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.optim import Optimizer

from lightning_parallel import _collectives

META_FILE = "lightning.pt"


def local_state_dict(module: nn.Module) -> dict[str, Any]:
    return {k: v for k, v in module.state_dict().items() if not (torch.is_tensor(v) and v.device.type == "meta")}


def optimizer_state_by_name(module: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    names = {id(p): n for n, p in module.named_parameters()}
    state = {names[id(p)]: dict(s) for p, s in optimizer.state.items()}
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
        for g in optimizer.param_groups
    ]
    return {"state": state, "param_groups": groups}


def save_sharded(checkpoint: dict[str, Any], path: str | os.PathLike, is_global_zero: bool) -> None:
    """Write ``checkpoint`` as a DCP directory at ``path`` (every rank must call this)."""
    path = os.fspath(path)
    tensors = {"state_dict": checkpoint["state_dict"]}
    rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    # optimizer param groups differ per stage: keep them out of DCP's key space (it would write one rank's)
    groups = []
    for i, opt_state in enumerate(checkpoint.get("optimizer_states", [])):
        tensors[f"optimizer_{i}"] = opt_state["state"]
        groups.append(opt_state["param_groups"])
    dcp.save(tensors, checkpoint_id=path)
    all_groups = _collectives.all_gather_object(groups)
    if is_global_zero:
        rest["optimizer_param_groups"] = all_groups
        torch.save(rest, os.path.join(path, META_FILE))
    _collectives.barrier()
