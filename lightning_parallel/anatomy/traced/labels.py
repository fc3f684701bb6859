"""The label interpreter of the traced tensor-parallel derivation (:mod:`.tensor`): which columns of which
projection every element of every value of a block's graph comes from.

Each projection whose input is replicated (a column-parallel candidate) labels its output columns with
their index; views, transposes, splits, concatenations and index lists move the labels, element-wise ops
keep them (the first labelled operand's, with the others' kept as aliases of the same projection, e.g. the
gate and up halves of one fused projection), shape-keeping reductions (norms, softmax) pass them and are
recorded to be checked against the ranks, and an attention call whose q is labelled labels its output by
head (``h * D + d``). What no rule covers is recorded per projection. The sinks, attention's q/k/v and the
inputs of projections that consume labels (row-parallel candidates), are where the plan is decided.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, fx

from lightning_parallel.anatomy.traced.program import Program, _param

aten = torch.ops.aten

_IDENTITY = {aten.clone.default, aten.contiguous.default, aten.alias.default, aten.detach.default,
             aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten.type_as.default,
             aten.dropout.default, aten.lift_fresh_copy.default}  # fmt: skip
_MOVE = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default,
         aten.permute.default, aten.transpose.int, aten.t.default, aten.unsqueeze.default, aten.squeeze.dim,
         aten.squeeze.dims, aten.squeeze.default, aten.split.Tensor, aten.split_with_sizes.default,
         aten.chunk.default, aten.unbind.int, aten.slice.Tensor, aten.select.int, aten.narrow.default,
         aten.unflatten.int, aten.flatten.using_ints, aten.cat.default, aten.stack.default,
         aten.movedim.int, aten.repeat_interleave.self_int, aten.repeat.default, aten.index.Tensor,
         aten.broadcast_to.default}  # fmt: skip
_ELEMENTWISE = {aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.neg.default,
                aten.pow.Tensor_Scalar, aten.sqrt.default, aten.rsqrt.default, aten.exp.default, aten.tanh.default,
                aten.sigmoid.default, aten.silu.default, aten.gelu.default, aten.relu.default, aten.where.self,
                aten.masked_fill.Scalar, aten.clamp.default, aten.abs.default, aten.reciprocal.default,
                aten.erf.default, aten.add.Scalar, aten.mul.Scalar, aten.sub.Scalar, aten.div.Scalar,
                aten.log.default, aten.sin.default, aten.cos.default, aten.square.default,
                aten.rsub.Scalar, aten.add_.Tensor, aten.mul_.Tensor, aten.div_.Tensor}  # fmt: skip
_REDUCE = {aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.var.correction, aten.softmax.int,
           aten._softmax.default, aten.log_softmax.int, aten.layer_norm.default, aten.rms_norm.default}  # fmt: skip
_PROJECTIONS = {aten.linear.default, aten.addmm.default, aten.mm.default, aten.matmul.default}
_TRANSPOSED = {aten.t.default, aten.transpose.int, aten.permute.default, aten.numpy_T.default}


@dataclass
class Projection:
    node: fx.Node
    weight: str  # parameter name inside the block
    bias: str | None
    out_dim: int  # the weight's output dimension: 0 for (out, in), 1 for (in, out)
    input: fx.Node


@dataclass
class Labels:
    """Which source column each element of every labelled value comes from (-1: none)."""

    values: dict[fx.Node, Any] = field(default_factory=dict)  # node -> {source: LongTensor} (or a list of them)
    unknown: dict[Any, list[str]] = field(default_factory=dict)  # source -> ops it met that no rule covers
    reductions: list[tuple[Any, Tensor, list[int]]] = field(default_factory=list)  # (source, labels, dims)
    rowwise: dict[fx.Node, dict[Any, Tensor]] = field(default_factory=dict)  # row-parallel node -> input labels
    attention_in: dict[tuple[fx.Node, int], dict[Any, Tensor]] = field(default_factory=dict)  # (call, q/k/v)
    outputs: set[Any] = field(default_factory=set)  # sources reaching the block's output
    replicated_params: dict[Any, set[str]] = field(default_factory=dict)  # source -> params applied to it


def _hint(value: Any) -> Any:
    if isinstance(value, torch.SymInt):
        return int(value.node.hint)
    if isinstance(value, (list, tuple)):
        return type(value)(_hint(v) for v in value)
    return value


def _shape(node: fx.Node) -> list[int]:
    return [_hint(s) for s in node.meta["val"].shape]


def projections(program: Program) -> dict[fx.Node, Projection]:
    """The graph's projections by the block's parameters (see the module docstring, step 1)."""
    found = {}
    for node in program.graph.nodes:
        if node.op != "call_function" or node.target not in _PROJECTIONS:
            continue
        if node.target == aten.linear.default:
            x, w = node.args[0], node.args[1]
            b = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
            out_dim = 0
        elif node.target == aten.addmm.default:
            b, x, w = node.args[0], node.args[1], node.args[2]
            out_dim = 1
        else:
            x, w, b = node.args[0], node.args[1], None
            out_dim = 1
            if isinstance(w, fx.Node) and w.target in _TRANSPOSED:
                w, out_dim = w.args[0], 0
        if not _is_param(w) or _shape(w).__len__() != 2:
            continue
        bias = b.args[1] if _is_param(b) else None
        if b is not None and bias is None:
            continue
        found[node] = Projection(node, w.args[1], bias, out_dim, x)
    return found


def _is_param(node: Any) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is _param


def label(program: Program, attentions: list[fx.Node], sources: set[fx.Node], projs: dict) -> Labels:
    """Run the label interpreter (step 2) with ``sources`` as the column-parallel candidates."""
    out = Labels()
    params_of: dict[fx.Node, set[str]] = {}
    for node in program.graph.nodes:
        if node.op == "output":
            for leaf in torch.utils._pytree.tree_leaves(node.args[0]):
                if isinstance(leaf, fx.Node):
                    out.outputs |= _sources_of({leaf: out.values[leaf]} if leaf in out.values else {})
            continue
        if node.op != "call_function" or node.target == aten.sym_size.int:
            continue
        inputs = {a: out.values[a] for a in node.all_input_nodes if a in out.values and out.values[a]}
        if node in projs and node in sources and projs[node].input not in inputs:
            n = _shape(node)
            out.values[node] = {node: torch.arange(n[-1]).expand(*n).contiguous()}
            continue
        if node in attentions:
            for i, a in enumerate(node.args[:3]):
                out.attention_in[(node, i)] = dict(out.values.get(a, {}))
            if node.args[0] in out.values and out.values[node.args[0]]:  # sharded heads: the output is too
                H, D = attention_heads(node)
                per_head = torch.arange(H)[:, None] * D + torch.arange(D)  # (H, D)
                if _heads_dim(node) == 1:
                    per_head = per_head[:, None, :]  # (H, 1, D): (B, H, T, D)
                out.values[node] = {node: per_head.expand(*_shape(node)).contiguous()}
            continue
        if not inputs:
            derived = set().union(*(params_of.get(a, set()) for a in node.all_input_nodes))
            if _is_param(node):
                derived = {node.args[1]}
            if derived:
                params_of[node] = derived  # computed from parameters alone (e.g. 1 + weight.float())
            continue
        if node in projs:
            x = projs[node].input
            if x in inputs:
                out.rowwise[node] = {s: t.reshape(-1, t.shape[-1])[0] for s, t in inputs[x].items()}
            continue
        for a in node.all_input_nodes:  # a replicated parameter applied to a shard gets a partial gradient
            for source in _sources_of(inputs):
                out.replicated_params.setdefault(source, set()).update(params_of.get(a, set()))
        out.values[node] = _apply(node, inputs, out)
    return out


def _heads_dim(attention: fx.Node) -> int:
    """Where the heads are in an attention call's output: SDPA's (B, H, T, D), transformers' (B, T, H, D)."""
    return 2 if getattr(attention.target, "hf_attention_call", False) else 1


