"""Anatomy of any block, from its own forward traced on the first real input (``torch.export``, the
sequence length symbolic; :mod:`.program`), with no hand-written knowledge of its family:

- :mod:`.analysis` finds the attention call, the head counts, which dimension of the hidden state is the
  sequence, the arguments that carry it and the positions the block creates over it;
- :mod:`.sequence` distributes the attention call and localises those positions (sequence parallelism);
- :mod:`.tensor` derives the tensor-parallel plan from data flow (projections feeding q, k, v column-wise,
  the one consuming the attention output row-wise, MLP in/out pairs) and localises the graph's
  head-count-dependent shapes;
- :mod:`.regions` finds the MLP by data flow (chunked MLP) and cuts the graph at its attention call
  into pre / attention / post (HelixPipe).

The result is a graph program per block; the block layer verifies it against the block's own forward
like every other source of anatomy.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_parallel.anatomy.traced.analysis import Site, analyse
from lightning_parallel.anatomy.traced.program import Program, trace
from lightning_parallel.block_protocol import Shared, Split
from lightning_parallel.errors import Unsupported


def anatomy_of(block: nn.Module, sample: tuple[Tensor, tuple, dict], config: Any) -> TracedAnatomy:
    x, args, kwargs = sample
    if config.tp_sequence_parallel:
        raise Unsupported("tp_sequence_parallel=True is served by hand-written adapters only")
    if config.tp > 1 and config.tp_plan is not None and not config.split:
        raise Unsupported(
            "a user's tp_plan= is applied through an adapter or the block's own forward, not a traced graph (under"
            " HelixPipe, a traced graph takes a tp_plan= equal to the plan it derives)"
        )
    return TracedAnatomy(trace(block, x, args, kwargs), type(block).__name__)


class TracedAnatomy(Shared):
    """One block's traced program and what it shows; see the package docstring."""

    family_level = False
    name = "the traced graph"

    def __init__(self, program: Program, block_name: str, tracer: Any = trace) -> None:
        self.program, self.block_name, self.tracer = program, block_name, tracer  # tracer: to trace it again

    @cached_property
    def _site(self) -> Site | Unsupported:
        try:
            return analyse(self.program)
        except Unsupported as reason:
            return reason

    @property
    def site(self) -> Site:
        site = self._site
        if isinstance(site, Unsupported):
            raise site
        return site

    def heads(self, block: nn.Module) -> tuple[int, int]:
        return self.site.heads, self.site.kv_heads

    def sequence_dim(self, block: nn.Module) -> int:
        return self.site.seq_dim

    def sequence_args(self, block: nn.Module, args: tuple, kwargs: dict, index: Tensor) -> tuple[tuple, dict]:
        """The arguments that carry the sequence (by the trace's symbols), at this rank's positions."""
        leaves, spec = tree_flatten(((None, *args), kwargs))
        sliced, tensor = [], 0
        for leaf in leaves:
            if isinstance(leaf, Tensor):
                tensor += 1
                for dim in self.site.sequence_inputs.get(tensor, ()):
                    leaf = leaf.index_select(dim, index)
            sliced.append(leaf)
        (_, *new_args), new_kwargs = tree_unflatten(sliced, spec)
        return tuple(new_args), new_kwargs

    def attention_mask(self, block: nn.Module, args: tuple, kwargs: dict) -> Tensor | None:
        """``None``: a traced graph may compute its mask from the arguments; ring mode then keeps the zig-zag
        split (exact under any mask; only balanced for causal attention)."""
        return None

    def local_forward(self, block: nn.Module, config: Any, tp_layout: Any, prefix: str) -> GraphForward:
        plan = None
        if config.tp > 1:
            from lightning_parallel.anatomy.traced.tensor import derive, shard

            plan = derive(self.program, config.tp)
            shard(block, plan, config.tp_mesh, tp_layout, prefix)
        recipe = _Recipe(self.program, config, plan, self.block_name, self.tracer)
        return GraphForward(recipe, {self.program.training: recipe.transform(self.program)})

    def helix_split(self, block: nn.Module, config: Any, tp_layout: Any = None, prefix: str = "",
                    wanted: tuple[str, dict[str, str]] | None = None) -> Split:  # fmt: skip
        """The graph cut at its attention call (HelixPipe); under ``config.tp > 1`` the block's parameters are
        sharded by the plan derived from the graph and the graph is localised to the shards first, so the
        parts run on this rank's heads (Megatron's f and g inside ``pre`` and ``post``). ``wanted``: a plan the
        user or the model gave (its name, module -> ``"colwise"`` / ``"rowwise"``), which the derived one must
        equal on the modules it names (:func:`~lightning_parallel.anatomy.traced.tensor.check_wanted`)."""
        from lightning_parallel.anatomy.traced.regions import split

        program, site = self.program, self.site
        if config.tp > 1:
            from lightning_parallel.anatomy.traced.tensor import check_wanted, derive, localise, shard

            plan = derive(program, config.tp)
            if wanted is None and config.tp_plan:
                from lightning_parallel.tensor_parallel import expand_plan

                wanted = ("tp_plan=", expand_plan(block, dict(config.tp_plan)))
            if wanted is not None:
                check_wanted(plan, *wanted, type(block).__name__)
            shard(block, plan, config.tp_mesh, tp_layout, prefix)
            program = localise(program, config.tp_mesh, plan)
            site = analyse(program)
        return split(program, site, config, self.block_name)


