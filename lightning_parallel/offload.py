"""Activation offload: what a block keeps for its backward waits in host memory between the two.

A recomputation policy decides what a block keeps (:mod:`lightning_parallel.recompute`); ``recompute_offload=True``
decides where: every tensor the policy keeps goes to host memory as it is produced in the forward, and comes back
to the device when the backward needs it. Under ``"none"`` that is every tensor autograd saves in the block
(saved-tensor hooks, as ``torch.autograd.graph.save_on_cpu``), parameters excepted; under ``"selective"`` and
``"no_attention"`` it is the outputs of the ops the policy keeps (attention and its log-sum-exp, matrix
products): :func:`offloading_contexts` is a selective-checkpoint pair of modes (the forward's records what the
kept ops return, the recomputation's hands it back instead of running them again, as torch's
``create_selective_checkpoint_contexts`` does) whose store is host memory. The outputs of asynchronous
collectives stay on the device (they may not be complete when produced).

On CUDA the host buffers are pinned and the device-to-host copies run on a side stream, ordered after the
producing kernel by an event, so they overlap the forward's later work; the way back is a non-blocking copy that
the consuming stream waits for (not prefetched ahead of the backward). On CPU host and device are one memory: a
tensor is still copied out and back, so the path runs and is tested for exactness (it saves nothing there).
(Activation offloading in the manner of Megatron-LM's ``--cpu-offloading`` and torchtune's
``OffloadActivations``; ZeRO-Offload, Ren et al., arXiv 2101.06840, offloads optimizer state the same way.)
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

aten = torch.ops.aten
_IGNORED = {aten.detach.default, torch.ops.prim.device.default}  # what torch's selective checkpoint ignores too


class HostCopy:
    """One tensor in host memory, and how to bring it back to its device. A DTensor (a tensor-parallel activation
    autograd saves) goes as its local shard and comes back as the same DTensor."""

    __slots__ = ("device", "event", "host", "spec")

    def __init__(self, tensor: Tensor, stream: Any) -> None:
        self.spec = None
        if isinstance(tensor, DTensor):
            self.spec = (tensor.device_mesh, tensor.placements, tensor.shape, tensor.stride())
            tensor = tensor.to_local()
        self.device = tensor.device
        if tensor.device.type == "cuda":
            self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            stream.wait_stream(torch.cuda.current_stream(tensor.device))
            with torch.cuda.stream(stream):
                self.host.copy_(tensor, non_blocking=True)
                tensor.record_stream(stream)  # the allocator keeps it until the copy is done
                self.event = torch.cuda.Event()
                self.event.record(stream)
        else:
            self.host, self.event = tensor.detach().clone(), None

    def back(self) -> Tensor:
        if self.event is None:
            out = self.host.clone()
        else:
            torch.cuda.current_stream(self.device).wait_event(self.event)
            out = self.host.to(self.device, non_blocking=True)
        if self.spec is None:
            return out
        mesh, placements, shape, stride = self.spec
        return DTensor.from_local(out, mesh, placements, run_check=False, shape=shape, stride=stride)


def _side_stream(device: torch.device) -> Any:
    return torch.cuda.Stream(device) if device.type == "cuda" else None


_STREAMS: dict[torch.device, Any] = {}


def _stream(device: torch.device) -> Any:
    if device not in _STREAMS:
        _STREAMS[device] = _side_stream(device)
    return _STREAMS[device]


def saved_to_host() -> torch.autograd.graph.saved_tensors_hooks:
    """Saved-tensor hooks that keep every tensor autograd saves (parameters excepted) in host memory."""

    def pack(t: Tensor) -> Any:
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter) or t.device.type == "meta":
            return t  # a parameter, or a view of one (its transpose in a matrix product), stays where it is
        return HostCopy(t, _stream(t.device))

    def unpack(saved: Any) -> Tensor:
        return saved.back() if isinstance(saved, HostCopy) else saved

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def offloading_contexts(
    keeps: Callable[[Any], bool], on_device: frozenset = frozenset()
) -> tuple[TorchDispatchMode, TorchDispatchMode]:
    """The ``context_fn`` pair for ``torch.utils.checkpoint``: ops for which ``keeps(op)`` are not run again by
    the recomputation; their outputs wait in host memory (``on_device`` ops' outputs stay on the device)."""
    store: dict[Any, list[Any]] = defaultdict(list)
    return _Record(keeps, on_device, store), _Replay(store)


class _Record(TorchDispatchMode):
    def __init__(self, keeps: Callable[[Any], bool], on_device: frozenset, store: dict[Any, list[Any]]) -> None:
        super().__init__()
        self.keeps, self.on_device, self.store = keeps, on_device, store

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func not in _IGNORED and self.keeps(func):
            stay = func in self.on_device
            self.store[func].append(tree_map(lambda t: _kept(t, stay), out))
        return out


class _Replay(TorchDispatchMode):
    def __init__(self, store: dict[Any, list[Any]]) -> None:
        super().__init__()
        self.store = store
        self.seen: dict[Any, int] = defaultdict(int)

    def __enter__(self) -> _Replay:
        self.seen.clear()  # one recomputation per backward (a split backward recomputes once for both halves)
        return super().__enter__()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kept = self.store.get(func)
        if func in _IGNORED or kept is None:
            return func(*args, **(kwargs or {}))
        i = self.seen[func]
        self.seen[func] += 1
        if i >= len(kept):
            raise RuntimeError(f"recompute_offload: {func} ran more often in the recomputation than in the forward")
        return tree_map(lambda t: t.back() if isinstance(t, HostCopy) else t, kept[i])


def _kept(t: Any, stay: bool) -> Any:
    if not isinstance(t, Tensor):
        return t
    t = t.detach()
    return t if stay or t.device.type == "meta" else HostCopy(t, _stream(t.device))


__all__ = ["HostCopy", "offloading_contexts", "saved_to_host"]
