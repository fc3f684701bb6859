"""The host-tensor rule's marks: which tensors ``lightning_parallel/`` made on the host (NCCL has no CPU backend,
so on a GPU such a tensor in a collective or a send fails with "No backend type associated with device type
cpu"; on gloo it passes). ``tests/helpers/comm_check.py`` checks every recorded op's tensors against them.

A ``TorchFunctionMode`` taints a tensor that a factory (``torch.zeros``, ``empty``, ``ones``, ``full``,
``tensor``, ``as_tensor``, ``arange``, ``rand[n|int]``, ...; not the ``*_like`` ones, which inherit a device)
creates without a ``device=`` (or with ``None``) when called directly from ``lightning_parallel/``, and the
result of ``.cpu()`` called from there. Every op taking a tainted tensor taints its outputs (views,
arithmetic, casts, copies into new tensors), except in-place ops (their target keeps its device), ops given a
``device=``, and a CPU scalar (0-dim) meeting device tensors (CUDA accepts those). ``.to(device)``,
``.to(tensor)`` and ``.cuda()`` set the output's taint from the destination (when ``.to`` returns its input,
as it does here for the host, the input loses its taint: a possible miss, never a false report). ``.cpu()``
from the package returns a fresh alias (a GPU would return a new tensor), so that only the copy is a host
tensor. Only factory and ``.cpu()`` calls inspect frames; every other op costs a lookup per tensor argument.
Code outside ``lightning_parallel/`` (Lightning, torch, the tests) never taints: its tensors are not the
package's to place.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

import lightning_parallel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(lightning_parallel.__file__ or "")))
package_dir = os.path.join(ROOT, "lightning_parallel") + os.sep  # frames under it are "the package" (tests patch it)
TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
TAINT: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> "file:line (function)" where its host copy was made
_INPLACE_DUNDERS = {
    f"__i{op}__" for op in ("add sub mul truediv floordiv mod pow and or xor lshift rshift matmul".split())
}
_INPLACE_DUNDERS.add("__setitem__")


def where(frame: Any) -> str:
    path = os.path.abspath(frame.f_code.co_filename)
    for root in (ROOT + os.sep, os.sep + "site-packages" + os.sep):
        if root in path:
            path = path.split(root, 1)[1]
    return f"{path}:{frame.f_lineno} ({frame.f_code.co_name})"


def tensors(value: Any) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for t in value if isinstance(t, Tensor)]
    return []


class HostTaint(TorchFunctionMode):
    """Taints host tensors made by ``lightning_parallel/`` (module docstring); cheap: frames only for factories."""

    FACTORIES = {
        torch.zeros,
        torch.empty,
        torch.ones,
        torch.full,
        torch.arange,
        torch.randn,
        torch.rand,
        torch.randint,
        torch.randperm,
        torch.linspace,
        torch.logspace,
        torch.eye,
        torch.empty_strided,
    }
    DATA = {torch.tensor, torch.as_tensor, torch.from_numpy}

    def __init__(self) -> None:
        super().__init__()
        self.kinds: dict[Any, str] = {}

    def _kind(self, func: Any) -> str:
        name = getattr(func, "__name__", "")
        if func in self.FACTORIES or func in self.DATA:
            kind = "factory"
        elif name in ("cpu", "to", "cuda"):
            kind = name
        elif (name.endswith("_") and not name.endswith("__")) or name in _INPLACE_DUNDERS:
            kind = "inplace"
        else:
            kind = "op"
        self.kinds[func] = kind
        return kind

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        kind = self.kinds.get(func) or self._kind(func)
        out = func(*args, **kwargs)
        if kind == "inplace" or "out" in kwargs:  # the target keeps its device and its mark
            return out
        if kind in ("to", "cuda"):
            dest = next((a for a in (*args[1:], *kwargs.values()) if isinstance(a, Tensor)), None)
            named = kwargs.get("device") is not None or any(
                isinstance(a, (str, torch.device, int)) and not isinstance(a, bool) for a in args[1:2]
            )
            if dest is not None or named or kind == "cuda":
                if dest is not None and dest in TAINT:
                    _taint(out, TAINT[dest])
                elif isinstance(out, Tensor) and out in TAINT:
                    del TAINT[out]
                return out
        elif kwargs.get("device") is not None:  # a device named: not the host's doing
            return out
        elif kind == "factory" and not (func in self.DATA and args and isinstance(args[0], Tensor)):
            if not (func is torch.as_tensor and len(args) > 2):  # as_tensor(data, dtype, device)
                caller = _caller()
                if caller is not None:
                    _taint(out, where(caller))
            return out
        elif kind == "cpu" and isinstance(out, Tensor):
            caller = _caller()
            if caller is not None and (out is not args[0] or type(out) is Tensor):
                if out is args[0]:  # on the host already (always, here): a GPU would return a new tensor
                    out = out.view_as(out)
                _taint(out, where(caller))
                return out
        if len(TAINT):
            origin = _tainted_origin(args, kwargs)
            if origin is not None:
                _taint(out, origin)
        return out


def _caller() -> Any:
    """The frame that called the torch function, if it is in ``lightning_parallel/`` (modes' frames skipped)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_name == "__torch_function__":
        frame = frame.f_back
    if frame is not None and frame.f_code.co_filename.startswith(package_dir):
        return frame
    return None


def _taint(out: Any, origin: str) -> None:
    for t in tensors(out):
        TAINT[t] = origin


def _tainted_origin(args: tuple, kwargs: dict) -> str | None:
    """Where the host tensor among the inputs came from, unless only CPU scalars meet device tensors."""
    origin, host_full, device_full = None, False, False
    for value in (*args, *kwargs.values()):
        for t in tensors(value):
            made = TAINT.get(t)
            if made is not None:
                origin = origin or made
                host_full = host_full or t.dim() > 0
            elif t.dim() > 0:
                device_full = True
    return None if origin is None or (device_full and not host_full) else origin
