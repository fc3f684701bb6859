"""The block-call protocol: how a block is called (its own forward, an argument by name or position), its split
into pre-attention / attention / post-attention (HelixPipe, Zhang et al., arXiv 2507.00394, §2.1), the
attention call's parameters (the errors a source of anatomy or a configuration raises are
:mod:`lightning_parallel.errors`). The vocabulary every anatomy speaks; it imports nothing of this package, so
the mechanics below the anatomy (tensor and sequence parallelism, recomputation) and the anatomy and block
layer above them all use it.

``post(attention(pre(x)))`` must equal ``block(x)``:

- ``pre(block, x, args, kwargs, call) -> ((q, k, v), state)``: normalisation, projections, rotary
  embedding; ``q, k, v`` are ``(B, heads, T, head_dim)``; ``state`` is every tensor ``post`` needs from
  before attention (the residual, and e.g. the normalised input of a parallel-residual block);
- ``attention(block, q, k, v, args, kwargs) -> out``: the attention core; it holds no parameters, so it
  can run on any stage (the block's module object supplies only attributes);
- ``post(block, out, state, args, kwargs, call) -> y``: output projection, residuals, MLP.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

State = tuple[Tensor, ...]
QKV = tuple[Tensor, Tensor, Tensor]


@dataclass(frozen=True)
class AttentionCall:
    """The parameters of one call of a block's attention core (what ring attention must reproduce)."""

    causal: bool
    scale: float | None
    dropout: float
    mask: Tensor | None
    softcap: float | None = None  # logit soft-capping (Gemma 2), which ring attention does not run
    sinks: Tensor | None = None  # a learned logit per query head in the softmax's denominator (GPT-OSS)


@dataclass(frozen=True)
class Call:
    """How this call of a block's parts runs on this rank (passed explicitly, never stored on modules).

    ``sequence_sharded``: Megatron-style sequence parallelism inside tensor parallelism (activations
    between the projections hold 1/tp of the tokens). ``attention``: a replacement for the attention core
    (sequence parallelism's distributed attention), called as ``attention(q, k, v, inner, call_info)``.
    """

    sequence_sharded: bool = False
    attention: Callable[..., Tensor] | None = None


PLAIN = Call()


def argument(block: nn.Module, args: tuple, kwargs: dict, name: str) -> Any:
    """The value of the parameter ``name`` of ``type(block).forward`` in the call ``block(x, *args, **kwargs)``,
    passed by name or by position (Hugging Face GPT-2 passes its attention mask positionally); ``None``
    when the call leaves it out."""
    if name in kwargs:
        return kwargs[name]
    positional = [
        p.name
        for p in inspect.signature(type(block).forward).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ][2:]  # after self and the hidden state
    if name in positional and positional.index(name) < len(args):
        return args[positional.index(name)]
    return None


def sdpa(q: Tensor, k: Tensor, v: Tensor, call: AttentionCall) -> Tensor:
    """``F.scaled_dot_product_attention`` with the parameters of ``call`` (grouped-query aware)."""
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=call.mask, dropout_p=call.dropout, is_causal=call.causal and call.mask is None,
        scale=call.scale, enable_gqa=q.shape[1] != k.shape[1],
    )  # fmt: skip


@dataclass(frozen=True)
class Split:
    """A block cut at its attention call, verified against the block's own forward before use."""

    name: str
    pre: Callable[[nn.Module, Tensor, tuple, dict], tuple[QKV, State]]
    attention: Callable[[nn.Module, Tensor, Tensor, Tensor, tuple, dict], Tensor]
    post: Callable[[nn.Module, Tensor, State, tuple, dict], Tensor]
    pre_parameters: frozenset[str]  # names (relative to the block) of the parameters ``pre`` uses
    heads_dim: int = 1
    """The dimension of the heads in ``attention``'s output: 1 for SDPA's ``(B, heads, T, head_dim)``, 2 for
    transformers' attention functions, which return ``(B, T, heads, head_dim)``."""
    attention_call: Callable[[nn.Module, tuple, dict], AttentionCall] | None = None
    """The parameters of the attention call (ring attention runs its own kernel with them); ``None`` where the
    split cannot tell them without running the block (a mask computed inside it)."""
    carried: int = 0
    """How many parameters the attention call takes besides q, k, v (GPT-OSS's sinks: a logit per head): ``pre``
    returns them after q, k, v, and ``attention`` takes them as ``carried=``, so that under HelixPipe they travel
    with q, k, v to the attention stage (which holds no parameters) and their gradients come back with q's."""

    def attend(self, block: nn.Module, inputs: tuple, args: tuple, kwargs: dict) -> Tensor:
        """``attention`` on what ``pre`` returned for it: q, k, v and the carried parameters."""
        q, k, v, *carried = inputs
        return self.attention(block, q, k, v, args, kwargs, **({"carried": tuple(carried)} if carried else {}))

    def __call__(self, block: nn.Module, x: Tensor, args: tuple, kwargs: dict) -> Any:
        inputs, state = self.pre(block, x, args, kwargs)
        return self.post(block, self.attend(block, inputs, args, kwargs), state, args, kwargs)


class Shared:
    """Shared, not copied, by ``copy.deepcopy``: a copy of a block (verification's reference and candidate, a
    stage's copy) runs the same stack layer, anatomy or record, which holds no module of the block."""

    def __deepcopy__(self, memo: dict) -> Any:
        return self


class ClassForward(nn.Module):
    """``module``'s class forward, for ``torch.func.functional_call`` with other parameters (the local parts of its
    DTensors) where its instance forward is a wrapper calling this: tensor parallelism's experts, expert
    parallelism's."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return type(self.module).forward(self.module, *args, **kwargs)


class OwnForward(Shared):
    """The block's own (class) forward."""

    def __call__(self, block: nn.Module, x: Tensor, args: tuple, kwargs: dict, shard: Any = None) -> Any:
        return type(block).forward(block, x, *args, **kwargs)
