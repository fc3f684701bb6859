"""A block's own forward as a graph: traced once with ``torch.export`` (non-strict, every dimension
``Dim.AUTO``, so the sequence length stays symbolic) on a float64 copy of the block that holds no data,
with the first real call's arguments as the example.

The graph is made block-agnostic: its first input is the block, and every parameter and buffer is read
from it at each call (``_param``: this rank's local part of a DTensor), so the same program runs the real
block, its float64 verification copy, and the block after its parameters were sharded or freed. The
tensors among the call's arguments are the other inputs, in the order ``torch.utils._pytree`` flattens
``(args, kwargs)``; non-tensor arguments are constants of the trace and are checked at each call.

Tracing happens in float64 on a copy that holds no data (each parameter one element broadcast to its
shape): the graph then carries ``torch.float64`` wherever the block's code derives a dtype from its input
(``hidden.to(input_dtype)``); :meth:`Program.retargeted` replaces it (and the trace's device) by the run's
(an explicit ``torch.float32`` in the block's code stays as it is, in every run).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

import torch
from torch import Tensor, fx, nn
from torch.distributed.tensor import DTensor
from torch.export.graph_signature import InputKind, OutputKind
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from lightning_parallel.anatomy.traced.manual import recognise
from lightning_parallel.errors import Unsupported
from lightning_parallel.expert_parallel import call_experts, tracing

_OWNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # block -> {name: (owning module, attribute)}


def _owner(block: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The module that holds ``name`` and the attribute (module objects are stable; what they hold may change,
    e.g. a parameter replaced by its shards, so the value is read at each call)."""
    owners = _OWNERS.setdefault(block, {})
    found = owners.get(name)
    if found is None:
        path, _, attr = name.rpartition(".")
        found = owners[name] = (block.get_submodule(path) if path else block, attr)
    return found


def _param(block: nn.Module, name: str) -> Tensor:
    owner, attr = _owner(block, name)
    p = owner._parameters[attr]
    return p.to_local() if isinstance(p, DTensor) else p


def _buffer(block: nn.Module, name: str) -> Tensor:
    owner, attr = _owner(block, name)
    return owner._buffers[attr]


class _Flat(nn.Module):
    """``block``'s own forward taking only the call's tensors (the rest are the trace's constants)."""

    def __init__(self, block: nn.Module, spec: TreeSpec, leaves: list[Any]) -> None:
        super().__init__()
        self.block, self.spec, self.leaves = block, spec, leaves

    def forward(self, *tensors: Tensor) -> Any:
        it = iter(tensors)
        leaves = [next(it) if isinstance(leaf, Tensor) else leaf for leaf in self.leaves]
        args, kwargs = tree_unflatten(leaves, self.spec)
        return type(self.block).forward(self.block, *args, **kwargs)


@dataclass
class Program:
    """A traced block: ``gm(block, *tensors, *extra)`` returns the block's flattened outputs."""

    gm: fx.GraphModule
    spec: TreeSpec  # of (args, kwargs), the hidden state first
    leaves: list[Any]  # the trace's leaves: tensors (as fake values) and constants
    out_spec: TreeSpec
    dtype: torch.dtype = torch.float64
    device: torch.device | None = None  # the trace's device (None: the run's already)
    extra: tuple[str, ...] = ()  # names of the inputs after the tensors (e.g. a sequence shard)
    training: bool = True  # the block's mode when traced (dropout and such are constants of the trace)
    loose: frozenset = frozenset()  # symbols that may take different values (the sequence, on a sequence shard)

    @property
    def graph(self) -> fx.Graph:
        return self.gm.graph

    def tensor_inputs(self) -> list[fx.Node]:
        """The placeholders of the call's tensors, in flattened order (the hidden state first)."""
        return [n for n in self.graph.nodes if n.op == "placeholder"][1 : 1 + self.num_tensors]

    @cached_property
    def signature(self) -> list[tuple[tuple, tuple]]:
        out = []
        for node in self.tensor_inputs():
            shape = tuple(node.meta["val"].shape)
            dims = tuple(
                s if isinstance(s, int) else (None if s.node.expr in self.loose else s.node.expr) for s in shape
            )
            out.append((shape, dims))
        return out

    @property
    def num_tensors(self) -> int:
        return sum(isinstance(leaf, Tensor) for leaf in self.leaves)

    def flatten(self, x: Tensor, args: tuple, kwargs: dict) -> list[Tensor]:
        """The call's tensors in the order of the graph's inputs; a call the trace does not cover raises."""
        leaves, spec = tree_flatten(((x, *args), kwargs))
        if spec != self.spec:
            raise Unsupported("the block was called with other arguments than when it was traced")
        tensors = []
        for leaf, traced in zip(leaves, self.leaves):
            if isinstance(traced, Tensor):
                tensors.append(leaf)
            elif not (leaf is traced or _same_constant(leaf, traced)):
                raise Unsupported(f"the block was traced with the argument {traced!r}, now called with {leaf!r}")
        _check_shapes(tensors, self.signature)
        return tensors

    def __call__(self, block: nn.Module, x: Tensor, args: tuple, kwargs: dict, *extra: Any) -> Any:
        outputs = self.gm(block, *self.flatten(x, args, kwargs), *extra)
        return tree_unflatten(list(outputs), self.out_spec)

    def retargeted(self, dtype: torch.dtype, device: torch.device) -> Program:
        """The same program with the trace's float64 (and device) replaced by ``dtype`` and ``device``."""
        if dtype == self.dtype and device in (self.device, None):
            return self
        gm = retargeted_module(self.gm, (self.dtype, self.device), (dtype, device))
        return replace(self, gm=gm, dtype=dtype, device=device)


