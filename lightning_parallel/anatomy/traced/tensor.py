"""Tensor parallelism on a traced block (Megatron-LM, Shoeybi et al., arXiv 1909.08053), derived from the
graph's data flow instead of a hand-written plan.

1. **Projections**: ``linear`` / ``addmm`` / ``mm`` / ``matmul`` nodes whose weight is one of the block's
   parameters. One whose input is replicated is a *source* (column-parallel candidate); one whose input
   carries a source's columns is *row-parallel*.
2. **Labels**: every source's output columns get their index as a label, and an interpreter moves the
   labels through the graph (views, transposes, splits, concatenations move them; element-wise ops keep
   them; the attention output is labelled by head). This shows, without any attribute names, which
   columns of a fused q|k|v end up in which head, and which positions of a row-parallel projection's
   input come from which source column.
3. **Plan**: rank r gets heads ``[r·H/tp, (r+1)·H/tp)`` of q and of k, v (so the head counts must divide by
   tp), and the contiguous r-th slice of every row-parallel input; the columns of each source follow
   (a source's rows are permuted so that a plain ``Shard`` gives rank r its columns in their original
   order; checkpoints keep the original order). Sources that reach no attention and no row-parallel
   projection stay replicated.
4. **Localisation**: each sharded value must be a slab along one dimension; the graph's shape constants
   along it (``view``, ``reshape``, ``expand``, ``split``, ``slice``; also symbolic ones such as
   ``batch * heads``) are divided by tp. Megatron's *f* (identity forward, all-reduce backward) enters
   before each column-parallel input, *g* (all-reduce forward) after each row-parallel projection, whose
   bias is added after the sum. Replicated parameters applied to sharded values (a per-head QK-norm) get
   their gradient summed over tp.

Anything the interpreter does not know applied to a sharded value, a reduction across ranks, or a
sharded value reaching the block's output refuses the plan with the node's name.

Over 400 lines because the localisation rule of each aten op family a traced block uses is one table, read
as one.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, fx, nn
from torch.distributed.tensor import Shard, distribute_tensor

from lightning_parallel import _collectives, rng
from lightning_parallel.anatomy.traced.analysis import attention_nodes
from lightning_parallel.anatomy.traced.labels import (
    _MOVE,
    Labels,
    Projection,
    _hint,
    _shape,
    attention_heads,
    base,
    label,
    projections,
)
from lightning_parallel.anatomy.traced.program import Program, _param
from lightning_parallel.anatomy.traced.rewrite import rewrite
from lightning_parallel.errors import ConfigurationError, Unsupported

aten = torch.ops.aten


@dataclass
class Plan:
    """What the derivation decided: per sharded parameter its dim and permutation; the columns each rank owns."""

    colwise: dict[fx.Node, Projection]
    rowwise: dict[fx.Node, Projection]
    ranks: dict[Any, Tensor]  # source -> rank of each of its columns
    shard_dims: dict[fx.Node, Any]  # labelled node -> its sharded dim (or a list, for tuple values)
    parameters: dict[str, tuple[int, Tensor | None]]  # name -> (dim, permutation or None)
    partial: set[str]  # replicated parameters applied to sharded values


def derive(program: Program, tp: int) -> Plan:
    """Steps 1-3 of the module docstring, and the sharded dims of step 4."""
    attentions = attention_nodes(program.graph)
    for node in attentions:
        q, k = (a.meta["val"] for a in node.args[:2])
        for what, n in (("attention heads", q.shape[1]), ("key/value heads", k.shape[1])):
            if isinstance(n, int) and n % tp:
                raise ConfigurationError(
                    f"tensor_parallel_size={tp} must divide the number of {what} ({n}) of the block"
                )
    projs = projections(program)
    sources = set(projs)
    for _ in range(len(projs) + 1):  # drop sources that reach no sink, until stable
        labels = label(program, attentions, sources, projs)
        reaching = {base(s) for sink in (*labels.attention_in.values(), *labels.rowwise.values()) for s in sink}
        # a source whose columns reach the block's output, an op without a rule, or a reduction wider than one
        # rank's share cannot be column-parallel (e.g. a projection followed by a norm over the hidden size)
        bad = {base(s) for s in labels.outputs | set(labels.unknown)} | _wide(labels, tp, projs)
        kept = {s for s in sources if s in reaching and s not in bad}
        if kept == sources:
            break
        sources = kept
    ranks = _ranks(labels, tp, projs)
    for source in {*labels.outputs, *labels.unknown}:
        name = getattr(base(source), "name", source)
        if base(source) in ranks and source in labels.outputs:
            raise Unsupported(f"the sharded output of {name} reaches the block's output")
        if base(source) in ranks and labels.unknown.get(source):
            ops = ", ".join(labels.unknown[source][:2])
            raise Unsupported(f"tensor parallelism does not know how {ops} treats a shard of {name}")
    for source, values, dims in labels.reductions:
        if base(source) in ranks and not _within_rank(values, ranks[base(source)], dims):
            raise Unsupported("the block reduces across the tensor-parallel shards (e.g. a norm over all heads)")
    shard_dims = {node: _slab_dims(value, ranks, tp, node) for node, value in labels.values.items() if value}
    colwise = {n: projs[n] for n in ranks if n in projs}
    rowwise = {n: projs[n] for n in labels.rowwise if {base(s) for s in labels.rowwise[n]} & set(ranks)}
    parameters: dict[str, tuple[int, Tensor | None]] = {}
    for node, proj in colwise.items():
        perm = torch.argsort(ranks[node], stable=True)
        identity = torch.equal(perm, torch.arange(len(perm)))
        _assign(parameters, proj.weight, (proj.out_dim, None if identity else perm))
        if proj.bias is not None:
            _assign(parameters, proj.bias, (0, None if identity else perm))
    for node, proj in rowwise.items():
        position = _row_ranks(labels.rowwise[node], ranks)
        perm = torch.argsort(position, stable=True)
        identity = torch.equal(perm, torch.arange(len(perm)))
        _assign(parameters, proj.weight, (1 - proj.out_dim, None if identity else perm))
    if not parameters:
        raise Unsupported("no projection of the block can be sharded (none feeds attention or a second projection)")
    for name in _head_parameters(attentions):  # learned sinks: a logit per head, cut with the heads
        _assign(parameters, name, (0, None))
    partial = {p for s, ps in labels.replicated_params.items() if base(s) in ranks for p in ps} - set(parameters)
    return Plan(colwise, rowwise, ranks, shard_dims, parameters, partial)


def _wide(labels: Labels, tp: int, projs: dict) -> set[Any]:
    """Sources a reduction spans more columns of than one rank will own."""
    wide = set()
    for source, values, dims in labels.reductions:
        if source not in projs:
            continue
        row = values
        for d in range(values.dim()):
            if d not in dims:
                row = row.narrow(d, 0, 1)
        distinct = row[row >= 0].unique().numel()
        if distinct > _hint(projs[base(source)].node.meta["val"].shape[-1]) // tp:
            wide.add(base(source))
    return wide


def _head_parameters(attentions: list[fx.Node]) -> list[str]:
    """The parameters a Hugging Face attention call takes per query head (``s_aux=``, GPT-OSS's sinks): rank r's
    heads are ``[r·H/tp, (r+1)·H/tp)`` in their order (step 3), so each is cut along its only dim like them."""
    names = []
    for node in attentions:
        if not getattr(node.target, "hf_attention_call", False):
            continue
        heads = node.args[0].meta["val"].shape[1]
        for extra in node.args[4] or ():
            if isinstance(extra, fx.Node) and extra.op == "call_function" and extra.target is _param:
                shape = tuple(extra.meta["val"].shape)
                if shape != (heads,):
                    raise Unsupported(f"its attention call takes the parameter {extra.args[1]} of shape {shape}, not"
                                      f" one value per head ({heads})")  # fmt: skip
                names.append(extra.args[1])
    return names


def _assign(parameters: dict, name: str, value: tuple[int, Tensor | None]) -> None:
    if name in parameters:
        raise Unsupported(f"the parameter {name} serves two projections")
    parameters[name] = value


def _ranks(labels: Labels, tp: int, projs: dict) -> dict[Any, Tensor]:
    """Rank of every column of every sharded source: from the heads at attention, from the contiguous
    slices at row-parallel inputs; conflicts and columns no sink claims refuse the plan. A sharded attention
    call's output is a source too (labels ``h * D + d``: head h goes to rank h // (H / tp))."""
    ranks: dict[Any, Tensor] = {}

    def claim(source: Any, columns: Tensor, rank: Tensor) -> None:
        source = base(source)
        width = _hint(projs[source].node.meta["val"].shape[-1])
        current = ranks.setdefault(source, torch.full((width,), -1, dtype=torch.long))
        columns, rank = columns.reshape(-1), rank.reshape(-1)
        valid = columns >= 0
        columns, rank = columns[valid], rank[valid]
        if ((current[columns] >= 0) & (current[columns] != rank)).any():
            raise Unsupported(f"the columns of {source.name} would go to two ranks")
        current[columns] = rank

    for (_, _), by_source in labels.attention_in.items():
        for source, values in by_source.items():  # (B, heads, T, D): head h -> rank h // (heads / tp)
            if base(source) in projs:
                heads = values.shape[1]
                claim(source, values, (torch.arange(heads) // (heads // tp))[None, :, None, None].expand(*values.shape))
    for by_source in labels.rowwise.values():
        width = len(next(iter(by_source.values())))
        if width % tp:
            raise ConfigurationError(f"tensor_parallel_size={tp} must divide the input width ({width}) of a projection")
        for source, values in by_source.items():
            if base(source) in projs:
                claim(source, values, torch.arange(width) // (width // tp))
    for source, current in ranks.items():
        counts = torch.bincount(current[current >= 0], minlength=tp)
        if (current < 0).any() or not (counts == len(current) // tp).all():
            raise Unsupported(f"the columns of {source.name} do not split evenly over tensor_parallel_size={tp}")
    for node, value in labels.values.items():  # sharded attention calls
        if node not in projs and isinstance(value, dict) and node in value:
            H, D = attention_heads(node)
            ranks[node] = torch.arange(H * D) // D // (H // tp)
    return ranks


def _row_ranks(by_source: dict[Any, Tensor], ranks: dict[Any, Tensor]) -> Tensor:
    """Rank of every input position of a row-parallel projection (from whichever source labels it)."""
    width = len(next(iter(by_source.values())))
    position = torch.full((width,), -1, dtype=torch.long)
    for source, values in by_source.items():
        if base(source) in ranks:
            valid = values >= 0
            position[valid] = ranks[base(source)][values[valid]]
    if (position < 0).any():
        raise Unsupported("a row-parallel projection's input mixes sharded and replicated values")
    return position


def _within_rank(values: Tensor, rank: Tensor, dims: list[int]) -> bool:
    r = torch.where(values >= 0, rank[values.clamp(min=0)], -1)
    for d in dims:
        first = r.narrow(d, 0, 1)
        if not ((r == first) | (r < 0) | (first < 0)).all():
            return False
    return True


def _slab_dims(value: Any, ranks: dict[Any, Tensor], tp: int, node: fx.Node) -> Any:
    if isinstance(value, list):
        return [_slab_dims(part, ranks, tp, node) if part else None for part in value]
    rank = None
    for source, labels in value.items():
        if base(source) not in ranks:
            continue
        r = torch.where(labels >= 0, ranks[base(source)][labels.clamp(min=0)], -1)
        rank = r if rank is None else torch.where(rank >= 0, rank, r)
    if rank is None:
        return None
    if (rank < 0).any():
        raise Unsupported(f"{node.name} mixes sharded and replicated values")
    mine = rank == 0
    for d in range(mine.dim()):
        selector = mine.any(dim=tuple(i for i in range(mine.dim()) if i != d)) if mine.dim() > 1 else mine
        expected = selector.view([-1 if i == d else 1 for i in range(mine.dim())]).expand_as(mine)
        if torch.equal(expected, mine) and int(selector.sum()) * tp == mine.shape[d]:
            return d
    raise Unsupported(f"{node.name} is not a slab of whole heads or columns per rank")


def check_wanted(plan: Plan, what: str, wanted: dict[str, str], block_name: str) -> None:
    """Refuse a derived ``plan`` that differs from ``wanted`` (module -> ``"colwise"`` / ``"rowwise"``; other
    styles are not compared) on a module ``wanted`` names: a colwise module's weight sharded on dim 0, a
    rowwise one's on dim 1. The derived plan is the one that runs (and is verified); a plan given and silently
    not applied would be a promise broken."""
    dims = {"colwise": 0, "rowwise": 1}
    differ = []
    for module, style in sorted(wanted.items()):
        if style not in dims:
            continue
        got = plan.parameters.get(f"{module}.weight")
        derived = "replicated" if got is None else {0: "colwise", 1: "rowwise"}.get(got[0], f"dim {got[0]}")
        if derived != style:
            differ.append(f"{module}: {style} in {what}, {derived} in the derived plan")
    if differ:
        raise ConfigurationError(
            f"HelixPipe x tensor parallelism shards {block_name} by the plan derived from its traced graph, which"
            f" differs from {what}: {'; '.join(differ)}. Drop the plan (the derived one is verified against the"
            " block), or use strategy='tensor_parallel' (which applies it) or a hand-written adapter="
        )


# ---------------------------------------------------------------------------------------- localise
def shard(block: nn.Module, plan: Plan, mesh: Any, layout: Any, prefix: str) -> None:
    """Shard ``block``'s parameters per ``plan``, recording permutations and partial gradients in ``layout``."""
    for name, (dim, perm) in plan.parameters.items():
        owner_name, _, attr = name.rpartition(".")
        owner = block.get_submodule(owner_name) if owner_name else block
        param = getattr(owner, attr)
        if perm is not None:
            with torch.no_grad():
                param.copy_(param.index_select(dim, perm))
            layout.permuted[f"{prefix}{name}"] = (dim, perm)
        sharded = distribute_tensor(param.detach(), mesh, [Shard(dim)], src_data_rank=None)
        setattr(owner, attr, nn.Parameter(sharded, requires_grad=param.requires_grad))
    layout.partial += [block.get_parameter(n) for n in sorted(plan.partial)]


def localise(program: Program, mesh: Any, plan: Plan | None = None) -> Program:
    """``program`` on this rank's shards (step 4); ``plan`` must be the one the parameters were sharded by
    (a program traced again, e.g. in eval mode, must derive the same one)."""
    tp = mesh.size()
    derived = derive(program, tp)
    if plan is not None and {n: d for n, (d, _) in derived.parameters.items()} != {
        n: d for n, (d, _) in plan.parameters.items()
    }:
        raise Unsupported("the block traced again derives another tensor-parallel plan (its graph depends on its mode)")
    return _localise(program, derived, tp, mesh.get_group())


def _localise(program: Program, plan: Plan, tp: int, group: Any) -> Program:
    def copy_in(t: Tensor) -> Tensor:  # Megatron's f: identity forward, all-reduce backward
        rng.enter_sharded()  # what follows up to g is sharded: dropout draws from this rank's stream
        return _collectives.copy_to_group(t, group)

    def reduce_out(t: Tensor) -> Tensor:  # Megatron's g: all-reduce forward, identity backward
        rng.leave_sharded()  # replicated from here: the default generator, the same on every rank
        return _collectives.reduce_from_group(t, group)

    def local_heads(mask: Tensor, heads: int) -> Tensor:  # rank r holds heads [r·H/tp, (r+1)·H/tp)
        n = heads // tp
        return mask.narrow(-3, _collectives.group_rank(group) * n, n)

    copied: dict[fx.Node, fx.Node] = {}
    per_head = _per_head_masks(program)

    def rule(node: fx.Node, graph: fx.Graph, env: dict) -> Any:
        if node in per_head:  # an SDPA call whose mask has a value per head: this rank's heads of it
            position, heads = per_head[node]
            args = list(fx.node.map_arg(node.args, lambda n: env[n]))
            kwargs = dict(fx.node.map_arg(node.kwargs, lambda n: env[n]))
            if position < len(args):
                args[position] = graph.call_function(local_heads, (args[position], heads))
            else:
                kwargs["attn_mask"] = graph.call_function(local_heads, (kwargs["attn_mask"], heads))
            new = graph.call_function(node.target, tuple(args), kwargs)
            new.meta = dict(node.meta)
            return new
        if node in plan.colwise:
            x = plan.colwise[node].input
            if x not in copied:
                copied[x] = graph.call_function(copy_in, (env[x],))
                copied[x].meta = dict(x.meta)  # the same value (chunking the MLP reads its input's shape)
            args = list(fx.node.map_arg(node.args, lambda n: env[n]))
            position = 0 if node.target != aten.addmm.default else 1
            args[position] = copied[x]
            new = graph.call_function(node.target, tuple(args), fx.node.map_arg(node.kwargs, lambda n: env[n]))
            new.meta = dict(node.meta)
            return new
        if node in plan.rowwise:
            return _rowwise(node, graph, env, reduce_out)
        if node.target in _MOVE and node.args and isinstance(node.args[0], fx.Node):
            return _local_move(node, graph, env, plan, tp)
        return None

    return rewrite(program, rule)


def _per_head_masks(program: Program) -> dict[fx.Node, tuple[int, int]]:
    """SDPA calls whose ``attn_mask`` has a heads dim (an ALiBi bias, ``(.., H, T, S)``): call -> (the mask's
    position in the call's arguments, or past them for the keyword, H)."""
    found = {}
    for node in attention_nodes(program.graph):
        if node.target != aten.scaled_dot_product_attention.default:
            continue
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        heads = _hint(node.args[0].meta["val"].shape[1])
        value = mask.meta.get("val") if isinstance(mask, fx.Node) else None
        if isinstance(value, Tensor) and value.dim() >= 3 and _hint(value.shape[-3]) == heads > 1:
            found[node] = (3 if len(node.args) > 3 else 99, heads)
    return found


def _rowwise(node: fx.Node, graph: fx.Graph, env: dict, reduce_out: Any) -> fx.Node:
    args = fx.node.map_arg(node.args, lambda n: env[n])
    if node.target == aten.linear.default:
        x, w = args[0], args[1]
        bias = args[2] if len(args) > 2 else env.get(node.kwargs.get("bias"))
        y = graph.call_function(aten.linear.default, (x, w))
    elif node.target == aten.addmm.default:
        bias, x, w = args
        y = graph.call_function(aten.mm.default, (x, w))
    else:
        bias = None
        y = graph.call_function(node.target, tuple(args))
    y = graph.call_function(reduce_out, (y,))
    if bias is not None:
        y = graph.call_function(aten.add.Tensor, (y, bias))
    y.meta = dict(node.meta)
    return y


def _local_move(node: fx.Node, graph: fx.Graph, env: dict, plan: Plan, tp: int) -> Any:
    source_dim = plan.shard_dims.get(node.args[0])
    out_dim = plan.shard_dims.get(node)
    if source_dim is None and out_dim is None:
        return None
    args = list(fx.node.map_arg(node.args, lambda n: env[n]))
    target = node.target
    if target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default,
                  aten.broadcast_to.default):  # fmt: skip
        if out_dim is None:
            return None
        shape = list(args[1])
        shape[out_dim] = _divide(graph, env, shape[out_dim], tp, node)
        args[1] = shape
    elif target == aten.unflatten.int:
        if out_dim is None:
            return None
        sizes = list(args[2])
        i = out_dim - args[1] % len(_shape(node.args[0]))
        if 0 <= i < len(sizes):
            sizes[i] = _divide(graph, env, sizes[i], tp, node)
        args[2] = sizes
    elif target in (aten.split.Tensor, aten.split_with_sizes.default, aten.slice.Tensor, aten.narrow.default,
                    aten.select.int):  # fmt: skip
        if target in (aten.split.Tensor, aten.split_with_sizes.default):
            dim = args[2] if len(args) > 2 else node.kwargs.get("dim", 0)
        else:
            dim = args[1] if len(args) > 1 else 0
        if source_dim is None or dim % len(_shape(node.args[0])) != source_dim:
            return None
        if target == aten.split.Tensor:
            args[1] = _divide(graph, env, args[1], tp, node)
        elif target == aten.split_with_sizes.default:
            args[1] = [_divide(graph, env, size, tp, node) for size in args[1]]
        elif target == aten.slice.Tensor:
            whole = lambda a: a is None or (isinstance(a, int) and (a == 0 or a >= 2**62))  # noqa: E731
            ends = [a if whole(a) else _divide(graph, env, a, tp, node) for a in (list(args) + [None, None])[2:4]]
            args = args[:2] + ends + args[4:]
        elif target == aten.narrow.default:
            args[2:4] = [_divide(graph, env, a, tp, node) for a in args[2:4]]
        else:
            raise Unsupported(f"{node.name} selects one index along the tensor-parallel dimension")
    else:
        return None
    new = graph.call_function(target, tuple(args), fx.node.map_arg(node.kwargs, lambda n: env[n]))
    new.meta = dict(node.meta)
    return new


def _divide(graph: fx.Graph, env: dict, size: Any, tp: int, node: fx.Node) -> Any:
    """``size`` (already in the new graph) divided by ``tp``: a node for a symbolic size."""
    if isinstance(size, fx.Node):
        return graph.call_function(operator.floordiv, (size, tp))
    if size == -1:
        return size
    if not isinstance(size, int) or size % tp:
        raise Unsupported(f"{node.name}'s size {size} along the tensor-parallel dimension does not divide by {tp}")
    return size // tp
