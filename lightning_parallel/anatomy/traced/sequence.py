"""Sequence parallelism on a traced block: the graph runs on this rank's tokens (the block layer slices
the hidden state and the arguments :class:`~lightning_parallel.anatomy.traced.analysis.Site` names), its
attention call becomes :func:`lightning_parallel.sequence_parallel.attend` around the same SDPA call
(masks whole), and positions the block creates itself (``arange(T)``, ``table[:T]``) become the global
positions of this rank's tokens. A block that creates other tensors over the sequence is refused."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, fx

from lightning_parallel.anatomy.traced.analysis import SDPA, Site, expr_of
from lightning_parallel.anatomy.traced.program import Program
from lightning_parallel.anatomy.traced.rewrite import rewrite
from lightning_parallel.block_protocol import AttentionCall
from lightning_parallel.errors import Unsupported

aten = torch.ops.aten

_SDPA_ARGS = ("attn_mask", "dropout_p", "is_causal")  # after query, key, value; then scale, enable_gqa by keyword


def sdpa_arguments(node: fx.Node) -> dict[str, Any]:
    """The keyword form of an SDPA node's arguments after q, k, v."""
    named = dict(zip(_SDPA_ARGS, node.args[3:]))
    return {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False,
            **named, **node.kwargs}  # fmt: skip


def _attend(shard: Any, q: Tensor, k: Tensor, v: Tensor, attn_mask: Any = None, dropout_p: float = 0.0,
            is_causal: bool = False, scale: Any = None, enable_gqa: bool = False) -> Tensor:  # fmt: skip
    from lightning_parallel.sequence_parallel import attend

    heads, mask = q.shape[1], attn_mask
    if shard.mode == "ulysses" and isinstance(mask, Tensor) and mask.dim() >= 3 and mask.shape[-3] == heads > 1:
        n = heads // shard.mesh.size()  # a mask per head (an ALiBi bias): this rank's head group of it
        mask = mask.narrow(-3, shard.mesh.get_local_rank() * n, n)

    def inner(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return SDPA(q, k, v, mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)

    info = lambda: AttentionCall(is_causal and attn_mask is None, scale, dropout_p, attn_mask)  # noqa: E731
    return attend(shard, q, k, v, inner, info)


def _positions(shard: Any, dtype: torch.dtype) -> Tensor:
    return shard.index.to(dtype)


def _table(shard: Any, table: Tensor, dim: int) -> Tensor:
    return table.index_select(dim, shard.index)


def _length(shard: Any) -> int:
    return shard.length


def _mask_only(program: Program, site: Site) -> set[fx.Node]:
    """The nodes that compute the attention call's mask and nothing else (a bias over ``arange(T)`` built
    inside the block): they run on the whole sequence's length, since attention sees every key."""
    args = sdpa_arguments(site.attention)
    mask = args["attn_mask"]
    if not isinstance(mask, fx.Node) or set(mask.users) != {site.attention}:
        return set()
    only, stack = {mask}, list(mask.all_input_nodes)
    while stack:
        n = stack.pop()
        if n in only or n.op == "placeholder" or n.target is aten.sym_size.int or not set(n.users) <= only:
            continue
        only.add(n)
        stack.extend(n.all_input_nodes)
    return only


def sequence_parallel(program: Program, site: Site) -> Program:
    """``program`` on a sequence shard; the shard is the program's last input."""
    if site.kind != "sdpa":
        raise Unsupported("only an SDPA attention call can be distributed from a traced graph")
    if site.sequence_mixers:
        names = ", ".join(f"{n.name} ({n.target})" for n in site.sequence_mixers[:3])
        raise Unsupported(
            f"the block mixes tokens along the sequence outside its attention call ({names}: the convolution or scan"
            " of a recurrent mixer such as Mamba or a linear attention); split over ranks it would see only their"
            " tokens. Sequence parallelism passes such a mixer's state between ranks (LASP) only where it keeps it"
            " in transformers' linear-attention cache; otherwise train it under pipeline, helix or tensor_parallel"
        )
    if site.sequence_factories:
        names = ", ".join(f"{n.name} ({n.target})" for n in site.sequence_factories[:3])
        raise Unsupported(f"the block creates tensors over the sequence itself ({names}); they cannot be split")
    positions, tables = set(site.positions), set(site.table_slices)
    inputs = program.tensor_inputs()
    whole = {inputs[i] for i in site.attention_inputs}  # masks stay whole: their length is not this rank's
    x = inputs[0]
    mask_only = _mask_only(program, site)
    lengths: list[fx.Node] = []

    def rule(node: fx.Node, graph: fx.Graph, env: dict) -> Any:
        shard = env["shard"]
        if node in mask_only:  # the whole sequence's length where it reads this rank's
            if not lengths:
                lengths.append(graph.call_function(_length, (shard,)))
            seq = lambda a: a.target is aten.sym_size.int and expr_of(a.meta["val"]) == site.seq  # noqa: E731
            new = graph.node_copy(node, lambda a: lengths[0] if seq(a) else env[a])
            new.meta = dict(node.meta)
            return new
        if node.target == aten.sym_size.int and node.args[0] in whole and expr_of(node.meta["val"]) == site.seq:
            new = graph.call_function(aten.sym_size.int, (env[x], site.seq_dim))  # this rank's length
            new.meta = dict(node.meta)
            return new
        if node is site.attention:
            new = graph.call_function(
                _attend, (shard, *fx.node.map_arg(node.args[:3], lambda n: env[n])),
                fx.node.map_arg(sdpa_arguments(node), lambda n: env[n]),
            )  # fmt: skip
            new.meta = dict(node.meta)
            return new
        if node in positions:
            new = graph.call_function(_positions, (shard, node.meta["val"].dtype))
        elif node in tables:
            new = graph.call_function(_table, (shard, env[node.args[0]], node.args[1]))
        else:
            return None
        new.meta = dict(node.meta)
        return new

    return replace(rewrite(program, rule, extra=("shard",)), loose=frozenset({site.seq}))
