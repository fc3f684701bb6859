"""Checkpoints that work like Lightning's under every layout: sharded save, exact resume, any-layout
resume, plain export.

Format: a directory written with ``torch.distributed.checkpoint`` (DCP), one shard file per rank, no
gather to one rank (optimizer-state sharding's chunks too: :mod:`lightning_parallel.flat_chunks`). Keys are
the model's **original** parameter names: ``state_dict.<name>`` for the
model, ``optimizer_<i>`` for optimizer i's state keyed by parameter name (never by position: positions
differ per stage and per layout). A parameter held by several ranks (replicated pre/post-trunk, data
parallel copies) carries the same key everywhere and DCP writes it once. Global rank 0 adds
``lightning.pt`` with the rest of Lightning's checkpoint (loops, callbacks, LR schedulers, hyper-
parameters), each optimizer group's hyper-parameters and the full, ordered parameter names of every
group (``group_names``) so that the positional form a plain checkpoint needs can be rebuilt. Each rank
also writes its default generators' states (``lp_rng.<global rank>``, :mod:`lightning_parallel.rng`): the
dropout masks of the steps after a resume are those of the uninterrupted run.

Saving is atomic: every rank writes into ``<path>.partial``; only after all ranks finished (DCP
gathers every rank's write result and raises on all of them if one failed) does rank 0 move the
directory to ``<path>``. An interrupted save leaves the previous checkpoint at ``<path>`` untouched.

Loading reads on every rank without collectives (``no_dist``), and only the keys the rank holds
(:func:`load_sharded` with ``held``; DCP's planner with those keys), so any layout - another pipeline
size, helix, data parallel, one device - takes the parameters it holds; a block still waiting on meta for
its first call reads its own keys then (:func:`read_entries`). Optimizer state is mapped by name onto
whatever parameters the rank's optimizer holds.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.optim import Optimizer

from lightning_parallel import _collectives
from lightning_parallel.errors import CheckpointError
from lightning_parallel.flat_chunks import ChunkSavePlanner

META_FILE = "lightning.pt"
FORMAT = "lightning_parallel.checkpoint/1"
_OURS = ("lp_format", "lp_group_names", "lp_group_hparams")
#: each rank's default generator states, ``{"<global rank>": {"cpu": ..., "cuda": ...}}`` (lightning_parallel.rng),
#: with ``lp_rng_world_size`` beside them: restored on resume under the same number of processes
RNG = "lp_rng"


# ------------------------------------------------------------------------------------- by name
def local_state_dict(module: nn.Module) -> dict[str, Any]:
    """The module's state this rank holds (parameters freed to meta by a placement are left out)."""
    from lightning_parallel.partial import partial_allowed

    with partial_allowed():
        state = module.state_dict()
    return {k: v for k, v in state.items() if not (torch.is_tensor(v) and v.device.type == "meta")}


def group_names(module: nn.Module, optimizer: Optimizer) -> list[list[str]]:
    """Each parameter group's parameter names, in order."""
    names = {id(p): n for n, p in module.named_parameters()}
    out = []
    for i, group in enumerate(optimizer.param_groups):
        unknown = [tuple(p.shape) for p in group["params"] if id(p) not in names]
        if unknown:
            raise CheckpointError(
                f"optimizer group {i} holds {len(unknown)} tensor(s) that are not parameters of the module (shapes"
                f" {unknown[:3]}); sharded checkpoints key optimizer state by parameter name"
            )
        out.append([names[id(p)] for p in group["params"]])
    return out


def optimizer_state_by_name(module: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    names = {id(p): n for n, p in module.named_parameters()}
    state = {names[id(p)]: dict(s) for p, s in optimizer.state.items() if id(p) in names}
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
        for g in optimizer.param_groups
    ]
    return {"state": state, "param_groups": groups}


def to_positional(saved: dict[str, Any], current: list[list[str]]) -> dict[str, Any]:
    """A by-name optimizer state as ``Optimizer.load_state_dict`` wants it for groups of ``current`` names."""
    if len(saved["param_groups"]) != len(current):
        raise CheckpointError(
            f"the checkpoint's optimizer has {len(saved['param_groups'])} parameter groups, this one"
            f" {len(current)}: configure_optimizers must build the same groups"
        )
    state, groups, index = {}, [], 0
    for i, (group, names) in enumerate(zip(saved["param_groups"], current)):
        missing = sorted(set(names) - set(group["params"]))
        if missing:
            raise CheckpointError(
                f"optimizer group {i}: parameters {missing[:5]} (of {len(missing)}) are not in the checkpoint's group"
            )
        ids = []
        for name in names:
            if name in saved["state"]:
                state[index] = saved["state"][name]
            ids.append(index)
            index += 1
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
    return {"state": state, "param_groups": groups}


