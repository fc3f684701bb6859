"""Block-family adapters: the anatomy of a transformer block, for features that must see inside one.

An adapter splits a block's forward into three parts (HelixPipe, arXiv 2507.00394, §2.1):

- ``pre(block, x, args, kwargs) -> ((q, k, v), residual)``: normalisation, projections, rotary embedding;
- ``attention(block, q, k, v, args, kwargs) -> out``: the attention core; no parameters, so it can run on
  any stage (the block's module object, whose parameters may be freed, supplies only attributes);
- ``post(block, out, residual, args, kwargs) -> x``: output projection, residuals, MLP.

``post(attention(pre(x)))`` must equal ``block(x)``. Adapters re-implement a family's forward, so they are
**verified** against the block's own forward and gradients on a real input before use, and refused with an
error naming the block class and the ``adapter=`` argument if they differ (review C4): an unknown
variant (QK-norm, sliding windows, post-norm vs pre-norm...) fails closed instead of training wrong.
"""

from __future__ import annotations

import copy
from typing import Protocol

import torch
from torch import Tensor, nn

from lightning_parallel.adapters.llama import LlamaAdapter
from lightning_parallel.adapters.nanogpt import NanoGPTAdapter
from lightning_parallel.adapters.torch_encoder import TorchEncoderAdapter


class BlockAdapter(Protocol):
    name: str

    def pre_modules(self, block: nn.Module) -> tuple[str, ...]:
        """Submodules/parameters ``pre`` uses; ``post`` uses the rest of the block."""
        ...

    def matches(self, block: nn.Module) -> bool: ...

    def pre(self, block: nn.Module, x: Tensor, args: tuple, kwargs: dict) -> tuple[tuple[Tensor, ...], Tensor]: ...

    def attention(self, block: nn.Module, q: Tensor, k: Tensor, v: Tensor, args: tuple, kwargs: dict) -> Tensor: ...

    def post(self, block: nn.Module, out: Tensor, residual: Tensor, args: tuple, kwargs: dict) -> Tensor: ...

    def head_counts(self, block: nn.Module) -> tuple[int, int]:
        """(attention heads, key/value heads)."""
        ...

    def attention_info(self, block: nn.Module, args: tuple, kwargs: dict) -> tuple[bool, float | None, float, object]:
        """(causal, scale, dropout probability, explicit mask or None) of this call's attention (ring mode)."""
        ...

    def sequence_args(self, block: nn.Module, args: tuple, kwargs: dict, index: Tensor) -> tuple[tuple, dict]:
        """Sequence parallelism: the block arguments ``pre``/``post`` use, at the token positions ``index``."""
        ...

    def tp_plan(self, block: nn.Module) -> dict[str, str]:
        """Tensor parallelism: submodule (or bare parameter) name -> ``"colwise"``, ``"rowwise"`` or
        ``"colwise_qkv"`` (a fused q|k|v projection, sharded head-aligned)."""
        ...


ADAPTERS: dict[str, BlockAdapter] = {a.name: a for a in (NanoGPTAdapter(), LlamaAdapter(), TorchEncoderAdapter())}


def find_adapter(block: nn.Module, adapter: str | BlockAdapter | None = None) -> BlockAdapter:
    """The adapter named (or given), else the first registered one whose ``matches`` accepts ``block``."""
    if adapter is not None and not isinstance(adapter, str):
        return adapter
    if adapter is not None:
        if adapter not in ADAPTERS:
            raise ValueError(f"adapter={adapter!r} is unknown; known adapters: {sorted(ADAPTERS)}")
        return ADAPTERS[adapter]
    for candidate in ADAPTERS.values():
        if candidate.matches(block):
            return candidate
    raise ValueError(
        f"no adapter knows the anatomy of {type(block).__name__}; known adapters: {sorted(ADAPTERS)};"
        " pass adapter= (a name or an object with pre/attention/post)"
    )


def pre_parameters(adapter: BlockAdapter, block: nn.Module) -> set[str]:
    """Names (relative to the block) of the parameters ``pre`` uses; the others belong to ``post``."""
    names = {n for n, _ in block.named_parameters()}
    return {n for n in names if any(n == m or n.startswith(m + ".") for m in adapter.pre_modules(block))}


def split_forward(adapter: BlockAdapter, block: nn.Module, x: Tensor, args: tuple, kwargs: dict) -> Tensor:
    (q, k, v), residual = adapter.pre(block, x, args, kwargs)
    return adapter.post(block, adapter.attention(block, q, k, v, args, kwargs), residual, args, kwargs)


def verify_adapter(
    adapter: BlockAdapter, block: nn.Module, x: Tensor, args: tuple = (), kwargs: dict | None = None
) -> None:
    """Check ``adapter`` against ``block``'s own forward: output, input gradient and every parameter
    gradient, in float64 on copies; raise ``ValueError`` (naming the class and ``adapter=``) if they differ."""
    kwargs = kwargs or {}

    def to64(t: object) -> object:
        if isinstance(t, (tuple, list)):
            return type(t)(to64(x) for x in t)
        return t.detach().double() if isinstance(t, Tensor) and t.is_floating_point() else t

    ref_block = copy.deepcopy(block).double()
    split_block = copy.deepcopy(block).double()
    a64, kw64 = tuple(map(to64, args)), {k: to64(v) for k, v in kwargs.items()}
    results = []
    for module, run in ((ref_block, None), (split_block, adapter)):
        xi = to64(x).requires_grad_(True)
        with torch.random.fork_rng():
            torch.manual_seed(0)
            out = (
                type(module).forward(module, xi, *a64, **kw64)
                if run is None
                else split_forward(run, module, xi, a64, kw64)
            )
        out = out[0] if isinstance(out, (tuple, list)) else out
        weight = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
        (out * weight).sum().backward()
        grads = {n: p.grad for n, p in module.named_parameters() if p.grad is not None}
        results.append((out.detach(), xi.grad, grads))
    (o1, g1, p1), (o2, g2, p2) = results
    problems = []
    if o1.shape != o2.shape or not torch.allclose(o1, o2, rtol=1e-9, atol=1e-10):
        problems.append("output")
    if g1 is None or g2 is None or not torch.allclose(g1, g2, rtol=1e-9, atol=1e-10):
        problems.append("input gradient")
    problems += [
        f"gradient of {n}" for n in p1 if n not in p2 or not torch.allclose(p1[n], p2[n], rtol=1e-9, atol=1e-10)
    ]
    if problems:
        raise ValueError(
            f"adapter {getattr(adapter, 'name', adapter)!r} does not reproduce {type(block).__name__}:"
            f" {', '.join(problems[:4])} differ(s) from the block's own forward; pass adapter= with one that"
            " matches this block family"
        )


def verify_on_first_call(block: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook for a block whose forward was replaced by an object holding ``adapter`` and an
    unsharded ``reference`` copy: on the first call with a tensor input, verify the adapter against the
    copy, then drop it. A pre-hook runs outside any recomputation, so checkpointed regions replay the
    same ops."""
    forward = block.__dict__.get("_lp_original_forward") or block.__dict__.get("forward")
    reference = getattr(forward, "reference", None)
    if reference is None or not args or not isinstance(args[0], Tensor):
        return
    forward.reference = None
    with torch.enable_grad():
        verify_adapter(forward.adapter, reference, args[0].detach(), args[1:], kwargs)


__all__ = [
    "ADAPTERS",
    "BlockAdapter",
    "find_adapter",
    "pre_parameters",
    "split_forward",
    "verify_adapter",
    "verify_on_first_call",
]
