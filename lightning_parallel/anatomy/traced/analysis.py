"""What a traced block's graph tells about its anatomy: its one attention call (SDPA, or a Hugging Face
attention function routed through the registry), the head counts, the sequence length (a symbol of the
trace) and from it which dimension of the hidden state is the sequence, which arguments carry the
sequence and which only feed attention, and where the block creates positions over the sequence
itself (RoPE computed inside the block) that sequence parallelism must take from the global ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from lightning_parallel.anatomy.traced.program import Program
from lightning_parallel.errors import Unsupported
from lightning_parallel.recompute import SDPA_KERNELS

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default
_ARANGE = (aten.arange.default, aten.arange.start, aten.arange.start_step)
# ops that mix tokens along a dimension of their input: a convolution over its spatial dims, a scan along one
_CONVOLUTIONS = {aten.convolution.default, aten.conv1d.default, aten.conv2d.default, aten.conv3d.default,
                 aten.conv1d.padding, aten.conv2d.padding, aten.conv3d.padding}  # fmt: skip
_MIXERS = {*_CONVOLUTIONS, aten.cumsum.default, aten.cumprod.default, aten.logcumsumexp.default}
_FACTORIES = {aten.zeros.default, aten.ones.default, aten.full.default, aten.empty.memory_format, aten.rand.default,
              aten.randn.default, aten.new_zeros.default, aten.new_ones.default, aten.new_full.default,
              aten.new_empty.default, aten.zeros_like.default}  # fmt: skip


@dataclass
class Site:
    """The anatomy a traced graph shows (see the module docstring)."""

    attention: fx.Node
    kind: str  # "sdpa" or "hf"
    heads: int
    kv_heads: int
    seq: Any  # the sequence length's symbol
    seq_dim: int  # of the hidden state
    sequence_inputs: dict[int, list[int]] = field(default_factory=dict)  # tensor input -> its sequence dims (sliced)
    attention_inputs: set[int] = field(default_factory=set)  # tensor inputs only the attention reads (kept whole)
    positions: list[fx.Node] = field(default_factory=list)  # arange(T) inside the block
    table_slices: list[fx.Node] = field(default_factory=list)  # table[:T] inside the block
    sequence_factories: list[fx.Node] = field(default_factory=list)  # other tensors the block creates over T
    sequence_mixers: list[fx.Node] = field(default_factory=list)  # convolutions / scans of the hidden state over T

    @property
    def qkv(self) -> tuple[fx.Node, fx.Node, fx.Node]:
        q, k, v = self.attention.args[:3]
        return q, k, v


def expr_of(value: Any) -> Any:
    return value.node.expr if isinstance(value, torch.SymInt) else value


def attention_nodes(graph: fx.Graph) -> list[fx.Node]:
    """SDPA calls, and Hugging Face attention calls made through the registry while tracing."""
    targets = {SDPA, *SDPA_KERNELS}
    return [
        n for n in graph.nodes
        if n.op == "call_function" and (n.target in targets or getattr(n.target, "hf_attention_call", False))
    ]  # fmt: skip


def analyse(program: Program) -> Site:
    """The :class:`Site` of ``program``; raises :class:`Unsupported` naming what does not fit."""
    graph = program.graph
    found = attention_nodes(graph)
    if not found:
        raise Unsupported(
            "no attention call in its graph (looked for torch's scaled_dot_product_attention, transformers'"
            " attention functions, and q @ k^T, a constant scale, biases and masks that read no parameter, softmax,"
            " @ v written by hand); another form of attention cannot be cut"
        )
    if len(found) > 1:
        raise Unsupported(
            f"its graph calls attention {len(found)} times (e.g. self- and cross-attention); HelixPipe and sequence"
            " parallelism split a block at its one attention call"
        )
    (attention,) = found
    if attention.target in SDPA_KERNELS:
        raise Unsupported(f"its attention runs {attention.target} directly; call F.scaled_dot_product_attention")
    kind = "sdpa" if attention.target == SDPA else "hf"
    q, k, _ = (a.meta["val"] for a in attention.args[:3])
    heads, kv_heads = q.shape[1], k.shape[1]
    if not (isinstance(heads, int) and isinstance(kv_heads, int)):
        raise Unsupported("its head counts are not static in the trace")
    seq = expr_of(q.shape[2])
    inputs = program.tensor_inputs()
    x = inputs[0].meta["val"]
    dims = [d for d, size in enumerate(x.shape) if expr_of(size) == seq]
    if len(dims) != 1:
        raise Unsupported(f"no single dimension of its hidden state {tuple(x.shape)} is the sequence of its attention")
    site = Site(attention, kind, heads, kv_heads, seq, dims[0])
    _sequence_inputs(site, inputs)
    _sources(site, graph)
    reads_hidden = _descendants(inputs[0])
    site.sequence_mixers = [n for n in graph.nodes if n in reads_hidden and _spans_sequence(n, seq)]
    return site


def _spans_sequence(node: fx.Node, seq: Any) -> bool:
    """Whether ``node`` mixes its input along the sequence (a Mamba or linear-attention mixer's causal
    convolution, the cumulative sums of its scan): a convolution over a spatial dim of length T, a scan along a
    dim of length T."""
    if node.op != "call_function" or node.target not in _MIXERS:
        return False
    shape = node.args[0].meta["val"].shape
    if node.target in _CONVOLUTIONS:
        return any(expr_of(size) == seq for size in shape[2:])
    return expr_of(shape[node.args[1]]) == seq


def _ancestors(nodes: list[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = list(nodes)
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return seen


def _descendants(node: fx.Node, stop: fx.Node | None = None) -> set[fx.Node]:
    """What reads ``node``'s data, up to ``stop`` if given (a read of its size, e.g. a batch size taken from a
    mask, is not a read of its data)."""
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n is not stop:
            stack.extend(u for u in n.users if u.target != aten.sym_size.int)
    return seen


def _sequence_inputs(site: Site, inputs: list[fx.Node]) -> None:
    attention = site.attention
    extra = [a for a in attention.all_input_nodes if a not in site.qkv]
    feeds_extra = _ancestors(extra)
    feeds_qkv = _ancestors(list(site.qkv))
    for i, node in enumerate(inputs[1:], start=1):
        shape = node.meta["val"].shape
        dims = [d for d, size in enumerate(shape) if expr_of(size) == site.seq]
        if not dims:
            continue
        reached = _descendants(node, attention) - {node, attention}
        if reached <= feeds_extra and not reached & feeds_qkv:
            site.attention_inputs.add(i)  # a mask: whole for the attention, wherever it runs
            continue
        if len(dims) > 1:
            raise Unsupported(
                f"its argument {node.name} {tuple(shape)} spans the sequence twice and is used outside attention"
            )
        site.sequence_inputs[i] = dims


def _is_seq(node: Any, seq: Any) -> bool:
    return isinstance(node, fx.Node) and expr_of(node.meta.get("val")) == seq


def _sources(site: Site, graph: fx.Graph) -> None:
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in _ARANGE:
            start, end, step = _range(node)
            if start == 0 and step == 1 and _is_seq(end, site.seq):
                site.positions.append(node)
            elif any(_is_seq(a, site.seq) for a in (start, end)):
                site.sequence_factories.append(node)
        elif node.target == aten.slice.Tensor:
            table, dim, start, end = (list(node.args) + [0, None, None])[:4]
            size = table.meta["val"].shape[dim] if isinstance(table, fx.Node) else None
            if start in (0, None) and _is_seq(end, site.seq) and expr_of(size) != site.seq:
                site.table_slices.append(node)
        elif node.target in _FACTORIES:
            if any(expr_of(s) == site.seq for s in getattr(node.meta.get("val"), "shape", ())):
                site.sequence_factories.append(node)


def _range(node: fx.Node) -> tuple[Any, Any, Any]:
    args = list(node.args)
    if node.target == aten.arange.default:
        return 0, args[0], 1
    if node.target == aten.arange.start:
        return args[0], args[1], 1
    return args[0], args[1], args[2]
