"""Deferred blocks kept on meta until their first call (docs/design.md, "Deferred initialisation"): under
tensor parallelism and helix what a rank keeps of a block is known only once the block's anatomy has
verified at its first call, so a deferred block is *pending* until then and materialises there, one at a
time, by the rule of :mod:`lightning_parallel.materialize`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch

from lightning_parallel import _collectives
from lightning_parallel.anatomy.base import ConfigurationError
from lightning_parallel.blocks import BlockConfig
from lightning_parallel.materialize import check_set, materialize_
from lightning_parallel.mesh import DP, SP, TP
from lightning_parallel.tensor_parallel import local
from lightning_parallel.trunk import Trunk


class PendingBlocksMixin:
    """Mixed into ``HybridParallelStrategy``, which sets ``_pending`` at set-up (:func:`pending_blocks`)."""

    _pending: list[torch.nn.Module]
    _pending_hooks: dict[int, Any]
    _materialized: list[Any]
    _init_seed: int
    _mesh: Any

    def _hook_pending(self) -> None:
        hook = _first_call_hook(self)
        self._pending_hooks = {id(b): b.register_forward_pre_hook(hook) for b in self._pending}

    def _deferred_blocks(
        self, config: BlockConfig, trunk: Trunk, local: list[tuple[int, torch.nn.Module]]
    ) -> list[torch.nn.Module]:
        """The blocks of a deferred model materialised at their first call, not at set-up: tensor parallelism
        shards a block only once its first call has verified the stack, so materialising every block at set-up
        would hold them all whole."""
        return [b for _, b in local] if config.tp_mesh is not None else []

    def materialize_pending(self, blocks: Optional[list[torch.nn.Module]] = None, check: bool = False) -> None:
        """Materialise the deferred blocks still on meta (``blocks``: those among them; default: all), by the
        rule of set-up (the same values: they depend on the seed and the module names only; no collective
        runs, except the first call's broadcast below). Called at a block's first call, and before anything
        reads or writes the model's values as a whole (a checkpoint's restore or save, ``load_pretrained``,
        ``full_state_dict``). The optimizers hold
        the new parameters in place of the meta ones. ``check``: refuse tensors nothing initialised now (their
        first call: nothing can restore them later), and make every rank start from rank 0's values of the
        block (as set-up's broadcast does for what is materialised there: a reset that does not draw from
        torch's seeded generator would differ between ranks); every rank holding the block calls it then, in
        the same order. Otherwise they are checked when the next loop starts. Runs outside inference mode
        (a first call in evaluation): the parameters are for training too."""
        todo = [b for b in self._pending if blocks is None or any(b is x for x in blocks)]
        if not todo:
            return
        lm = self.lightning_module
        assert lm is not None
        prefix = {id(m): n for n, m in lm.named_modules()}
        for block in todo:
            before = dict(block.named_parameters())
            with torch.inference_mode(False):
                record = materialize_(lm, self.root_device, self._init_seed, only=[block])
                if check:
                    self._broadcast_block(block)
            after = dict(block.named_parameters())
            self._pending = [b for b in self._pending if b is not block]
            self._pending_hooks.pop(id(block)).remove()
            name = prefix[id(block)]
            new = [(before[n], after[n], f"{name}.{n}") for n in before if after[n] is not before[n]]
            self._replace_parameters(new)
            if check and (message := check_set(record)) is not None:
                raise ConfigurationError(message)
            if not check:
                self._materialized.append(record)

    def _broadcast_block(self, block: torch.nn.Module, axes: tuple[str, ...] = (DP, SP, TP)) -> None:
        """Rank 0's values of a block just materialised, along the mesh axes whose ranks all hold it whole."""
        if self._mesh is None:
            return
        tensors = [local(t.data) for t in [*block.parameters(), *block.buffers()] if not t.is_meta]
        for axis in axes:
            if self._mesh[axis].size() > 1:
                _collectives.broadcast_(tensors, self._mesh.get_group(axis))

    def _materialize_at_first_call(self, block: torch.nn.Module) -> None:
        self.materialize_pending([block], check=True)


def _first_call_hook(strategy: PendingBlocksMixin) -> Callable[[torch.nn.Module, Any], None]:
    """A forward pre-hook materialising a deferred block at its first call; a function, so that a copy of the
    block (``copy.deepcopy``) shares it rather than copying the strategy (a copy is never pending: no-op)."""

    def hook(block: torch.nn.Module, args: Any) -> None:
        strategy._materialize_at_first_call(block)

    return hook


def _self_contained(root: torch.nn.Module, block: torch.nn.Module) -> bool:
    """No tensor of ``block`` is also held by a module outside it: one materialised alone would split a tie."""
    inside = {id(t) for t in [*block.parameters(), *block.buffers()]}
    own = {id(m) for m in block.modules()}
    for module in root.modules():
        if id(module) not in own:
            tensors = [*module._parameters.values(), *module._buffers.values()]
            if any(t is not None and id(t) in inside for t in tensors):
                return False
    return True


def _has_meta(module: torch.nn.Module) -> bool:
    return any(t.is_meta for t in [*module.parameters(), *module.buffers()])


def pending_blocks(root: torch.nn.Module, candidates: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The candidates that are deferred (a tensor on meta) and self-contained (no tie would split)."""
    return [b for b in candidates if _has_meta(b) and _self_contained(root, b)]