def attention_heads(attention: fx.Node) -> tuple[int, int]:
    """(heads, head dim) of an attention call's output."""
    shape = _shape(attention)
    return shape[_heads_dim(attention)], shape[-1]


def base(source: Any) -> Any:
    """The projection (or attention call) whose columns a label key names: an alias ``(source, node, k)``
    carries the labels of a second operand of one element-wise op."""
    return source[0] if isinstance(source, tuple) else source


def _sources_of(inputs: dict) -> set[Any]:
    found: set[Any] = set()
    for value in inputs.values():
        for part in value if isinstance(value, list) else [value]:
            found |= set(part)
    return found


def _concrete(node: fx.Node, value: Any, inputs: dict, source: Any) -> Any:
    """``value`` (an argument of ``node``) for the label interpreter: labels for labelled nodes, the values of
    the graph's constants (index lists), -1 fills for other tensors, concrete sizes for symbols."""
    if isinstance(value, fx.Node):
        constant = _constant(value)
        if constant is not None:
            return constant
        labels = inputs.get(value)
        if labels is not None:
            if isinstance(labels, list):
                return [part.get(source, torch.full(_shape_of(part), -1, dtype=torch.long)) for part in labels]
            if source in labels:
                return labels[source]
        meta = value.meta.get("val")
        if isinstance(meta, Tensor):
            return torch.full([_hint(s) for s in meta.shape], -1, dtype=torch.long)
        return _hint(meta)
    if isinstance(value, (list, tuple)):
        return type(value)(_concrete(node, v, inputs, source) for v in value)
    return value