def retargeted_module(gm: fx.GraphModule, traced: tuple[torch.dtype, Any], target: tuple[torch.dtype, Any]
                      ) -> fx.GraphModule:  # fmt: skip
    """``gm`` (traced in ``traced``'s dtype and device) with that dtype and device replaced by ``target``'s:
    in its ops' arguments and its floating buffers (a sub-graph a program calls, e.g. a chunked MLP)."""
    (old_dtype, old_device), (dtype, device) = traced, target

    def retarget(value: Any) -> Any:
        if isinstance(value, torch.dtype) and value == old_dtype:
            return dtype
        if isinstance(value, torch.device) and old_device is not None and value == old_device:
            return device
        return value

    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])
        env[node].args = fx.node.map_aggregate(env[node].args, retarget)
        env[node].kwargs = fx.node.map_aggregate(env[node].kwargs, retarget)
    root = nn.Module()
    for name, value in gm.named_buffers():
        root.register_buffer(name, value.to(dtype=dtype if value.is_floating_point() else None, device=device))
    return fx.GraphModule(root, graph)


def _same_constant(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001
        return False


def _check_shapes(tensors: list[Tensor], signature: list[tuple[tuple, tuple]]) -> None:
    """The trace holds for these shapes: static dims equal, symbolic dims consistent and at least 2 (the
    trace specialised sizes 0 and 1). ``signature``: per tensor, its traced shape and each dim's int or
    symbol (``None`` for a symbol that may differ between tensors)."""
    bound: dict[Any, int] = {}
    for t, (traced, dims) in zip(tensors, signature):
        if t.dim() != len(dims):
            raise Unsupported(f"a {t.dim()}-d tensor where the trace had {len(dims)} dims")
        for size, dim in zip(t.shape, dims):
            if size == dim:
                continue
            if isinstance(dim, int) or size < 2 or (dim is not None and bound.setdefault(dim, size) != size):
                raise Unsupported(f"shape {tuple(t.shape)} where the trace had {traced}")


@contextmanager
def _quiet() -> Any:
    loggers = [logging.getLogger(n) for n in ("torch._export", "torch.export", "torch._dynamo", "torch.fx")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def trace(
    block: nn.Module, x: Tensor, args: tuple, kwargs: dict, attention_route: Callable[[nn.Module], Any] | None = None
) -> Program:
    """Trace ``block``'s own forward on (copies of) this call's arguments; see the module docstring."""
    from lightning_parallel.anatomy.verify import not_captured, stand_in_copy

    copy = stand_in_copy(block)
    leaves, spec = tree_flatten(((x, *args), kwargs))
    leaves = [_stand_in(leaf) for leaf in leaves]
    tensors = tuple(leaf for leaf in leaves if isinstance(leaf, Tensor))
    dims = tuple({i: torch.export.Dim.AUTO for i in range(t.dim())} for t in tensors)
    context = attention_route(copy) if attention_route is not None else nullcontext()
    try:
        with _quiet(), context, torch.autocast("cpu", enabled=False), tracing(copy), not_captured():
            ep = torch.export.export(_Flat(copy, spec, leaves), tensors, dynamic_shapes={"tensors": dims}, strict=False)
    except Unsupported:
        raise
    except Exception as err:  # noqa: BLE001  (any failure to trace is a reason this source cannot serve)
        raise Unsupported(f"torch.export could not trace it: {type(err).__name__}: {str(err).splitlines()[0]}") from err
    if _writes_in_place(ep.graph):  # functional form: a write into a tensor becomes a node its readers depend on
        with _quiet():
            ep = ep.run_decompositions({})
    return replace(recognise(_program(ep, spec, leaves), _param), training=block.training)


def _copied(into: Tensor, src: Tensor) -> Tensor:
    """``aten.copy(into, src)``: ``src`` broadcast to ``into``'s shape, in its dtype (differentiable)."""
    return src.to(into.dtype).expand(into.shape)


def _writes_in_place(graph: fx.Graph) -> bool:
    """Whether the trace writes into a tensor (DeepSeek-V3's keys: ``new_empty`` then ``copy_`` into two slices).
    Such a graph's edges do not show that the written tensor's readers depend on the write, so every analysis
    that follows edges (the cut before attention, the labels) would place the write after its readers."""
    return any(
        isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable
        for n in graph.nodes
        if n.op == "call_function"
    )


def _stand_in(value: Any) -> Any:
    """A stand-in for a call's tensor (its shape and device, float64; values are irrelevant to the trace)."""
    if not isinstance(value, Tensor):
        return value
    return torch.zeros(value.shape, dtype=torch.float64 if value.is_floating_point() else value.dtype,
                       device=value.device)  # fmt: skip


def _program(ep: torch.export.ExportedProgram, spec: TreeSpec, leaves: list[Any]) -> Program:
    signature = ep.graph_signature
    if any(s.kind != OutputKind.USER_OUTPUT for s in signature.output_specs):
        raise Unsupported("its forward mutates a buffer or an input (e.g. running statistics)")
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    block = graph.placeholder("block")
    root = nn.Module()
    kinds = {s.arg.name: s for s in signature.input_specs}
    users = [n for n in ep.graph.nodes if n.op == "placeholder" and kinds[n.name].kind == InputKind.USER_INPUT]
    for node in users:  # the tensors first, in order
        env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)
    for node in ep.graph.nodes:
        if node.op == "placeholder":
            if node in env:
                continue
            spec_ = kinds[node.name]
            target = spec_.target.removeprefix("block.")
            if spec_.kind == InputKind.PARAMETER:
                env[node] = graph.call_function(_param, (block, target))
            elif spec_.kind == InputKind.BUFFER:
                env[node] = graph.call_function(_buffer, (block, target))
            elif spec_.kind in (InputKind.CONSTANT_TENSOR,):
                name = f"constant_{len(list(root.buffers()))}"
                root.register_buffer(name, ep.constants[spec_.target])
                env[node] = graph.get_attr(name)
            else:
                raise Unsupported(f"its trace has an input of kind {spec_.kind.name}")
            env[node].meta = dict(node.meta)
        elif node.op == "output":
            graph.output(fx.node.map_arg(node.args[0], lambda n: env[n]))
        elif node.target is torch.ops.aten._assert_tensor_metadata.default:
            continue  # the trace's own check of a cast's dtype (float64 here), not part of the block
        elif node.target is torch.ops.lightning_parallel.experts.default:  # expert parallelism's call: the module's
            env[node] = graph.call_function(call_experts, (block, *fx.node.map_arg(node.args, lambda n: env[n])))
            env[node].meta = dict(node.meta)
        elif node.target is torch.ops.aten.copy.default:  # a functional write's value (it has no derivative)
            env[node] = graph.call_function(_copied, tuple(env[a] for a in node.args[:2]))
            env[node].meta = dict(node.meta)
        else:
            env[node] = graph.node_copy(node, lambda n: env[n])
            if node.target is torch.ops.aten.view.default:
                # the trace saw one memory layout (a .contiguous() it found a no-op is not in the graph); a
                # distributed attention call or a shard may return another: reshape gives the same values
                env[node].target = torch.ops.aten.reshape.default
    gm = fx.GraphModule(root, graph)
    return Program(gm, spec, leaves, ep.call_spec.out_spec)
