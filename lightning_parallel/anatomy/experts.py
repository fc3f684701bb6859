"""Which modules of a model are a mixture's experts (family knowledge, with the anatomy; expert parallelism's
mechanism, a floor below, is :mod:`lightning_parallel.expert_parallel`, which knows how each shape is called and
which parameters it stacks).

Two shapes are recognised, by structure rather than by class name:

- *stacked experts*: a module with an int ``num_experts`` and parameters stacked by expert (dim 0 of that size),
  called either as ``experts(hidden (N, H), top_k_index (N, k), top_k_weights (N, k))`` after the model's own
  router chose each token's experts (transformers 5's mixtures: Mixtral, Qwen2/3-MoE, DeepSeek-V3, GPT-OSS, which
  names them ``router_indices``, ``routing_weights``), or, dense, as ``experts(rows)`` on ``num_experts`` equal
  blocks of rows, block e for expert e (Llama 4: every token to each expert, scaled by its score);
- *a home-written mixture*: a module with an ``nn.ModuleList`` child of ``E >= 2`` experts of one class and one
  parameter layout, and a router ``nn.Linear`` with ``E`` outputs among its other children, its own loop calling
  ``experts[e](rows)``.
"""

from __future__ import annotations

import inspect

from torch import nn

from lightning_parallel.expert_parallel import ExpertParallelForward, is_dense, stacked


def find_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's stacked experts modules (module docstring), those sharded already by expert parallelism
    (their count is then their local experts') included."""
    found = []
    for name, module in model.named_modules():
        count = getattr(module, "num_experts", None)
        if not isinstance(count, int):
            continue
        if isinstance(module.__dict__.get("forward"), ExpertParallelForward) or _routed(module) or is_dense(module):
            found.append((name, module))
    return found


def _routed(module: nn.Module) -> bool:
    """Called as ``experts(hidden, top_k_index, top_k_weights)``."""
    params = list(inspect.signature(type(module).forward).parameters)[1:]
    routed = len(params) >= 3 and "ind" in params[1] and "weight" in params[2]
    return routed and bool(stacked(module, module.num_experts))


def find_expert_lists(model: nn.Module) -> list[tuple[str, nn.Module, nn.ModuleList]]:
    """The model's home-written mixtures (module docstring): ``(name, mixture, its experts)``, those cut already
    by expert parallelism included."""
    found = []
    for name, module in model.named_modules():
        for child in module.children():
            if isinstance(child, nn.ModuleList) and len(child) >= 2 and _alike(child):
                routers = [c for c in module.children() if isinstance(c, nn.Linear) and c.out_features == len(child)]
                if routers:
                    found.append((name, module, child))
    return found


def _alike(experts: nn.ModuleList) -> bool:
    layouts = {(type(e), tuple((n, tuple(p.shape)) for n, p in e.named_parameters())) for e in experts}
    return len(layouts) == 1 and bool(next(iter(layouts))[1])


__all__ = ["find_expert_lists", "find_experts"]
