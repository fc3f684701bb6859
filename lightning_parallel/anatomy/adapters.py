"""Hand-written block adapters: the fast path for the families they know (nanoGPT / Hugging Face GPT-2,
Llama / Hugging Face Llama, ``nn.TransformerEncoderLayer``), and the protocol a user's ``adapter=`` object
implements.

An adapter re-implements a family's forward in three parts (see :mod:`lightning_parallel.block_protocol`),
written shape-agnostically (head counts from the projections' outputs, never from global attributes), so
the same code runs whole, on tensor-parallel shards and on a sequence shard. Adapters are verified
against the block's own forward and gradients on the first real micro-batch like every other source of
anatomy, and a variant they do not know (QK-norm, sliding windows, another residual order...) fails
verification and falls through to the next source.
"""

from __future__ import annotations

from typing import Any, Protocol

from torch import Tensor, nn

from lightning_parallel.anatomy.llama import LlamaAdapter
from lightning_parallel.anatomy.nanogpt import NanoGPTAdapter
from lightning_parallel.anatomy.torch_encoder import TorchEncoderAdapter
from lightning_parallel.block_protocol import PLAIN, QKV, AttentionCall, Call, Shared, Split, State, sdpa
from lightning_parallel.errors import Unsupported


class BlockAdapter(Protocol):
    """What a hand-written (or user-supplied, ``adapter=``) block adapter provides."""

    name: str

    def matches(self, block: nn.Module) -> bool: ...

    def pre_modules(self, block: nn.Module) -> tuple[str, ...]:
        """Submodules/parameters ``pre`` uses; ``post`` uses the rest of the block."""
        ...

    def pre(self, block: nn.Module, x: Tensor, args: tuple, kwargs: dict, call: Call = PLAIN) -> tuple[QKV, State]: ...

    def attention_call(self, block: nn.Module, args: tuple, kwargs: dict) -> AttentionCall: ...

    def post(
        self, block: nn.Module, out: Tensor, state: State, args: tuple, kwargs: dict, call: Call = PLAIN
    ) -> Tensor: ...

    def head_counts(self, block: nn.Module) -> tuple[int, int]:
        """(attention heads, key/value heads)."""
        ...

    def sequence_args(self, block: nn.Module, args: tuple, kwargs: dict, index: Tensor) -> tuple[tuple, dict]:
        """The block arguments ``pre``/``post`` use, at the token positions ``index`` (sequence parallelism)."""
        ...

    def tp_plan(self, block: nn.Module) -> dict[str, str]:
        """Submodule (or bare parameter) name -> ``"colwise"``, ``"rowwise"`` or ``"colwise_qkv"``."""
        ...

    def mlp(self, block: nn.Module) -> tuple[nn.Module, str, int] | None:
        """(owner, attribute of the callable, sequence dim of its input) of the token-wise MLP."""
        ...


ADAPTERS: dict[str, BlockAdapter] = {a.name: a for a in (NanoGPTAdapter(), LlamaAdapter(), TorchEncoderAdapter())}


def named_adapter(adapter: str | BlockAdapter) -> BlockAdapter:
    """The adapter named by ``adapter=`` (or the object itself)."""
    if not isinstance(adapter, str):
        return adapter
    if adapter not in ADAPTERS:
        raise ValueError(f"adapter={adapter!r} is unknown; known adapters: {sorted(ADAPTERS)}")
    return ADAPTERS[adapter]


def matching_adapters(block: nn.Module) -> list[BlockAdapter]:
    """The hand-written adapters whose attribute names match ``block`` (candidates, still to verify). They compute
    attention with SDPA: a Hugging Face block whose config names another attention function (flash-attention,
    flex, one the user registered) keeps it, through :mod:`lightning_parallel.anatomy.hugging_face`."""
    from lightning_parallel.anatomy.hf_config import implementations_of

    if implementations_of(block) - {"sdpa", "eager"}:
        return []
    return [a for a in ADAPTERS.values() if a.matches(block)]


def attention_of(adapter: BlockAdapter, block: nn.Module, q: Tensor, k: Tensor, v: Tensor, args: tuple,
                 kwargs: dict) -> Tensor:  # fmt: skip
    """The adapter's attention core: SDPA with the call's parameters, unless the adapter has its own. Under
    tensor parallelism its heads are sharded: its dropout draws from this rank's stream
    (:mod:`lightning_parallel.rng`)."""
    from lightning_parallel.rng import sharded

    own = getattr(adapter, "attention", None)
    with sharded():
        if own is not None:
            return own(block, q, k, v, args, kwargs)
        return sdpa(q, k, v, adapter.attention_call(block, args, kwargs))


def pre_parameters(adapter: BlockAdapter, block: nn.Module) -> frozenset[str]:
    """Names (relative to the block) of the parameters ``pre`` uses; the others belong to ``post``."""
    names = {n for n, _ in block.named_parameters()}
    return frozenset(n for n in names if any(n == m or n.startswith(m + ".") for m in adapter.pre_modules(block)))


def adapter_split(adapter: BlockAdapter, block: nn.Module) -> Split:
    """The adapter's three parts as a :class:`Split` (HelixPipe's partition, sequence parallelism)."""
    return Split(
        name=f"adapter {adapter.name!r}",
        pre=lambda b, x, a, kw: adapter.pre(b, x, a, kw),
        attention=lambda b, q, k, v, a, kw: attention_of(adapter, b, q, k, v, a, kw),
        post=lambda b, out, state, a, kw: adapter.post(b, out, state, a, kw),
        pre_parameters=pre_parameters(adapter, block),
        attention_call=adapter.attention_call,
    )


