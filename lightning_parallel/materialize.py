"""Deferred initialisation: materialise a model built on the meta device, only what this rank holds.

Lightning's large-model path builds a model without memory: under the lightning-parallel strategies,
``configure_model()`` and ``Trainer.init_module(empty_init=True)`` put its parameters and buffers on the
meta device. Set-up then places the stages first (the blocks of other stages stay on meta) and calls
:func:`materialize_` for the rest, which

1. gives every meta tensor that this rank holds real, uninitialised memory on the device (a parameter
   shared by several modules, such as tied embeddings, stays one parameter), filled with NaN;
2. initialises module by module: each module that directly owns a materialised tensor runs its own
   ``reset_parameters()`` (``_reset_parameters()`` for ``nn.MultiheadAttention``), the convention of
   torch's modules that FSDP and Lightning's ``ModelParallelStrategy`` also rely on, under a generator
   seeded from ``(seed, the module's qualified name)`` (:func:`module_seed`);
3. refuses, naming them, tensors left unset: a module without ``reset_parameters()``, a buffer its reset
   does not compute (a RoPE table, say). With a checkpoint to restore (``ckpt_path=``), the tensors it
   holds may stay unset, since the restore overwrites them; non-persistent buffers may not.

The values depend only on the seed and the module's name, not on which rank materialises which module or
in what order, so one process calling :func:`initialize_` on the whole model gets exactly the same
parameters: that is the single-process run a deferred layout is compared with (docs/design.md, "Deferred
initialisation"). A model's own eager initialisation code (e.g. nanoGPT's ``self.apply(_init_weights)``
in ``__init__``) ran on meta and has no effect; give such modules a ``reset_parameters()``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_parallel.anatomy.base import ConfigurationError


def module_seed(seed: int, name: str) -> int:
    """A generator seed for module ``name``, stable across processes and Python runs."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _reset(module: nn.Module) -> Optional[Callable[[], Any]]:
    for attr in ("reset_parameters", "_reset_parameters"):
        fn = getattr(module, attr, None)
        if callable(fn):
            return fn
    return None


def _direct(module: nn.Module) -> Iterable[tuple[str, Tensor, bool]]:
    """``(name, tensor, is_parameter)`` of the tensors ``module`` owns itself (not its children's)."""
    for name, p in module._parameters.items():
        if p is not None:
            yield name, p, True
    for name, b in module._buffers.items():
        if b is not None:
            yield name, b, False


def materialize_(
    root: nn.Module,
    device: torch.device,
    seed: int,
    skip: Iterable[nn.Module] = (),
    restoring: bool = False,
) -> list[str]:
    """Materialise and initialise the meta tensors of ``root`` outside the modules in ``skip``.

    Returns the qualified names of the materialised tensors. ``restoring``: a checkpoint will be loaded
    into the model after set-up, so state-dict entries may be left for it to fill.
    """
    skipped = {id(m) for s in skip for m in s.modules()}
    held = [(n, m) for n, m in root.named_modules() if id(m) not in skipped]
    fresh: dict[int, Tensor] = {}
    owners: list[tuple[str, nn.Module]] = []
    names: list[str] = []
    for prefix, module in held:
        owns = False
        for name, t, is_param in _direct(module):
            if id(t) in fresh or t.is_meta:
                new = fresh.get(id(t))
                if new is None:
                    data = torch.empty_like(t, device=device)
                    if data.is_floating_point() or data.is_complex():
                        data.fill_(float("nan"))
                    new = nn.Parameter(data, requires_grad=t.requires_grad) if is_param else data
                    fresh[id(t)] = new
                (module._parameters if is_param else module._buffers)[name] = new
                names.append(f"{prefix}.{name}" if prefix else name)
                owns = True
        if owns:
            owners.append((prefix, module))
    with _forked_rng(device):
        for prefix, module in owners:
            reset = _reset(module)
            if reset is not None:
                torch.manual_seed(module_seed(seed, prefix))
                with torch.no_grad():
                    reset()
    _check_set(root, held, {id(t) for t in fresh.values()}, restoring)
    return names


def _forked_rng(device: torch.device) -> Any:
    if device.type == "cpu":
        return torch.random.fork_rng(devices=[])
    return torch.random.fork_rng(devices=[device.index or 0], device_type=device.type)


def initialize_(root: nn.Module, seed: int) -> None:
    """Re-initialise every module of ``root`` (materialised, on one process) by the rule of
    :func:`materialize_`: the values a deferred layout gives the same model with the same seed."""
    device = next((t.device for t in [*root.parameters(), *root.buffers()]), torch.device("cpu"))
    with _forked_rng(device):
        for prefix, module in root.named_modules():
            if any(True for _ in _direct(module)) and (reset := _reset(module)) is not None:
                torch.manual_seed(module_seed(seed, prefix))
                with torch.no_grad():
                    reset()


def _check_set(root: nn.Module, held: list[tuple[str, nn.Module]], fresh: set[int], restoring: bool) -> None:
    """Refuse every materialised floating tensor that no ``reset_parameters()`` set (NaN left in it)."""
    persistent = set(root.state_dict(keep_vars=True).keys()) if restoring else set()
    unset: dict[str, list[str]] = {}
    for prefix, module in held:
        for name, t, _ in _direct(module):
            qualified = f"{prefix}.{name}" if prefix else name
            if id(t) not in fresh or not (t.is_floating_point() or t.is_complex()) or qualified in persistent:
                continue
            if bool(torch.isnan(t.detach()).any()):
                unset.setdefault(f"{prefix or '<root>'} ({type(module).__name__})", []).append(name)
    if unset:
        listed = "; ".join(f"{m}: {', '.join(ts)}" for m, ts in list(unset.items())[:6])
        more = f" (and {len(unset) - 6} more modules)" if len(unset) > 6 else ""
        raise ConfigurationError(
            "deferred initialisation: the model was built on the meta device (configure_model() or"
            " Trainer.init_module(empty_init=True)) and these tensors have no initialisation: "
            f"{listed}{more}. Each module that owns parameters or buffers must compute them in"
            " reset_parameters() (as torch's modules do); or build the model eagerly (in __init__, or"
            " Trainer.init_module(empty_init=False)); or pass ckpt_path= to restore them (persistent ones only)"
        )
