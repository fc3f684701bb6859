"""A chunk's backward in two actions (Qi et al., ICLR 2024, "Zero Bubble Pipeline Parallelism", §2):
``I`` computes the gradient of the chunk's input, which the previous stage waits for; ``W`` computes the
gradients of the weights later, when the schedule has a hole for it.

``I`` walks the autograd graph from the chunk's outputs once, before running it, and finds for each
group of weights the *intermediates*: the nodes on the path from the input to the outputs from which
the weights hang (for a linear layer, its matmul's backward). A pre-hook on each keeps the gradient
flowing into it; the backward then runs to the input only (``torch.autograd.grad`` with the input as
its target), so the engine skips every weight-gradient product. ``W`` starts from the kept gradients at
those nodes and runs to the weights only. The graph analysis is torch's own
(``torch.distributed.pipelining._backward``: ``construct_reverse_graph``, ``get_param_groups``), as its
zero-bubble schedules use it; unlike torch's ``stage_backward_weight`` this one also serves weights not
reachable from the input (a loss-side parameter, say), and keeps the outputs' graph for them.

Recomputation: a recomputed block's saved tensors are unpacked in both actions (its matmul node runs in
``I`` for the input gradient and in ``W`` for the weight's), which torch's checkpoint allows once per
tensor; blocks run under such a schedule use ``recompute.shared_checkpoint``, whose recomputation runs
once and serves both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node
from torch.distributed.pipelining._backward import construct_reverse_graph, get_param_groups


def _node(t: Tensor) -> Node | None:
    """The tensor's autograd node: its ``grad_fn``, or for a leaf that requires grad its accumulator."""
    if t.grad_fn is not None:
        return t.grad_fn
    if t.requires_grad:
        return t.view_as(t).grad_fn.next_functions[0][0]  # type: ignore[union-attr]
    return None


@dataclass
class WeightWork:
    """What ``W`` needs: per weight group its intermediates and the gradients kept at them, and the
    outputs (with their gradients) for the weights that no intermediate reaches."""

    groups: list[dict[str, Any]] = field(default_factory=list)
    orphans: list[Tensor] = field(default_factory=list)
    outputs: list[Tensor] = field(default_factory=list)
    output_grads: list[Tensor] = field(default_factory=list)
    then: list[tuple[Tensor, Tensor]] = field(default_factory=list)  # (tensor, its gradient): backward after W

    def run(self) -> None:
        """Accumulate every weight's gradient into ``.grad``, then run the deferred backwards."""
        for group in self.groups:
            edges, grads = [], []
            for kept, node in zip(group.get("grads") or [], group["intermediates"]):
                for i, g in enumerate(kept or ()):
                    if g is not None:
                        edges.append(GradientEdge(node, i))
                        grads.append(g)
            if not edges:
                continue
            handles = []
            if len(group["intermediates"]) > 1:  # a descendant intermediate must not count its ancestor twice
                for kept, node in zip(group["grads"], group["intermediates"]):
                    handles.append(node.register_prehook(lambda _, k=kept: k))
            try:
                params = list(group["params"])
                dweights = torch.autograd.grad(
                    edges, [GradientEdge(p, 0) for p in params], grads, retain_graph=True, allow_unused=True
                )
            finally:
                for h in handles:
                    h.remove()
            for node, dw in zip(params, dweights):
                _accumulate(node.variable, dw)
        if self.orphans:
            dweights = torch.autograd.grad(
                self.outputs, self.orphans, self.output_grads, retain_graph=True, allow_unused=True
            )
            for p, dw in zip(self.orphans, dweights):
                _accumulate(p, dw)
        for tensor, grad in self.then:
            torch.autograd.backward(tensor, grad)
        self.groups, self.orphans, self.outputs, self.output_grads, self.then = [], [], [], [], []


def _accumulate(param: Tensor, grad: Tensor | None) -> None:
    if grad is None:
        return
    if param.grad is None:
        param.grad = grad.detach()
    else:
        param.grad = param.grad + grad.detach()


def _disjoint(found: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """torch's weight groups merged where they share a weight or an intermediate (a partition).

    torch's grouping can put a weight that joins the input's path at two nodes (a tied pair inside one chunk)
    into two groups, whose W would then count it twice. One group over everything would be exact too, but
    its W would walk the input's path from the top intermediate down to the lowest weight, running the
    input gradient's products again; separate groups each reach only the weights hanging from their own
    intermediates. Inside a merged group the clamping pre-hooks of ``WeightWork.run`` keep a descendant
    intermediate from adding its ancestors' contribution again."""
    groups: list[dict[str, Any]] = []
    for g in found:
        merged = {"params": set(g["params"]), "intermediates": set(g["intermediates"])}
        overlapping = [
            o for o in groups if o["params"] & merged["params"] or o["intermediates"] & merged["intermediates"]
        ]
        for other in overlapping:
            merged["params"] |= other["params"]
            merged["intermediates"] |= other["intermediates"]
            groups.remove(other)
        groups.append(merged)
    return groups


def backward_input(
    outputs: Sequence[Tensor], output_grads: Sequence[Tensor | None], inputs: Sequence[Tensor]
) -> tuple[list[Tensor | None], WeightWork]:
    """``I``: the gradients of ``inputs`` (leaves) given ``outputs`` and their gradients (``None``: a scalar
    loss, gradient one); the weights' gradients are left in the returned ``WeightWork`` for ``W``."""
    pairs = [(o, g) for o, g in zip(outputs, output_grads) if o.grad_fn is not None or o.requires_grad]
    outs = [o for o, _ in pairs]
    grads = [torch.ones_like(o) if g is None else g for o, g in pairs]
    work = WeightWork()
    if not outs:
        return [None] * len(inputs), work
    roots = [n for n in map(_node, outs) if n is not None]
    input_nodes = [n for n in map(_node, inputs) if n is not None]
    reverse = construct_reverse_graph(roots)
    reached = set(reverse) | set(roots)
    input_ids = set(input_nodes)
    weights = [n for n in reached if type(n).__name__ == "AccumulateGrad" and n not in input_ids]
    groups = _disjoint(get_param_groups(input_nodes, weights, reverse)) if input_nodes else []
    grouped = {w for g in groups for w in g["params"]}
    work.groups = groups
    work.orphans = [w.variable for w in weights if w not in grouped]
    handles = []
    for group in groups:
        group["intermediates"] = list(group["intermediates"])
        group["grads"] = [None] * len(group["intermediates"])
        for i, node in enumerate(group["intermediates"]):

            def keep(grad_outputs: tuple, group: dict = group, i: int = i) -> None:
                group["grads"][i] = grad_outputs

            handles.append(node.register_prehook(keep))
    try:
        wanted = [t for t in inputs if t.requires_grad]
        got = torch.autograd.grad(outs, wanted, grads, retain_graph=True, allow_unused=True) if wanted else ()
    finally:
        for h in handles:
            h.remove()
    by_id = {id(t): g for t, g in zip(wanted, got)}
    if work.orphans:
        work.outputs, work.output_grads = outs, grads
    else:
        for o in outs:  # the graph above the intermediates is not needed any more: let it go now
            try:
                o.detach_()
            except RuntimeError:  # a view cannot be detached in place; its graph goes with its last reference
                pass
    return [by_id.get(id(t)) for t in inputs], work