def split_forward(adapter: BlockAdapter, block: nn.Module, x: Tensor, args: tuple, kwargs: dict,
                  call: Call = PLAIN) -> Tensor:  # fmt: skip
    """``post(attention(pre(x)))``; ``call.attention`` (if set) replaces the attention core."""
    (q, k, v), state = adapter.pre(block, x, args, kwargs, call)
    if call.attention is None:
        out = attention_of(adapter, block, q, k, v, args, kwargs)
    else:
        inner = lambda q, k, v: attention_of(adapter, block, q, k, v, args, kwargs)  # noqa: E731
        out = call.attention(q, k, v, inner, lambda: adapter.attention_call(block, args, kwargs))
    return adapter.post(block, out, state, args, kwargs, call)


class AdapterAnatomy:
    """A hand-written adapter as a source of anatomy for the block layer.

    Under tensor or sequence parallelism the block runs the adapter's split forward (shape-agnostic, so
    it runs on shards and on a sequence shard); with chunked MLP alone it runs its own forward."""

    family_level = True

    def __init__(self, adapter: BlockAdapter) -> None:
        self.adapter, self.name = adapter, f"adapter {getattr(adapter, 'name', adapter)!r}"

    def heads(self, block: nn.Module) -> tuple[int, int]:
        return self.adapter.head_counts(block)

    def sequence_dim(self, block: nn.Module) -> int:
        return 0 if isinstance(block, nn.TransformerEncoderLayer) and not block.self_attn.batch_first else 1

    def sequence_args(self, block: nn.Module, args: tuple, kwargs: dict, index: Tensor) -> tuple[tuple, dict]:
        return self.adapter.sequence_args(block, args, kwargs, index)

    def attention_mask(self, block: nn.Module, args: tuple, kwargs: dict) -> Tensor | None:
        """The mask the call's attention uses (whole sequence, original order), or ``None``."""
        return self.adapter.attention_call(block, args, kwargs).mask

    def helix_split(self, block: nn.Module, config: Any, tp_layout: Any = None, prefix: str = "") -> Split:
        """The adapter's parts (HelixPipe), on this rank's tensor-parallel shards of the block under
        ``config.tp > 1`` (the parts are shape-agnostic: ``pre`` returns this rank's heads), with the MLP
        chunked in ``post`` when asked for."""
        from lightning_parallel.mlp_chunks import chunk_mlp

        if config.tp > 1:
            self._shard(block, config, tp_layout, prefix)
        if config.mlp_chunks > 1:
            owner, attr, dim = self.mlp_site(block, config)
            chunk_mlp(owner, attr, config.mlp_chunks, dim, type(block).__name__)
        return adapter_split(self.adapter, block)

    def _shard(self, block: nn.Module, config: Any, tp_layout: Any, prefix: str) -> None:
        """Tensor parallelism: the block's projections sharded by the adapter's plan (or ``tp_plan=``)."""
        from lightning_parallel import tensor_parallel as tp

        plan = tp.expand_plan(block, dict(config.tp_plan)) if config.tp_plan else self.adapter.tp_plan(block)
        tp.check_heads(block, self.adapter.head_counts(block), config.tp)
        tp.check_divisible(block, plan, config.tp)
        tp.shard_modules(block, prefix, plan, config.tp_mesh, tp_layout, config.tp_sequence_parallel)

    def mlp_site(self, block: nn.Module, config: Any) -> tuple[nn.Module, str, int]:
        if config.mlp_module is not None:
            return block.get_submodule(config.mlp_module), "forward", -2
        site = self.adapter.mlp(block) if hasattr(self.adapter, "mlp") else None
        if site is None:
            raise Unsupported(f"adapter {self.adapter.name!r} does not locate the MLP of {type(block).__name__}")
        return site

    def local_forward(self, block: nn.Module, config: Any, tp_layout: Any, prefix: str) -> Any:
        from lightning_parallel.mlp_chunks import chunk_mlp

        if config.tp > 1:
            self._shard(block, config, tp_layout, prefix)
        if config.mlp_chunks > 1:
            owner, attr, dim = self.mlp_site(block, config)
            chunk_mlp(owner, attr, config.mlp_chunks, dim, type(block).__name__)
        if config.tp > 1 or config.sp > 1:
            return _AdapterForward(self.adapter, config.tp_sequence_parallel)
        from lightning_parallel.block_protocol import OwnForward

        return OwnForward()


class _AdapterForward(Shared):
    """The adapter's split forward; with a sequence shard, its attention core distributed."""

    def __init__(self, adapter: BlockAdapter, sequence_sharded: bool) -> None:
        self.adapter, self.sequence_sharded = adapter, sequence_sharded

    def __call__(self, block: nn.Module, x: Tensor, args: tuple, kwargs: dict, shard: Any = None) -> Tensor:
        from functools import partial

        from lightning_parallel.sequence_parallel import attend

        attention = None if shard is None else partial(attend, shard)
        return split_forward(self.adapter, block, x, args, kwargs, Call(self.sequence_sharded, attention))


__all__ = [
    "ADAPTERS",
    "AdapterAnatomy",
    "BlockAdapter",
    "adapter_split",
    "matching_adapters",
    "named_adapter",
    "pre_parameters",
    "split_forward",
]