def to_by_name(positional: dict[str, Any], names: list[list[str]]) -> dict[str, Any]:
    """A plain (positional) optimizer state whose groups hold the parameters ``names``, keyed by name."""
    flat = [n for group in names for n in group]
    if sum(len(g["params"]) for g in positional["param_groups"]) != len(flat):
        raise CheckpointError(
            f"the checkpoint's optimizer holds {sum(len(g['params']) for g in positional['param_groups'])}"
            f" parameters, this model's {len(flat)}: a checkpoint of another model or optimizer"
        )
    return {
        "state": {flat[i]: s for i, s in positional["state"].items()},
        "param_groups": [{**g, "params": [flat[i] for i in g["params"]]} for g in positional["param_groups"]],
    }


# ----------------------------------------------------------------------------------- save/load
def save_sharded(
    checkpoint: dict[str, Any], path: str | os.PathLike, names: list[list[list[str]]], is_global_zero: bool
) -> None:
    """Write Lightning's ``checkpoint`` (state dict and optimizer states by name) as a DCP directory at
    ``path``, atomically. Every rank must call this; ``names`` are ``group_names`` of every optimizer."""
    path = os.fspath(path)
    partial = path + ".partial"
    if is_global_zero:
        shutil.rmtree(partial, ignore_errors=True)
    _collectives.barrier()
    tensors = {"state_dict": checkpoint["state_dict"]}
    for i, opt_state in enumerate(checkpoint.get("optimizer_states", [])):
        tensors[f"optimizer_{i}"] = opt_state["state"]
    if RNG in checkpoint:  # this rank's generator states under its global rank (each rank writes its own)
        tensors[RNG] = checkpoint[RNG]
    # raises on every rank if any rank's writer failed; the planner writes optimizer-state chunks (FlatChunk)
    dcp.save(tensors, checkpoint_id=partial, planner=ChunkSavePlanner())
    if is_global_zero:
        rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states", RNG)}
        rest["lp_format"] = FORMAT
        rest["lp_group_names"] = names
        rest["lp_group_hparams"] = [
            [{k: v for k, v in g.items() if k != "params"} for g in s["param_groups"]]
            for s in checkpoint.get("optimizer_states", [])
        ]
        torch.save(rest, os.path.join(partial, META_FILE))
        _replace(partial, path)
    _collectives.barrier()


def _replace(new: str, path: str) -> None:
    old = path + ".old"
    if os.path.lexists(path):
        shutil.rmtree(old, ignore_errors=True)
        os.rename(path, old)
    os.rename(new, path)
    if os.path.isdir(old):
        shutil.rmtree(old)
    elif os.path.lexists(old):
        os.remove(old)


def is_sharded(path: str | os.PathLike) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, META_FILE))


