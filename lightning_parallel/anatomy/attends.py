"""Whether a block computes attention at all, seen from the ops one eager call dispatches (milliseconds, where
tracing a recurrent mixer takes tens of seconds): HelixPipe cuts a block at its attention call and sequence
parallelism splits it there, so a block without one (a gated DeltaNet or Mamba layer of a linear-attention
hybrid) is refused before any source of anatomy traces it.

An op counts as attention if its name says so (torch's fused kernels, flash-attention's, transformers' routed
calls) or if it is a softmax over scores: a tensor of at least 3 dims whose next-to-last dim is a length of
the block's input (the queries) and whose last is at least as long (the keys, a sink appended). A router's
softmax over experts, ``(tokens, experts)``, is not.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

_SOFTMAX = {torch.ops.aten._softmax.default, torch.ops.aten.softmax.int, torch.ops.aten._safe_softmax.default}


class _Attends(TorchDispatchMode):
    def __init__(self, lengths: set[int]) -> None:
        super().__init__()
        self.lengths, self.seen = lengths, False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if "attention" in func.name() or "attn" in func.name():
            self.seen = True
        elif func in _SOFTMAX and isinstance(args[0], Tensor):
            shape = args[0].shape
            if len(shape) >= 3 and shape[-2] in self.lengths and shape[-1] >= shape[-2]:
                self.seen = True
        return func(*args, **(kwargs or {}))


def attends(block: nn.Module, sample: tuple[Tensor, tuple, dict]) -> bool:
    """Whether one call of (a copy of) ``block`` on ``sample`` computes attention; ``True`` where the call
    cannot be watched (it raises: the sources of anatomy then say why)."""
    x, args, kwargs = sample
    lengths = {int(s) for s in x.shape[:-1] if s > 1}
    watch = _Attends(lengths)
    try:
        twin = copy.deepcopy(block)
        for module in twin.modules():  # the user's hooks are not called for a look at the ops
            module._forward_pre_hooks.clear()
            module._forward_hooks.clear()
        detached = tree_map(lambda t: t.detach() if isinstance(t, Tensor) else t, (x, args, kwargs))
        with torch.no_grad(), torch.random.fork_rng(devices=[]), watch:
            # the class's own forward: the instance's may be the block layer's runner
            type(twin).forward(twin, detached[0], *detached[1], **detached[2])
    except Exception:  # noqa: BLE001
        return True
    return watch.seen
