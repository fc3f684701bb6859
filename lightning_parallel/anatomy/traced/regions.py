"""Regions of a traced block: its MLP, found by data flow and run over sequence chunks, and the block cut
at its attention call into pre / attention / post (HelixPipe, Zhang et al., arXiv 2507.00394, §2.1).

**MLP**: a projection whose input comes, through element-wise operations only (activation, gating,
dropout), from projections that all read one input ``h`` is an MLP; the largest such region is the
block's MLP (or the nodes of ``mlp_module=`` when the user names it). It is outlined into a sub-graph
called on ``mlp_chunks`` slices of ``h`` along the sequence and concatenated.

**Split**: nodes that depend on the hidden state or on a parameter and feed q, k or v form ``pre``; the
attention call and the argument-only nodes it needs (a mask from the block's arguments) form
``attention``, which holds no parameter: a parameter the call reads itself (learned sinks) is read in ``pre``
and carried to it after q, k, v (``Split.carried``); everything else that depends on the hidden state, a parameter
or the attention output is ``post``. ``state`` is what ``post`` reads from ``pre`` (the residual, and
e.g. the normalised input of a parallel-residual block). Argument-only nodes are recomputed wherever
they are needed; a parameter ``pre`` and ``post`` both use refuses the split (HelixPipe places the two
parts on different stages).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, fx, nn
from torch.utils._pytree import tree_unflatten

from lightning_parallel.anatomy.traced.analysis import Site, _ancestors, expr_of
from lightning_parallel.anatomy.traced.labels import _ELEMENTWISE, _IDENTITY, projections
from lightning_parallel.anatomy.traced.manual import reads_values
from lightning_parallel.anatomy.traced.program import Program, _buffer, _param, retargeted_module
from lightning_parallel.anatomy.traced.rewrite import SKIP, rewrite
from lightning_parallel.block_protocol import AttentionCall, Shared, Split
from lightning_parallel.errors import ConfigurationError, Unsupported

_DROPOUT = {torch.ops.aten.dropout.default, torch.ops.aten.native_dropout.default}
# taking parts of a fused MLP input (gate | up) along its features: still token-wise
_PARTS = {torch.ops.aten.chunk.default, torch.ops.aten.split.Tensor, torch.ops.aten.split_with_sizes.default,
          torch.ops.aten.slice.Tensor, operator.getitem}  # fmt: skip


# ---------------------------------------------------------------------------------------------- MLP
def _mlp_regions(program: Program) -> list[tuple[set[fx.Node], fx.Node, fx.Node]]:
    """``(nodes, input h, output)`` of every MLP candidate (see the module docstring)."""
    projs = projections(program)
    found = []
    for out, proj in projs.items():
        region, l1s, stack, ok = {out}, [], [proj.input], True
        while stack and ok:
            n = stack.pop()
            if n in region:
                continue
            if n in projs and n is not out:
                region.add(n)
                l1s.append(n)
            elif n.op == "call_function" and (n.target in _ELEMENTWISE or n.target in _IDENTITY or n.target in _PARTS):
                region.add(n)
                stack.extend(a for a in n.all_input_nodes if not _is_lookup(a))
            else:
                ok = False
        inputs = {projs[n].input for n in l1s}
        if not ok or not l1s or len(inputs) != 1:
            continue
        if any(u not in region for n in region - {out} for u in n.users):
            continue
        found.append((region, inputs.pop(), out))
    return found


def _is_lookup(node: fx.Node) -> bool:
    return node.op == "get_attr" or (node.op == "call_function" and node.target in (_param, _buffer))


def _parameter_derived(program: Program) -> set[fx.Node]:
    derived: set[fx.Node] = set()
    for n in program.graph.nodes:
        if _is_lookup(n) or (
            n.op == "call_function"
            and n.all_input_nodes
            and all(a in derived or a.op == "placeholder" and a.name == "block" for a in n.all_input_nodes)
        ):
            derived.add(n)
    return derived


def _module_region(program: Program, path: str) -> tuple[set[fx.Node], fx.Node, fx.Node, dict[fx.Node, int]]:
    """The nodes of module ``path``, its one input, its one output, and the sizes it reads from outside (a
    size of the block's hidden state the trace took once, e.g. a mixture of experts' ``B, T, H = h.shape``)
    as the dim of its input that has that size: a chunk's own size along it, when the region runs on chunks."""
    full = f"block.{path}"  # the trace wraps the block as `block`

    def inside(n: fx.Node) -> bool:
        stack = (n.meta.get("nn_module_stack") or {}).values()
        return any(v[0] == full or str(v[0]).startswith(full + ".") for v in stack)

    nodes = [n for n in program.graph.nodes if n.op == "call_function" and not _is_lookup(n) and inside(n)]
    region = set(nodes)
    # (the block itself is an input of the nodes that call one of its modules: expert parallelism's experts)
    inputs = {a for n in nodes for a in n.all_input_nodes if a not in region and not _is_lookup(a)}
    inputs = {a for a in inputs if not (a.op == "placeholder" and a.name == "block")}
    sizes = {a for a in inputs if a.target == torch.ops.aten.sym_size.int}
    inputs -= sizes
    outputs = [n for n in nodes if any(u not in region for u in n.users)]
    if len(inputs) != 1 or len(outputs) != 1:
        raise Unsupported(f"mlp_module={path!r} is not one region with one input and one output in the graph")
    h = next(iter(inputs))
    shape = [expr_of(size) for size in h.meta["val"].shape]
    dims = {}
    for size in sizes:
        if expr_of(size.meta["val"]) not in shape:
            raise Unsupported(f"mlp_module={path!r} reads a size ({size.meta['val']}) its input {tuple(shape)} lacks")
        dims[size] = shape.index(expr_of(size.meta["val"]))
    return region, h, outputs[0], dims