def load_sharded(
    path: str | os.PathLike, held: Iterable[str] | None = None, weights_only: bool | None = None
) -> dict[str, Any]:
    """Lightning's checkpoint dict from a sharded directory: the model and every optimizer's state, keyed by
    parameter name (``"lp_format"`` marks it). Reads on this process only, no collectives.

    ``held``: the state-dict names this rank holds; then only their tensors (model and optimizer state) are
    read, through DCP's planner with the keys requested, and ``"lp_state_keys"`` lists every model key the
    checkpoint has (for strict loading). ``weights_only`` applies to the loops', callbacks' and hyper-parameters'
    part (``lightning.pt``) as ``torch.load`` applies it to a plain checkpoint file (``None``: torch's default)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path!r} is not a sharded checkpoint directory")
    if not os.path.isfile(os.path.join(path, META_FILE)):
        raise CheckpointError(
            f"{path!r} is not a complete lightning-parallel checkpoint: it has no {META_FILE} (an interrupted"
            f" save leaves '<path>.partial'; the last complete checkpoint is the one without the suffix)"
        )
    meta = torch.load(os.path.join(path, META_FILE), map_location="cpu", weights_only=weights_only)
    if meta.get("lp_format") != FORMAT:
        raise CheckpointError(f"{path!r}: unknown checkpoint format {meta.get('lp_format')!r}, expected {FORMAT!r}")
    keys = None
    if held is not None:
        held = list(held)
        groups = len(meta["lp_group_hparams"])
        keys = {f"state_dict.{n}" for n in held} | {f"optimizer_{i}.{n}" for i in range(groups) for n in held}
        keys.add(RNG)  # every rank's generator states (a few KiB each); each rank restores its own
    tensors = _read_all(path, keys)
    checkpoint = {k: v for k, v in meta.items() if k not in ("lp_group_hparams",)}
    if held is not None:
        checkpoint["lp_state_keys"] = _model_keys(path)
    checkpoint["state_dict"] = tensors.get("state_dict", {})
    if RNG in tensors:
        checkpoint[RNG] = tensors[RNG]
    checkpoint["optimizer_states"] = [
        {
            "state": tensors.get(f"optimizer_{i}", {}),
            "param_groups": [{**hp, "params": ns} for hp, ns in zip(hparams, meta["lp_group_names"][i])],
        }
        for i, hparams in enumerate(meta["lp_group_hparams"])
    ]
    return checkpoint


def read_entries(
    path: str | os.PathLike, names: Iterable[str], optimizers: int
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The model's tensors ``names`` (state-dict names) and, for each of the first ``optimizers`` optimizers,
    the state of those of them it has, read from a sharded directory alone (no collective): what a block
    deferred past the restore reads when it materialises."""
    names = list(names)
    keys = {f"state_dict.{n}" for n in names} if optimizers == 0 else set()
    keys |= {f"optimizer_{i}.{n}" for i in range(optimizers) for n in names}
    tensors = _read_all(os.fspath(path), keys)
    return tensors.get("state_dict", {}), [tensors.get(f"optimizer_{i}", {}) for i in range(optimizers)]


def _model_keys(path: str) -> list[str]:
    """The model's state-dict names in a DCP directory, from its metadata alone."""
    metadata = dcp.FileSystemReader(path).read_metadata()
    planner = metadata.planner_data or {}
    return sorted({planner[k][1] for k in metadata.state_dict_metadata if planner.get(k, ("",))[0] == "state_dict"})


def _read_all(path: str, keys: set[str] | None = None) -> dict[str, Any]:
    # what ``format_utils.dcp_to_torch_save`` does, without writing a file: the checkpoint (or the entries
    # under ``keys``), no pre-allocated state dict, on this process only
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    out: dict[str, Any] = {}
    try:
        _load_state_dict(
            out, storage_reader=dcp.FileSystemReader(path), planner=_EmptyStateDictLoadPlanner(keys), no_dist=True
        )
    except (Exception, CheckpointException) as err:  # assorted errors for a damaged directory; DCP's is a BaseException
        raise CheckpointError(
            f"{path!r}: the checkpoint's shards cannot be read ({type(err).__name__}: {err})"
        ) from err
    return out


def to_plain(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """A sharded checkpoint's dict as a plain single-file Lightning checkpoint (positional optimizer state,
    in the order of the original ``configure_optimizers`` groups)."""
    plain = {k: v for k, v in checkpoint.items() if k not in _OURS}
    names = checkpoint.get("lp_group_names", [])
    plain["optimizer_states"] = [to_positional(s, n) for s, n in zip(checkpoint["optimizer_states"], names)]
    return plain


def export(checkpoint_dir: str | os.PathLike, out_file: str | os.PathLike, weights_only: bool | None = None) -> None:
    """Write a sharded checkpoint as one plain Lightning ``.ckpt`` file, loadable with
    ``MyModule.load_from_checkpoint`` (and resumable) without lightning-parallel installed. ``weights_only``: as for
    :func:`load_sharded` (``False`` for a directory this process has just written itself)."""
    torch.save(to_plain(load_sharded(checkpoint_dir, weights_only=weights_only)), os.fspath(out_file))


def check_state_dict(state: dict[str, Any], expected: Iterable[str], model_name: str) -> None:
    """Raise naming the missing and unexpected keys when ``state`` is not ``expected``'s model."""
    expected = list(expected)
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in set(expected)]
    if missing or unexpected:
        raise CheckpointError(
            f"the checkpoint does not match {model_name}: {len(missing)} missing parameter(s) {missing[:5]}, "
            f"{len(unexpected)} unexpected {unexpected[:5]}"
        )
