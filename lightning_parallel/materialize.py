"""Deferred initialisation: materialise a model built on the meta device, only what this rank holds.

Lightning's large-model path builds a model without memory: a model built on the meta device in
``configure_model()`` (which the lightning-parallel strategies run on meta), or under
``Trainer.init_module(empty_init=True)`` (which they make a meta-device context, as Lightning's FSDP does). Set-up
then places the stages first (the blocks of other stages stay on meta) and calls :func:`materialize_` for
the rest, which

1. gives every meta tensor that this rank holds real memory on the device (a parameter shared by several
   modules, such as tied embeddings, stays one parameter). A tensor ``configure_model`` computed (its
   constructors' resets, the model's own ``self.apply(self._init_weights)``, ``nn.init.*``, a RoPE table) gets
   the value one process's eager ``configure_model`` gives it, replayed from the recorded calls
   (:mod:`lightning_parallel.init_replay`); any other is filled with NaN;
2. initialises the rest module by module: each module that directly owns a NaN-filled tensor (and no replayed
   one) runs its own ``reset_parameters()`` (``_reset_parameters()`` for ``nn.MultiheadAttention``), the
   convention of torch's modules that FSDP and Lightning's ``ModelParallelStrategy`` also rely on, under a
   generator seeded from ``(seed, the module's qualified name)`` (:func:`module_seed`); then, inside a Hugging
   Face model, that model's own ``_init_weights`` on each module, children first (its scheme, and the
   rotary tables no ``reset_parameters()`` computes), as building it eagerly does;
3. once any checkpoint has been restored (``ckpt_path=``: Lightning restores after set-up), refuses,
   naming them, the tensors nothing wrote (:func:`check_set`; a tensor's version counter counts its
   writes, so integer buffers are caught too): a module without ``reset_parameters()``, a buffer its
   reset does not compute (a RoPE table, say).

Step 2's values (``Trainer.init_module(empty_init=True)``, where one process would hold uninitialised memory)
depend only on the seed and the module's name, not on which rank materialises which module or in what order,
so one process calling :func:`initialize_` on the whole model gets exactly the same parameters: that is the
single-process run such a layout is compared with (docs/design.md, "Deferred initialisation").
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import Tensor, nn

from lightning_parallel.trunk import family_initializers

if TYPE_CHECKING:
    from lightning_parallel.init_replay import InitTape


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


def _post_order(module: nn.Module, prefix: str = "") -> Iterable[tuple[str, nn.Module]]:
    for name, child in module.named_children():
        yield from _post_order(child, f"{prefix}.{name}" if prefix else name)
    yield prefix, module


def _family_init(root: nn.Module, held: set[int], seed: int, fresh: set[int]) -> None:
    """After torch's ``reset_parameters()``, what building a model of a known family runs next
    (:func:`lightning_parallel.trunk.family_initializers`: a Hugging Face model's own
    ``_init_weights``), on every module of ``held`` it covers, children before parents (a parent may rescale
    its children), each under a seed from its name. A module whose tensors are not all ones this call
    created (``fresh``; sharded or restored before) is left alone: re-initialising it would overwrite them."""
    initializers = family_initializers(root)
    if not initializers:
        return
    for prefix, module in _post_order(root):
        init = initializers.get(id(module))
        if init is None or id(module) not in held:
            continue
        tensors = [t for t in [*module.parameters(), *module.buffers()] if not t.is_meta]
        if not tensors or any(id(t) not in fresh for t in tensors):
            continue
        torch.manual_seed(module_seed(seed, f"hugging_face:{prefix}"))
        with torch.no_grad():
            init(module)


def _direct(module: nn.Module) -> Iterable[tuple[str, Tensor, bool]]:
    """``(name, tensor, is_parameter)`` of the tensors ``module`` owns itself (not its children's)."""
    for name, p in module._parameters.items():
        if p is not None:
            yield name, p, True
    for name, b in module._buffers.items():
        if b is not None:
            yield name, b, False


@dataclass
class Materialized:
    """What :func:`materialize_` created: ``(qualified name, module, attribute, weak reference to the tensor,
    its version after the fill)`` per tensor; :meth:`unset` finds those that nothing has written since (no
    reset, no restore). The references are weak: a tensor replaced by its shard (tensor parallelism, full
    sharding) is freed at once, not kept until the check."""

    entries: list[tuple[str, nn.Module, str, Any, int]] = field(default_factory=list)

    def unset(self) -> dict[str, list[str]]:
        from torch.distributed.tensor import DTensor

        out: dict[str, list[str]] = {}
        for qualified, module, attr, ref, version in self.entries:
            current = module._parameters.get(attr, module._buffers.get(attr))
            tensor = ref()
            if isinstance(current, DTensor):  # sharded since: the fill's NaN survive in the shards
                local = current.to_local()
                unset = (local.is_floating_point() or local.is_complex()) and bool(torch.isnan(local.detach()).any())
            elif tensor is None or current is not tensor:  # replaced by its module (a reset assigning a new one)
                continue
            else:
                floating = tensor.is_floating_point() or tensor.is_complex()
                unset = tensor._version == version or (floating and bool(torch.isnan(tensor.detach()).any()))
            if unset:
                prefix = qualified.rpartition(".")[0]
                out.setdefault(f"{prefix or '<root>'} ({_class_name(module)})", []).append(attr)
        return out


def _class_name(module: nn.Module) -> str:
    """The user's class of ``module`` (FSDP2 swaps in a subclass named ``FSDP<name>``)."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule)).__name__


def materialize_(
    root: nn.Module,
    device: torch.device,
    seed: int,
    skip: Iterable[nn.Module] = (),
    only: Optional[Iterable[nn.Module]] = None,
    tape: Optional[InitTape] = None,
) -> Materialized:
    """Materialise and initialise the meta tensors of ``root`` outside the modules in ``skip`` (and, with
    ``only``, inside those modules: one piece at a time, same values); returns what was created, for
    :func:`check_set` once any checkpoint has been restored. A tensor the ``tape`` of ``configure_model`` covers
    takes its value from it (one process's eager value); a module holding one is not reset."""
    skipped = {id(m) for s in skip for m in s.modules()}
    inside = None if only is None else {id(m) for s in only for m in s.modules()}
    held = [(n, m) for n, m in root.named_modules() if id(m) not in skipped and (inside is None or id(m) in inside)]
    fresh: dict[int, Tensor] = {}
    owners: list[tuple[str, nn.Module]] = []
    record = Materialized()
    replayed: set[int] = set()
    for prefix, module in held:
        owns = taped = False
        for name, t, is_param in _direct(module):
            if id(t) in fresh or t.is_meta:
                new = fresh.get(id(t))
                if new is None:
                    from_tape = tape is not None and tape.covers(t)
                    if from_tape:
                        assert tape is not None
                        data = tape.value(t, device)
                    else:
                        data = torch.empty_like(t, device=device)
                        if data.is_floating_point() or data.is_complex():
                            data.fill_(float("nan"))
                    new = nn.Parameter(data, requires_grad=t.requires_grad) if is_param else data
                    fresh[id(t)] = new
                    if from_tape:
                        replayed.add(id(new))
                    qualified = f"{prefix}.{name}" if prefix else name
                    version = -1 if from_tape else new._version  # (a replayed value is set: NaN aside)
                    record.entries.append((qualified, module, name, weakref.ref(new), version))
                (module._parameters if is_param else module._buffers)[name] = new
                owns, taped = True, taped or id(new) in replayed
        if owns and not taped:
            owners.append((prefix, module))
    with _forked_rng(device):
        for prefix, module in owners:
            reset = _reset(module)
            if reset is not None:
                torch.manual_seed(module_seed(seed, prefix))
                with torch.no_grad():
                    reset()
        made = {id(t) for t in fresh.values() if id(t) not in replayed}
        _family_init(root, {id(m) for _, m in held}, seed, made)
    return record


def check_set(record: Materialized) -> str | None:
    """The refusal for materialised tensors that no ``reset_parameters()`` and no restored checkpoint wrote
    (any dtype: a tensor's version counts its writes), or ``None``."""
    unset = record.unset()
    if not unset:
        return None
    listed = "; ".join(f"{m}: {', '.join(ts)}" for m, ts in list(unset.items())[:6])
    more = f" (and {len(unset) - 6} more modules)" if len(unset) > 6 else ""
    return (
        "deferred initialisation: the model was built on the meta device (on meta in configure_model() or"
        " under Trainer.init_module(empty_init=True)) and these tensors were never initialised: "
        f"{listed}{more}. Each module that owns parameters or buffers must compute them in"
        " reset_parameters() (as torch's modules do); or build the model eagerly; or pass ckpt_path= to"
        " restore them (persistent ones only)"
    )


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
        everything = {id(t) for t in [*root.parameters(), *root.buffers()]}
        _family_init(root, {id(m) for m in root.modules()}, seed, everything)
