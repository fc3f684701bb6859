"""Rewriting a traced program node by node (each transform of the traced anatomy is one rewrite)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from torch import fx

from lightning_parallel.anatomy.traced.program import Program

# (node, new graph, env: old node -> new node) -> the replacement node, None to copy the node as it is, or
# SKIP for a node that moved into a sub-graph (nothing outside it may read the node then)
Rule = Callable[[fx.Node, fx.Graph, dict[fx.Node, Any]], Any]
SKIP = object()


def rewrite(program: Program, rule: Rule, extra: tuple[str, ...] = ()) -> Program:
    """A copy of ``program`` with ``rule`` applied to every node, and placeholders ``extra`` appended after
    the existing ones (their new nodes are ``env[name]``)."""
    graph = fx.Graph()
    env: dict[Any, Any] = {}
    placeholders = [n for n in program.graph.nodes if n.op == "placeholder"]
    for node in placeholders:
        env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)
    for name in extra:
        env[name] = graph.placeholder(name)
    for node in program.graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            graph.output(fx.node.map_arg(node.args[0], lambda n: env[n]))
            continue
        new = rule(node, graph, env)
        if new is SKIP:
            continue
        if new is None:
            new = graph.node_copy(node, lambda n: env[n])
            new.meta = dict(node.meta)
        env[node] = new
    gm = fx.GraphModule(program.gm, graph)
    return replace(program, gm=gm, extra=program.extra + extra)