def chunk_mlp(program: Program, chunks: int, block_name: str, module: str | None = None) -> Program:
    """``program`` with its MLP run over ``chunks`` slices of the sequence."""
    sizes: dict[fx.Node, int] = {}
    if module is not None:
        region, h, out, sizes = _module_region(program, module)
    else:
        candidates = _mlp_regions(program)
        if not candidates:
            raise Unsupported("no MLP in its graph (projections joined by element-wise operations from one input)")
        region, h, out = max(candidates, key=lambda c: sum(1 for n in c[0] if n.target is _param))
    dims = [d for d, size in enumerate(h.meta["val"].shape) if not isinstance(size, int)]
    dim = dims[-1] if dims else h.meta["val"].dim() - 2  # the sequence: the innermost symbolic dim
    sub = _subgraph(program, region, [h], [out], sizes=sizes)
    run = _chunked(sub, (program.dtype, program.device), chunks, dim, block_name)

    def rule(node: fx.Node, graph: fx.Graph, env: dict) -> Any:
        if node is out:
            new = graph.call_function(run, (env[_block(program)], env[h]))
            new.meta = dict(node.meta)
            return new
        if node in region:
            return SKIP
        return None

    return rewrite(program, rule)


def _block(program: Program) -> fx.Node:
    return next(n for n in program.graph.nodes if n.op == "placeholder")


def _chunked(sub: fx.GraphModule, traced: tuple[torch.dtype, Any], chunks: int, dim: int, block_name: str
             ) -> Callable[..., Tensor]:  # fmt: skip
    """``sub`` run on ``chunks`` slices of its input along ``dim``, in the input's dtype and device (the
    program that calls it is retargeted, this sub-graph with it per call)."""
    variants = {traced: sub}

    def chunked_mlp(block: nn.Module, h: Tensor) -> Tensor:
        key = (h.dtype, h.device if traced[1] is not None else None)
        run = variants.get(key) or variants.setdefault(key, retargeted_module(sub, traced, key))
        if chunks > h.shape[dim]:
            raise ConfigurationError(
                f"mlp_chunks={chunks} is larger than the sequence: the MLP input {tuple(h.shape)} of"
                f" {block_name} has {h.shape[dim]} tokens along dim {dim}"
            )
        parts = [part.contiguous() for part in torch.tensor_split(h, chunks, dim=dim)]
        return torch.cat([run(block, part)[0] for part in parts], dim=dim)

    return chunked_mlp


