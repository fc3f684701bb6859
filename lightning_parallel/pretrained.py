"""Load a Hugging Face ``save_pretrained`` directory (safetensors, one file or an index of several) into a
model that a lightning-parallel strategy has placed: each rank reads only the tensors it holds, one at a
time, and copies its part (a pipeline stage skips the other stages' blocks; a shard of tensor, full data or
stage-sharded parallelism takes its slice), so no rank builds the whole model, and a pipeline stage does
not read the others' blocks. A block still waiting on the meta device for its first call (tensor
parallelism and helix defer blocks so: docs/design.md, "Deferred initialisation") reads its tensors from
the directory then, when it materialises (so the directory must exist until the first training step; its
shapes are checked then), with no second read of a tied pair stored under two names inside it; a shard
reads its whole tensor once and keeps its slice.

Call it once the strategy has set the model up, e.g. in ``on_fit_start``; with a model built on the meta
device in ``configure_model`` (deferred initialisation) the tensors it loads count as initialised::

    def configure_model(self):
        with torch.device("meta"):
            self.model = AutoModelForCausalLM.from_config(config)

    def on_fit_start(self):
        lightning_parallel.load_pretrained(self.model, "path/to/save_pretrained_dir", self.trainer)

Under any other strategy (one device, Lightning's own) it loads the whole directory into ``module``.
Values are copied as stored, cast to each tensor's dtype. Strict: a tensor of ``module`` the directory
lacks is an error, unless it is the same parameter as one it has (a tied head, which ``save_pretrained``
writes once; if the directory holds both names, they must be equal); keys the module does not have are
returned. Refused: a model not placed yet (on meta: call it after set-up, not in ``configure_model``), and
a pipeline step or evaluation loop in progress (its whole copies of the embedding and head would be
loaded, not the stored shards).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_parallel.errors import ConfigurationError


def load_pretrained(module: nn.Module, path: str | os.PathLike, trainer: Optional[Any] = None) -> list[str]:
    """Copy the tensors of the ``save_pretrained`` directory ``path`` into ``module`` (see the module
    docstring); returns the directory's keys ``module`` does not have. ``trainer``: the ``Trainer`` (or its
    strategy) that set ``module`` up; default, the trainer of ``module`` if it is a LightningModule."""
    from safetensors import safe_open

    files = _files(os.fspath(path))
    strategy = getattr(trainer, "strategy", trainer)
    if strategy is None:  # the trainer of a LightningModule
        strategy = getattr(getattr(module, "_trainer", None), "strategy", None)
    targets = module.state_dict(keep_vars=True)
    prefix, convert = _placement(module, strategy)
    pending = {n[len(prefix) :] for n in _pending_names(strategy) if n.startswith(prefix)}
    placed = {k: t for k, t in targets.items() if k not in pending}
    _check_placed(module, placed, strategy if convert is not None else None)
    objects = {}
    for name, t in targets.items():
        objects.setdefault(id(t), []).append(name)
    found: dict[int, str] = {}  # id(tensor) -> the key it was loaded from
    unused: list[str] = []
    by_file: dict[str, list[str]] = {}
    for key, file in files.items():
        by_file.setdefault(file, []).append(key)
    with torch.no_grad():
        for file, keys in by_file.items():
            with safe_open(file, framework="pt", device="cpu") as f:
                for key in keys:
                    target = targets.get(key)
                    if target is None:
                        unused.append(key)
                        continue
                    first = found.setdefault(id(target), key)
                    if target.is_meta:  # another pipeline stage's block, or a pending one: not read now
                        continue
                    value = f.get_tensor(key)
                    if tuple(value.shape) != tuple(target.shape):
                        raise ConfigurationError(
                            f"{os.fspath(path)}: {key!r} has shape {tuple(value.shape)}, the model's"
                            f" {tuple(target.shape)}"
                        )
                    if first != key:  # a tied pair stored under both names: they must agree
                        if not _equal(target, value, prefix + key, convert):
                            raise ConfigurationError(
                                f"{os.fspath(path)}: {key!r} and {first!r} are one (tied) parameter of the model"
                                " but hold different values"
                            )
                        continue
                    _copy_(target, value, prefix + key, convert)
    missing = [names[0] for i, names in objects.items() if i not in found]
    if missing:
        raise ConfigurationError(
            f"{os.fspath(path)} lacks {len(missing)} tensor(s) of {type(module).__name__}: {sorted(missing)[:8]}"
        )
    if pending:  # read when each block materialises (strategy.defer_restore)
        strategy.defer_restore(model=_reader(files, prefix))
    return sorted(unused)


def _pending_names(strategy: Optional[Any]) -> set[str]:
    names = getattr(strategy, "pending_names", None)
    return names() if callable(names) else set()


def _reader(files: dict[str, str], prefix: str) -> Callable[[list[str]], dict[str, Tensor]]:
    """A pending block's source: its tensors (the LightningModule's names) read from the directory."""
    from safetensors import safe_open

    def read(names: list[str]) -> dict[str, Tensor]:
        wanted: dict[str, list[tuple[str, str]]] = {}
        for name in names:
            key = name[len(prefix) :] if name.startswith(prefix) else None
            if key is not None and key in files:
                wanted.setdefault(files[key], []).append((name, key))
        out = {}
        for file, pairs in wanted.items():
            if not os.path.isfile(file):
                raise ConfigurationError(
                    f"load_pretrained: {file!r} is gone; blocks still on meta when it was called (tensor parallelism,"
                    " helix) read their tensors at their first call, so the directory must exist until then"
                )
            with safe_open(file, framework="pt", device="cpu") as f:
                out.update({name: f.get_tensor(key) for name, key in pairs})
        return out

    return read


def _check_placed(module: nn.Module, targets: dict[str, Tensor], strategy: Optional[Any]) -> None:
    """Refuse a model no strategy has placed yet, and a pipeline step or evaluation in progress."""
    meta = [n for n, t in targets.items() if t.is_meta]
    pipeline = strategy is not None and hasattr(strategy, "outer_at_rest") and strategy.parallel_dims.pp > 1
    if meta and (len(meta) == len(targets) or not pipeline):
        raise ConfigurationError(
            f"{len(meta)} tensor(s) of {type(module).__name__} are on the meta device (e.g. {meta[0]!r}): the model"
            " is not placed yet; call load_pretrained after the strategy's set-up (e.g. in on_fit_start), with the"
            " trainer"
        )
    if pipeline and not strategy.outer_at_rest:
        raise ConfigurationError(
            "load_pretrained during a pipeline training step or evaluation loop would load the step's copies of"
            " the parameters outside the trunk, not their stored shards; call it in on_fit_start"
        )


def _files(path: str) -> dict[str, str]:
    """key -> the safetensors file holding it."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {k: os.path.join(path, v) for k, v in weight_map.items()}
    single = os.path.join(path, "model.safetensors")
    if not os.path.isfile(single):
        raise ConfigurationError(
            f"{path!r} holds neither model.safetensors nor model.safetensors.index.json (a save_pretrained"
            " directory written with safe_serialization=True, the default)"
        )
    from safetensors import safe_open

    with safe_open(single, framework="pt", device="cpu") as f:
        return {k: single for k in f.keys()}


