"""The block's own forward, where the user named what it needs: ``tp_plan=`` (shards by module styles; the
forward must then be shape-agnostic, which verification checks) and ``mlp_module=`` (the MLP to chunk).
It cannot split attention, so it serves neither sequence parallelism nor HelixPipe."""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_parallel.block_protocol import Split
from lightning_parallel.errors import Unsupported


class OwnAnatomy:
    name = "the block's own forward"
    family_level = True

    @classmethod
    def of(cls, block: nn.Module, config: Any) -> OwnAnatomy:
        if config.sp > 1:
            raise Unsupported("the block's own forward cannot distribute its attention (sequence parallelism)")
        if config.tp > 1 and config.tp_plan is None:
            raise Unsupported("no tp_plan= names the projections to shard")
        if config.mlp_chunks > 1 and config.mlp_module is None:
            raise Unsupported("no mlp_module= names the MLP to chunk")
        if config.tp_sequence_parallel:
            raise Unsupported("tp_sequence_parallel=True needs a forward that slices the tokens between projections")
        return cls()

    def heads(self, block: nn.Module) -> tuple[int, int]:
        raise Unsupported("the block's own forward does not know its head counts")

    def helix_split(self, block: nn.Module, config: Any, tp_layout: Any = None, prefix: str = "") -> Split:
        raise Unsupported("the block's own forward cannot be cut at its attention call")

    def local_forward(self, block: nn.Module, config: Any, tp_layout: Any, prefix: str) -> Any:
        from lightning_parallel import tensor_parallel as tp
        from lightning_parallel.block_protocol import OwnForward
        from lightning_parallel.mlp_chunks import chunk_mlp

        if config.tp > 1:
            plan = tp.expand_plan(block, dict(config.tp_plan))
            tp.check_divisible(block, plan, config.tp)
            tp.shard_modules(block, prefix, plan, config.tp_mesh, tp_layout)
        if config.mlp_chunks > 1:
            try:
                owner = block.get_submodule(config.mlp_module)
            except AttributeError:
                raise ValueError(
                    f"mlp_module={config.mlp_module!r}: {type(block).__name__} has no such submodule"
                ) from None
            chunk_mlp(owner, "forward", config.mlp_chunks, -2, type(block).__name__)
        return OwnForward()
