"""Attention written by hand, recognised in a traced graph and rewritten as one SDPA call, so that every transform
that works on an attention call (the tensor-parallel plan, sequence parallelism, HelixPipe's cut) serves it.

The pattern, on ``(B, H, T, D)`` tensors (Vaswani et al., arXiv 1706.03762, eq. 1, with the additive biases of
ALiBi, Press et al., arXiv 2108.12409, or a table in a buffer)::

    s = q @ k.transpose(-2, -1)          (aten.matmul; k^T by transpose or permute of its last two dims)
    s = s * c  |  s / c                  (constant factors: the scale)
    s = s + b                            (biases that read no parameter and not the hidden state's values)
    s = s.masked_fill(m, -inf)           (masks from the block's arguments or buffers)
    p = s.softmax(-1)                    (aten.softmax / _softmax over the keys)
    o = p @ v

becomes ``scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=c)`` with ``bias`` the sum of the ``b``
and of ``where(m, -inf, 0)`` (:func:`attention_bias`). The biases may read the sequence's length (``arange(T)``,
``table[:T, :T]``) but no parameter, so every stage can compute them from the call's arguments. A graph that
already calls attention, or whose pattern differs (dropout on the probabilities, a bias from a parameter, a
scale that is not a constant), is left as it is; either way the result is verified against the block's own
forward before it is used.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, fx

aten = torch.ops.aten
_MATMUL = {aten.matmul.default}
_SOFTMAX = {aten.softmax.int, aten._softmax.default}
_TRANSPOSE = {aten.transpose.int}


def attention_bias(dtype: torch.dtype, biases: list[Tensor], fills: list[Tensor]) -> Tensor:
    """The additive attention mask of a hand-written attention: its biases plus ``-inf`` where a mask fills."""
    total: Tensor | None = None
    for bias in biases:
        total = bias.to(dtype) if total is None else total + bias.to(dtype)
    for fill in fills:
        term = torch.zeros(fill.shape, dtype=dtype, device=fill.device).masked_fill(fill, float("-inf"))
        total = term if total is None else total + term
    assert total is not None
    return total


def recognise(program: Any, param: Callable[..., Tensor]) -> Any:
    """``program`` (a traced :class:`~lightning_parallel.anatomy.traced.program.Program`, whose nodes read the
    block's parameters through ``param``) with its one hand-written attention (the module docstring's pattern) as
    an SDPA call, in place; the program unchanged where no such pattern is found."""
    graph = program.graph
    found = [m for m in (_match(n) for n in graph.nodes) if m is not None]
    if len(found) != 1:
        return program
    out, q, k, v, scale, biases, fills = found[0]
    hidden = next(n for n in graph.nodes if n.op == "placeholder" and n.name != "block")
    for term in (*biases, *fills):
        if reads_values(term, hidden) or any(n.op == "call_function" and n.target is param for n in _upstream(term)):
            return program
    dtype = out.meta["val"].dtype
    with graph.inserting_before(out):
        bias = graph.call_function(attention_bias, (dtype, list(biases), list(fills)))
        bias.meta["val"] = _bias_value(bias)
        sdpa = graph.call_function(
            aten.scaled_dot_product_attention.default, (q, k, v, bias, 0.0, False), {"scale": scale}
        )
        sdpa.meta = dict(out.meta)
    out.replace_all_uses_with(sdpa)
    graph.eliminate_dead_code()
    program.gm.recompile()
    return program


def _match(out: fx.Node) -> tuple | None:
    """The pattern ending at ``out`` (``p @ v``), or None."""
    if out.op != "call_function" or out.target not in _MATMUL:
        return None
    probs, v = out.args[:2]
    if not (isinstance(probs, fx.Node) and probs.target in _SOFTMAX and len(probs.users) == 1):
        return None
    if probs.args[1] not in (-1, _rank(probs) - 1):
        return None
    # walking down from the softmax: masks and biases, then the scale (applied to q k^T alone), then q @ k^T
    scores, scale, scaled, biases, fills = probs.args[0], 1.0, False, [], []
    while isinstance(scores, fx.Node) and len(scores.users) == 1:
        t, args = scores.target, scores.args
        if t == aten.masked_fill.Scalar and args[2] == float("-inf") and not scaled:
            fills.append(args[1])
        elif t == aten.add.Tensor and len(args) == 2 and all(isinstance(a, fx.Node) for a in args) and not scaled:
            first = _is_scores(args[0])
            biases.append(args[1] if first else args[0])
            scores = args[0] if first else args[1]
            continue
        elif t in (aten.mul.Tensor, aten.mul.Scalar) and isinstance(args[1], (int, float)):
            scale, scaled = scale * float(args[1]), True
        elif t in (aten.div.Tensor, aten.div.Scalar) and isinstance(args[1], (int, float)):
            scale, scaled = scale / float(args[1]), True
        elif t in _MATMUL:
            break
        else:
            return None
        scores = args[0]
    if not (isinstance(scores, fx.Node) and scores.target in _MATMUL and len(scores.users) == 1):
        return None
    q, kt = scores.args[:2]
    k = _untransposed(kt)
    if k is None:
        return None
    if any(_rank(n) != 4 for n in (q, k, v)):
        return None
    return out, q, k, v, scale, biases, fills


def _is_scores(node: Any) -> bool:
    """Whether ``node`` continues the chain down to ``q @ k^T`` (the operand that is not a bias)."""
    while isinstance(node, fx.Node):
        if node.target in _MATMUL:
            return True
        if node.target in (aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar, aten.add.Tensor,
                           aten.masked_fill.Scalar):  # fmt: skip
            node = node.args[0]
            continue
        return False
    return False


def _untransposed(kt: Any) -> fx.Node | None:
    """``k`` from ``k.transpose(-2, -1)`` (or ``permute`` swapping the last two dims) of a 4-D tensor."""
    if not isinstance(kt, fx.Node) or _rank(kt) != 4:
        return None
    if kt.target in _TRANSPOSE and {d % 4 for d in kt.args[1:3]} == {2, 3}:
        return kt.args[0]
    if kt.target == aten.permute.default and [d % 4 for d in kt.args[1]] == [0, 1, 3, 2]:
        return kt.args[0]
    return None


def _rank(node: Any) -> int:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return value.dim() if isinstance(value, Tensor) else -1


def _upstream(node: fx.Node, past_sizes: bool = True) -> set[fx.Node]:
    """``node`` and every node it reads, through ``sym_size`` nodes' inputs only when ``past_sizes``."""
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if past_sizes or n.target is not aten.sym_size.int:
            stack.extend(n.all_input_nodes)
    return seen


def reads_values(node: fx.Node, hidden: fx.Node) -> bool:
    """Whether ``node`` reads the hidden state's values; its sizes (through ``sym_size``) every part of a cut
    block can take from its own inputs (a bias over ``arange(T)``)."""
    return hidden in _upstream(node, past_sizes=False)


def _bias_value(node: fx.Node) -> Tensor:
    """The bias node's example value (its shape), from its terms' values."""
    dtype, biases, fills = node.args
    shapes = [t.meta["val"].shape for t in (*biases, *fills)]
    shape = torch.broadcast_shapes(*shapes)
    like = next(t.meta["val"] for t in (*biases, *fills))
    return like.new_empty(shape, dtype=dtype)
