"""One trunk block's stack: what this rank applies to it (:class:`BlockConfig`), what the commits sharded
(:class:`Layouts`), and :func:`compose`, which builds the stack on the block. Innermost first:

1. **tensor parallelism**: parameters sharded per the anatomy's plan, and the forward that runs on
   the shards (the block's own, a hand-written split forward, or the traced graph localised); dropout on
   its sharded activations draws from this tp rank's stream (:mod:`lightning_parallel.rng`);
2. **chunked MLP**: inside that forward (the MLP over sequence slices);
3. **sequence parallelism**: the block's tokens scattered on entry and gathered on exit, its
   sequence-carrying arguments sliced, its attention core distributed (Ulysses or ring); or, inside
   tensor parallelism, Megatron-style sequence sharding between the projections;
4. **recomputation**: outermost, so that under tensor or sequence parallelism its policies keep the
   outputs of the collectives of 1-3 instead of running them again.

Under HelixPipe the stack is the block's split at its attention call, with 1 and 3 inside its parts. The block
layer (:mod:`lightning_parallel.blocks`) verifies a stack and commits it. Pipeline placement comes before all
of it (a rank composes only the blocks it runs); data parallelism after (gradients). Nothing links the layers
but this composition: no attributes on modules.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_parallel.block_protocol import OwnForward, Shared
from lightning_parallel.errors import ConfigurationError, Unsupported
from lightning_parallel.recompute import Recomputed, resolve_op, validate
from lightning_parallel.rng import tensor_parallel_rng, tensor_parallel_split
from lightning_parallel.sequence_parallel import (
    MODES,
    SequenceParallelLayout,
    SequenceShard,
    SplitOverSequence,
    check_heads,
    shard_dropout,
)
from lightning_parallel.tensor_parallel import TensorParallelLayout

Forward = Callable[..., Any]  # (block, x, args, kwargs, shard) -> output


@dataclass(frozen=True, kw_only=True)
class BlockConfig:
    """What this rank applies to each trunk block it runs."""

    tp_mesh: DeviceMesh | None = None
    """1-D mesh of the tensor-parallel group (``None``: no tensor parallelism)."""
    tp_plan: Mapping[str, str] | None = None
    """A user plan (``{"name pattern inside a block": style}``), replacing the anatomy's."""
    tp_sequence_parallel: bool = False
    """Megatron-style sequence sharding of norms, residuals and dropout between the projections."""
    sp_mesh: DeviceMesh | None = None
    """1-D mesh of the sequence-parallel group (``None``: no sequence parallelism)."""
    sp_mode: str = "ulysses"
    recompute: str = "none"
    every_n: int = 2
    mlp_chunks: int = 1
    offload: bool = False
    """``recompute_offload``: what the recomputation policy keeps waits in host memory (lightning_parallel.offload)."""
    mlp_module: str | None = None
    """Path of the MLP inside a block, where the anatomy does not find it."""
    attention_kernels: tuple[str, ...] = ()
    adapter: Any = None
    """``adapter=``: a hand-written adapter's name or an object implementing the adapter protocol."""
    split: bool = False
    """HelixPipe: each block is cut at its attention call (the helix runtime drives the parts)."""
    split_backward: bool = False
    """A zero-bubble schedule runs the backward as two calls (input, then weight gradients): recomputation
    must serve both (``recompute.shared_checkpoint``)."""
    sources: tuple[str, ...] | None = None
    """The sources of anatomy tried after ``adapter=``, in order; ``None``: all of
    :data:`lightning_parallel.anatomy.resolve.SOURCES` (tests narrow them, e.g. without the hand-written adapters)."""

    def __post_init__(self) -> None:
        validate(self.recompute, self.every_n, self.mlp_chunks, self.offload)
        if self.sp_mode not in MODES:
            raise ValueError(f"sequence_parallel_mode={self.sp_mode!r}; choose one of {MODES}")

    @property
    def tp(self) -> int:
        return self.tp_mesh.size() if self.tp_mesh is not None else 1

    @property
    def sp(self) -> int:
        return self.sp_mesh.size() if self.sp_mesh is not None else 1

    @property
    def needs_anatomy(self) -> bool:
        return self.split or self.tp > 1 or self.sp > 1 or self.mlp_chunks > 1

    @property
    def communicates(self) -> bool:
        return self.tp > 1 or self.sp > 1

    def not_compiled_because(self) -> str | None:
        """Why a composed block is not compiled again as a whole, or ``None``: its stack communicates inside (dynamo
        would cut the graph at every collective, or trace them into functional collectives the stack does not wait
        on), is driven in parts (HelixPipe, the zero-bubble split backward) or wraps autograd itself."""
        reasons = {
            f"tensor parallelism (tp={self.tp})": self.tp > 1,
            f"sequence parallelism (sp={self.sp})": self.sp > 1,
            "HelixPipe's split at the attention call": self.split,
            "the zero-bubble schedule's split backward": self.split_backward,
            f"recompute={self.recompute!r}": self.recompute != "none",
            "recompute_offload": self.offload,
            f"mlp_chunks={self.mlp_chunks}": self.mlp_chunks > 1,
        }
        return ", ".join(r for r, on in reasons.items() if on) or None