def _subgraph(program: Program, nodes: set[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node],
              lookups: bool = True, sizes: dict[fx.Node, int] | None = None) -> fx.GraphModule:  # fmt: skip
    """A graph module ``(block, *inputs) -> tuple(outputs)`` of ``nodes`` (and the lookups they use); each node
    of ``sizes`` is read again from the first input (``sym_size`` along its dim)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {_block(program): graph.placeholder("block")}
    for n in inputs:
        env[n] = graph.placeholder(n.name)
        env[n].meta = dict(n.meta)
    for n, dim in (sizes or {}).items():
        env[n] = graph.call_function(torch.ops.aten.sym_size.int, (env[inputs[0]], dim))
        env[n].meta = dict(n.meta)
    derived = _parameter_derived(program)  # lookups and what is computed from them alone (a transposed weight)
    for n in program.graph.nodes:
        if n in env or (n not in nodes and not (lookups and n in derived)):
            continue
        env[n] = graph.node_copy(n, lambda a: env[a])
        env[n].meta = dict(n.meta)
    graph.output(tuple(env[n] for n in outputs))
    graph.eliminate_dead_code()
    return fx.GraphModule(program.gm, graph)


# -------------------------------------------------------------------------------------------- split
def split(program: Program, site: Site, config: Any, block_name: str) -> Split:
    """The traced block cut at its attention call (see the module docstring)."""
    if config.mlp_chunks > 1:
        program = chunk_mlp(program, config.mlp_chunks, block_name, config.mlp_module)
        site = replace(site, attention=_same_node(program, site.attention))
    parts = _partition(program, site)
    pre, attention, post = _callables(program, parts, site.attention)
    return Split("the traced graph", pre, attention, post, pre_parameters=frozenset(parts["pre_parameters"]),
                 attention_call=_static_call(site), carried=len(parts["carried"]))  # fmt: skip


def _static_call(site: Site) -> Any:
    """The SDPA call's parameters where the graph fixes them (no mask tensor): ring attention's arguments."""
    from lightning_parallel.anatomy.traced.sequence import sdpa_arguments

    if site.kind != "sdpa":
        return None
    a = sdpa_arguments(site.attention)
    if any(isinstance(a[k], fx.Node) for k in ("attn_mask", "dropout_p", "is_causal", "scale")):
        return None
    call = AttentionCall(bool(a["is_causal"]), a["scale"], float(a["dropout_p"]), None)
    return lambda block, args, kwargs: call


def _same_node(program: Program, old: fx.Node) -> fx.Node:
    return next(n for n in program.graph.nodes if n.name == old.name)


def _partition(program: Program, site: Site) -> dict[str, Any]:
    graph, attention = program.graph, site.attention
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    x = placeholders[1]
    deps: dict[fx.Node, frozenset[str]] = {}
    for n in graph.nodes:
        if n.op == "placeholder":
            deps[n] = frozenset({"x"}) if n is x else frozenset()
        elif n is attention:
            deps[n] = frozenset({"attention"})
        elif n.op == "call_function" and n.target is _param:
            deps[n] = frozenset({"param"})
        elif n.op == "output":
            continue
        else:
            deps[n] = frozenset().union(*(deps[a] for a in n.all_input_nodes)) if n.all_input_nodes else frozenset()
    feeds_qkv = _ancestors(list(site.qkv))
    pre = {n for n in feeds_qkv if deps[n] & {"x", "param"} and "attention" not in deps[n]}
    extra = [a for a in attention.all_input_nodes if a not in site.qkv]
    # parameters the call reads (learned sinks): read before attention and carried to it with q, k, v
    carried = [a for a in extra if a.op == "call_function" and a.target is _param]
    pre |= set(carried)
    extra = [a for a in extra if a not in carried]
    if any(reads_values(a, x) or deps[a] & {"param", "attention"} for a in extra):
        raise Unsupported("its attention call reads a tensor computed from the hidden state or a parameter (a mask?)")
    post = {n for n in graph.nodes if n.op != "output" and deps.get(n) and n not in pre and n is not attention}
    post_params = {n.args[1] for n in post if n.op == "call_function" and n.target is _param}
    pre_params = {n.args[1] for n in pre if n.op == "call_function" and n.target is _param}
    both = pre_params & post_params
    if both:
        raise Unsupported(f"the parameter(s) {sorted(both)} are used both before and after its attention call")
    state = [n for n in graph.nodes if (n in pre or n is x) and any(u in post for u in n.users)]
    symbolic = [n for n in state if not isinstance(n.meta.get("val"), Tensor)]
    state = [n for n in state if isinstance(n.meta.get("val"), Tensor)]
    return {"pre": pre, "post": post, "state": state, "symbolic": symbolic, "x": x,
            "pre_parameters": pre_params, "carried": carried}  # fmt: skip


def _free(graph: fx.Graph, needed: set[fx.Node], taken: set[fx.Node]) -> set[fx.Node]:
    """The argument-only ancestors of ``needed`` (recomputed in each part that needs them)."""
    out: set[fx.Node] = set()
    stack = [a for n in needed for a in n.all_input_nodes]
    while stack:
        n = stack.pop()
        if n in out or n in taken or n.op == "placeholder":
            continue
        out.add(n)
        stack.extend(n.all_input_nodes)
    return out


def _part(program: Program, nodes: set[fx.Node], inputs: list[fx.Node], outputs: list[Any],
          symbolic: dict[fx.Node, tuple[fx.Node, int]] | None = None) -> fx.GraphModule:  # fmt: skip
    """``(block, *inputs, *tensors) -> tuple(outputs)`` over ``nodes`` (the call's tensors are the program's
    tensor placeholders; ``symbolic`` re-derives sizes from a tensor input: node -> (input, dim))."""
    graph = fx.Graph()
    placeholders = [n for n in program.graph.nodes if n.op == "placeholder"]
    env: dict[fx.Node, Any] = {placeholders[0]: graph.placeholder("block")}
    for n in inputs:
        env[n] = graph.placeholder(f"in_{n.name}")
        env[n].meta = dict(n.meta)
    for n in placeholders[1:]:  # every call tensor keeps its slot (a state input may stand for one)
        placeholder = graph.placeholder(n.name if n not in env else f"unused_{n.name}")
        if n not in env:
            env[n] = placeholder
            env[n].meta = dict(n.meta)
    for n, (source, dim) in (symbolic or {}).items():
        env[n] = graph.call_function(torch.ops.aten.sym_size.int, (env[source], dim))
    for n in program.graph.nodes:
        if n in env or n not in nodes:
            continue
        env[n] = graph.node_copy(n, lambda a: env[a])
        env[n].meta = dict(n.meta)
    graph.output(tuple(fx.node.map_arg(o, lambda a: env[a]) for o in outputs))
    graph.eliminate_dead_code()
    return fx.GraphModule(program.gm, graph)


def _callables(program: Program, parts: dict[str, Any], attention: fx.Node) -> tuple[Any, Any, Any]:
    graph = program.graph
    q, k, v = attention.args[:3]
    pre_nodes, post_nodes, state, carried = parts["pre"], parts["post"], parts["state"], parts["carried"]
    pre_gm = _part(program, pre_nodes | _free(graph, pre_nodes, pre_nodes), [], [q, k, v, *carried, *state])
    # the hidden state's sizes an argument-only input of the call reads (a bias over arange(T)): from q, k, v
    size_of_x = {n for n in graph.nodes if n.target is torch.ops.aten.sym_size.int and n.args[0] is parts["x"]}
    attn_nodes = {attention} | _free(graph, {attention}, (pre_nodes - size_of_x) | {q, k, v})
    sizes = [n for n in attn_nodes if n in size_of_x]
    attn_gm = _part(program, attn_nodes - set(sizes), [q, k, v, *carried], [attention], _sizes_for(sizes, [q, k, v]))
    symbolic = _sizes_for(parts["symbolic"], [attention, *state])
    post_gm = _part(program, post_nodes | _free(graph, post_nodes, pre_nodes | {attention}),
                    [attention, *state], list(graph.output_node().args[0]), symbolic)  # fmt: skip
    return _Pre(program, pre_gm, len(carried)), _Attention(program, attn_gm), _Post(program, post_gm)


def _sizes_for(symbolic: list[fx.Node], available: list[fx.Node]) -> dict[fx.Node, tuple[fx.Node, int]]:
    found = {}
    for n in symbolic:
        expr = expr_of(n.meta.get("val"))
        for t in available:
            dims = [d for d, s in enumerate(t.meta["val"].shape) if expr_of(s) == expr]
            if dims:
                found[n] = (t, dims[0])
                break
        else:
            raise Unsupported(
                f"the size {n.name} the block uses after attention is not a size of what attention returns"
            )
    return found


class _Part(Shared):
    """One part of a split traced program, retargeted to the call's dtype and device."""

    def __init__(self, program: Program, gm: fx.GraphModule) -> None:
        self.program = replace(program, gm=gm)
        self._targets: dict[Any, Program] = {}
        self.dropout = any(  # a random op whose rate the trace fixed for its mode
            n.op == "call_function" and n.target in _DROPOUT and len(n.args) > 1 and n.args[1] for n in gm.graph.nodes
        )

    def _run(self, like: Tensor, block: nn.Module, inputs: list[Tensor], tensors: list[Any]) -> tuple:
        if self.dropout and block.training != self.program.training:
            raise ConfigurationError(
                f"{type(block).__name__} was split for HelixPipe in {'training' if self.program.training else 'eval'}"
                " mode and has dropout; evaluating it in the other mode needs dropout=0 (or a hand-written adapter)"
            )
        key = (like.dtype, like.device)
        target = self._targets.get(key)
        if target is None:
            target = self._targets[key] = self.program.retargeted(*key)
        return target.gm(block, *inputs, *tensors)