class _Recipe(Shared):
    """The transforms a block's program goes through for this rank's configuration, re-applicable to the
    block traced again (in the other mode: evaluation after training)."""

    def __init__(self, program: Program, config: Any, plan: Any, block_name: str, tracer: Any = trace) -> None:
        self.program, self.config, self.plan, self.block_name, self.tracer = program, config, plan, block_name, tracer

    def transform(self, program: Program) -> Program:
        from lightning_parallel.anatomy.traced.sequence import sequence_parallel

        config = self.config
        site = analyse(program) if config.sp > 1 else None
        if config.tp > 1:
            from lightning_parallel.anatomy.traced.tensor import localise

            program = localise(program, config.tp_mesh, self.plan)
        if config.mlp_chunks > 1:
            from lightning_parallel.anatomy.traced.regions import chunk_mlp

            program = chunk_mlp(program, config.mlp_chunks, self.block_name, config.mlp_module)
        if site is not None:
            program = sequence_parallel(program, analyse(program))
        return program

    def traced_in(self, block: nn.Module, training: bool) -> Program:
        """The block traced again with its mode set to ``training`` (on the first trace's stand-in arguments)."""
        (x, *args), kwargs = tree_unflatten(self.program.leaves, self.program.spec)
        mode = block.training
        try:
            block.train(training)
            return self.transform(self.tracer(block, x, tuple(args), kwargs))
        finally:
            block.train(mode)


class GraphForward(Shared):
    """A transformed program as the block's inner forward: retargeted to the call's dtype and device, and
    traced again (same transforms) the first time the block runs in the other mode."""

    def __init__(self, recipe: _Recipe, programs: dict[bool, Program]) -> None:
        self.recipe, self.programs = recipe, programs
        self._targets: dict[tuple[bool, torch.dtype, torch.device], Program] = {}

    def __call__(self, block: nn.Module, x: Tensor, args: tuple, kwargs: dict, shard: Any = None) -> Any:
        mode = block.training
        if mode not in self.programs:
            with torch.inference_mode(False):
                self.programs[mode] = self.recipe.traced_in(block, mode)
        key = (mode, x.dtype, x.device)
        program = self._targets.get(key)
        if program is None:
            program = self._targets[key] = self.programs[mode].retargeted(x.dtype, x.device)
        return program(block, x, args, kwargs, *((shard,) if self.recipe.config.sp > 1 else ()))