@dataclass
class Layouts:
    """What the committed stacks sharded, for gradients and checkpoints (filled at commit)."""

    tp: TensorParallelLayout | None = None
    sp: SequenceParallelLayout | None = None

    @classmethod
    def for_config(cls, config: BlockConfig) -> Layouts:
        tp = TensorParallelLayout(config.tp_mesh) if config.tp > 1 else None
        sp = SequenceParallelLayout(config.sp_mesh, config.sp_mode) if config.sp > 1 else None
        return cls(tp, sp)


# ---------------------------------------------------------------------------------------- the stack
class _SequenceParallel(Shared):
    """Step 3: this rank's tokens in, the whole sequence out; the inner forward distributes attention."""

    def __init__(self, inner: Forward, anatomy: Any, mesh: DeviceMesh, mode: str) -> None:
        self.inner, self.anatomy, self.mesh, self.mode = inner, anatomy, mesh, mode

    def __call__(self, block: nn.Module, x: Tensor, args: tuple, kwargs: dict) -> Any:
        dim = self.anatomy.sequence_dim(block)
        mask = self.anatomy.attention_mask(block, args, kwargs) if self.mode == "ring" else None
        shard = SequenceShard.of(self.mesh, self.mode, x.shape[dim], x.device, mask)
        local_args, local_kwargs = self.anatomy.sequence_args(block, args, kwargs, shard.index)
        mine = shard.scatter(x, dim)
        with shard_dropout(block, self.mesh, x.device):  # each rank's tokens their own dropout masks
            out = self.inner(block, mine, local_args, local_kwargs, shard)
        return _map_first(out, lambda y: shard.gather(y, dim))


class _TokenShard(Shared):
    """Step 3 inside tensor parallelism (Korthikanti et al., arXiv 2205.05198): the block holds 1/tp of the
    tokens between its projections; it takes its slice on entry and all-gathers its output on exit."""

    def __init__(self, inner: Forward, mesh: DeviceMesh) -> None:
        self.inner, self.mesh = inner, mesh

    def __call__(self, block: nn.Module, x: Tensor, args: tuple, kwargs: dict) -> Any:
        tp, T = self.mesh.size(), x.shape[1]
        if T % tp:
            raise ConfigurationError(
                f"tp_sequence_parallel=True needs the sequence length ({T}) to be divisible by"
                f" tensor_parallel_size ({tp}); pad the batch or turn tp_sequence_parallel off"
            )
        shard = SequenceShard.of(self.mesh, "ulysses", T, x.device)
        with shard_dropout(block, self.mesh, x.device):  # all of it sharded (tokens, heads): this rank's masks
            out = self.inner(block, shard.scatter(x, 1), args, kwargs, None)
        return _map_first(out, lambda y: shard.gather(y, 1))


class _TensorParallelRNG(Shared):
    """Inside step 1: the block's call is a scope of :func:`lightning_parallel.rng.tensor_parallel_rng`, so that
    dropout on sharded activations (attention heads, the MLP's hidden layer) draws from this tp rank's stream
    and dropout on replicated ones from the default generator, the same on every tp rank."""

    def __init__(self, inner: Forward, mesh: DeviceMesh) -> None:
        self.inner, self.mesh = inner, mesh

    def __call__(self, block: nn.Module, x: Tensor, args: tuple, kwargs: dict, shard: Any = None) -> Any:
        with tensor_parallel_rng(block, self.mesh, x.device):
            return self.inner(block, x, args, kwargs, shard)