def _constant(node: fx.Node) -> Tensor | None:
    """The value of a graph constant (an index list), through copies of it."""
    while node.op == "call_function" and node.target in _IDENTITY and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return getattr(node.graph.owning_module, node.target) if node.op == "get_attr" else None


def _shape_of(part: dict) -> list[int]:
    return list(next(iter(part.values())).shape) if part else []


_SHAPED = {
    aten.softmax.int,
    aten._softmax.default,
    aten.log_softmax.int,
    aten.layer_norm.default,
    aten.rms_norm.default,
}  # reductions that keep the shape: labels pass, the reduction is checked


def _apply(node: fx.Node, inputs: dict, out: Labels) -> Any:
    sources = _sources_of(inputs)
    target = node.target
    if target is operator.getitem:
        labels = inputs[node.args[0]]
        return labels[node.args[1]] if isinstance(labels, list) else {}
    if target in _IDENTITY:
        return inputs.get(node.args[0], {})
    if target in _MOVE:
        op = aten.reshape.default if target in (aten.view.default, aten._unsafe_view.default) else target
        results: dict[Any, Any] = {}
        for source in sources:
            args = _concrete(node, node.args, inputs, source)
            kwargs = _concrete(node, dict(node.kwargs), inputs, source)
            results[source] = op(*args, **kwargs)
        if isinstance(next(iter(results.values())), (list, tuple)):
            count = len(next(iter(results.values())))
            return [{s: r[i].contiguous() for s, r in results.items()} for i in range(count)]
        return {s: r.contiguous() for s, r in results.items()}
    if target in _ELEMENTWISE or target in _REDUCE:
        shape = _shape(node)
        results = {}
        for source in sources:
            parts = [inputs[a][source] for a in node.all_input_nodes if a in inputs and source in inputs[a]]
            if target in _REDUCE:
                labels = parts[0]
                dims = _reduced_dims(node, list(labels.shape))
                out.reductions.append((source, labels, dims))
                if target not in _SHAPED:
                    if labels.dim() == len(shape):  # keepdim: any position stands for the reduced ones
                        for d in dims:
                            labels = labels.narrow(d, 0, 1)
                        labels = labels.expand(*shape)
                    else:
                        for d in sorted(dims, reverse=True):
                            labels = labels.select(d, 0)
                results[source] = labels.contiguous()
                continue
            merged = torch.full(shape, -1, dtype=torch.long)
            for part in parts:  # the first labelled operand wins (the others broadcast against it)
                merged = torch.where(merged >= 0, merged, part.expand(*shape))
            results[source] = merged
            for k, part in enumerate(parts[1:], start=1):  # e.g. gate * up of one fused projection
                part = part.expand(*shape)
                if not torch.equal(part, merged):
                    results[(base(source), node.name, k)] = part.contiguous()
        return results
    for source in sources:
        out.unknown.setdefault(source, []).append(f"{node.name} ({target})")
    return {}


def _reduced_dims(node: fx.Node, in_shape: list[int]) -> list[int]:
    rank = len(in_shape)
    if node.target in (aten.layer_norm.default, aten.rms_norm.default):
        return list(range(rank - len(node.args[1]), rank))
    if node.target in (aten.softmax.int, aten._softmax.default, aten.log_softmax.int):
        return [node.args[1] % rank]
    dims = node.args[1] if len(node.args) > 1 else None
    dims = [dims] if isinstance(dims, int) else list(dims or range(rank))
    return [d % rank for d in dims]