class _Pre(_Part):
    def __init__(self, program: Program, gm: fx.GraphModule, carried: int) -> None:
        super().__init__(program, gm)
        self.carried = carried

    def __call__(self, block: nn.Module, x: Tensor, args: tuple, kwargs: dict) -> Any:
        out = self._run(x, block, [], self.program.flatten(x, args, kwargs))
        return tuple(out[: 3 + self.carried]), tuple(out[3 + self.carried :])


class _Attention(_Part):
    def __call__(
        self, block: nn.Module, q: Tensor, k: Tensor, v: Tensor, args: tuple, kwargs: dict, carried: tuple = ()
    ) -> Tensor:
        return self._run(q, block, [q, k, v, *carried], _placeholder_tensors(self, args, kwargs))[0]


class _Post(_Part):
    def __call__(self, block: nn.Module, out: Tensor, state: tuple, args: tuple, kwargs: dict) -> Any:
        outputs = self._run(out, block, [out, *state], _placeholder_tensors(self, args, kwargs))
        return tree_unflatten(list(outputs), self.program.out_spec)


def _placeholder_tensors(part: _Part, args: tuple, kwargs: dict) -> list[Any]:
    """The call's tensors without the hidden state (which these parts do not read): its slot holds None."""
    from torch.utils._pytree import tree_flatten

    leaves, _ = tree_flatten(((_ABSENT, *args), kwargs))
    tensors = [leaf for leaf, traced in zip(leaves, part.program.leaves) if isinstance(traced, Tensor)]
    return [None, *tensors[1:]]


_ABSENT = torch.empty(0)  # stands in for the hidden state when flattening a call's arguments