class _Plain(Shared):
    """No sequence split: the inner forward with ``shard=None``."""

    def __init__(self, inner: Forward) -> None:
        self.inner = inner

    def __call__(self, block: nn.Module, x: Tensor, args: tuple, kwargs: dict) -> Any:
        return self.inner(block, x, args, kwargs, None)


class _SavedToHost(Shared):
    """Step 4 without recomputation, with ``offload``: everything the block saves for its backward waits in host
    memory (:func:`lightning_parallel.offload.saved_to_host`)."""

    def __init__(self, inner: Callable[..., Any]) -> None:
        self.inner = inner

    def __call__(self, block: nn.Module, x: Tensor, args: tuple, kwargs: dict) -> Any:
        from lightning_parallel.offload import saved_to_host

        with saved_to_host():
            return self.inner(block, x, args, kwargs)


def _map_first(out: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    if isinstance(out, Tensor):
        return fn(out)
    return type(out)([fn(out[0]), *out[1:]])


def compose(block: nn.Module, index: int, anatomy: Any, config: BlockConfig, layouts: Layouts,
            prefix: str = "") -> Callable[[nn.Module, Tensor, tuple, dict], Any]:  # fmt: skip
    """Apply ``config`` to ``block`` (in place: parameters sharded, MLP chunked) and return its forward
    ``(block, x, args, kwargs)``, in the order of the module docstring; under HelixPipe (``config.split``) the
    block's :class:`~lightning_parallel.block_protocol.Split`, which is also such a forward. ``anatomy`` is
    ``None`` when no feature needs one (recomputation alone)."""
    if config.split:
        return _split(block, anatomy, config, layouts, prefix)
    if anatomy is None:
        inner: Forward = OwnForward()
    else:  # steps 1 and 2, in the anatomy's own way
        inner = anatomy.local_forward(block, config, layouts.tp, prefix)
        if config.tp > 1 and not config.tp_sequence_parallel:  # (Megatron's sequence parallelism: _TokenShard)
            inner = _TensorParallelRNG(inner, config.tp_mesh)
    if config.sp > 1:
        heads = anatomy.heads(block)
        check_heads(*heads, config.sp, config.sp_mode, type(block).__name__, config.tp)
        stack: Any = _SequenceParallel(inner, anatomy, config.sp_mesh, config.sp_mode)
        if layouts.sp is not None:
            layouts.sp.partial += list(block.parameters())
    elif config.tp_sequence_parallel and config.tp > 1:
        stack = _TokenShard(inner, config.tp_mesh)
    else:
        stack = _Plain(inner)
    policy = config.recompute
    if policy == "every_n":
        policy = "full" if index % config.every_n == 0 else "none"
    if policy != "none":
        extra = frozenset(resolve_op(name) for name in config.attention_kernels)
        stack = Recomputed(
            stack,
            policy,
            type(block).__name__,
            extra,
            keep_communication=config.communicates,
            shared=config.split_backward,
            offload=config.offload,
        )
    elif config.offload:
        stack = _SavedToHost(stack)
    return stack


def _split(block: nn.Module, anatomy: Any, config: BlockConfig, layouts: Layouts, prefix: str) -> Any:
    """HelixPipe (Zhang et al., arXiv 2507.00394, §2.1): ``block`` cut at its attention call, the parts run by the
    helix runtime. Step 1 happens inside the anatomy's split (the block sharded, the parts on this rank's heads,
    their dropout from the tp rank's stream); step 3 wraps the parts (:class:`SplitOverSequence`). Helix recomputes
    inside its runtime, so step 4 is not applied."""
    split = anatomy.helix_split(block, config, layouts.tp, prefix)
    if config.tp > 1:
        split = tensor_parallel_split(split, config.tp_mesh)
    if config.sp == 1:
        return split
    if split.carried:
        raise Unsupported(
            f"its attention call takes {split.carried} parameter(s) besides q, k, v (learned sinks), which"
            " HelixPipe carries to the attention stage but not through sequence parallelism's attention;"
            " helix without sequence_parallel_size, or sequence parallelism (Ulysses or ring) alone, trains it"
        )
    check_heads(*anatomy.heads(block), config.sp, config.sp_mode, type(block).__name__, config.tp)
    if layouts.sp is not None:
        layouts.sp.partial += list(block.parameters())
    return SplitOverSequence(split, anatomy, config.sp_mesh, config.sp_mode)