def _placement(module: nn.Module, strategy: Optional[Any]) -> tuple[str, Any]:
    """The module's prefix inside the LightningModule and the strategy's conversion of a whole tensor to
    one placed like a DTensor parameter (``None`` outside lightning-parallel)."""
    from lightning_parallel.strategies.hybrid import HybridParallelStrategy

    if strategy is None:
        trainer = getattr(module, "_trainer", None)
        strategy = getattr(trainer, "strategy", None) if trainer is not None else None
    if not isinstance(strategy, HybridParallelStrategy) or strategy.lightning_module is None:
        return "", None
    lm = strategy.lightning_module
    prefix = next((f"{n}." for n, m in lm.named_modules() if m is module and n), "")
    if prefix == "" and module is not lm:
        raise ConfigurationError(f"{type(module).__name__} is not part of {type(lm).__name__}, the strategy's module")
    return prefix, strategy.placed_like


def _equal(target: Tensor, value: Tensor, name: str, convert: Any) -> bool:
    if isinstance(target, DTensor):
        return torch.equal(target.to_local(), convert(name, value.to(target.dtype), target).to_local())
    return torch.equal(target, value.to(device=target.device, dtype=target.dtype))


def _copy_(target: Tensor, value: Tensor, name: str, convert: Any) -> None:
    if isinstance(target, DTensor):
        if convert is None:
            raise ConfigurationError(f"{name!r} is a DTensor but no lightning-parallel strategy placed it")
        target.to_local().copy_(convert(name, value.to(target.dtype), target).to_local())
    else:
        target.copy_(value.to(device=target.device, dtype=target.dtype))
