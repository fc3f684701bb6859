"""The block layer: one explicit composition per trunk block (:mod:`lightning_parallel.stack`), built once from
the block's anatomy, the mesh and the policies, verified, then committed.

A :class:`BlockRunner` is the block's forward (an instance attribute: the class is untouched, module
hooks still fire). On its first call with a real input it resolves the block's anatomy where a feature
needs one (:mod:`lightning_parallel.anatomy`: ``adapter=``, the hand-written adapters, Hugging Face
metadata, the traced graph, in that order; the first that verifies wins), composes the stack on copies and
verifies it against the block's own forward (float64, first real input), and only then commits it to the block
(:meth:`BlockLayer.install_runner`: shards its parameters, replaces them in the optimizers). HelixPipe's runtime
calls a block's split parts itself: :meth:`BlockLayer.commit` resolves, verifies and commits it the same way.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_parallel.anatomy import resolve
from lightning_parallel.anatomy.verify import Verdicts, single_process_gradients, verify
from lightning_parallel.recompute import Policy, resolve_op
from lightning_parallel.stack import BlockConfig, Layouts, compose
from lightning_parallel.trunk import discover_trunk, prepare_model


# ------------------------------------------------------------------------------------------ runner
class BlockRunner:
    """The forward of one trunk block under this rank's stack (see the module docstring)."""

    def __init__(self, layer: BlockLayer | None, index: int, block: nn.Module) -> None:
        self.layer, self.index, self.block = layer, index, block
        self.stack: Callable[..., Any] | None = None
        self.anatomy_name: str | None = None
        self.verdicts: Verdicts | None = None  # the call structures the stack is verified on (None: no anatomy)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        x, rest, kw = _split_hidden(self.block, args, kwargs, self.layer.hidden_name if self.layer else None)
        if self.stack is None:
            assert self.layer is not None
            self.layer.install_runner(self, x, rest, kw)
        elif self.verdicts is not None:
            self.verdicts.ensure(x, rest, kw)
        assert self.stack is not None
        return self.stack(self.block, x, rest, kw)

    def __deepcopy__(self, memo: dict) -> BlockRunner:
        """A copy of the block runs the copy: the stack holds no module, only the runner does."""
        block = memo.get(id(self.block), self.block)
        layer = self.layer
        if self.stack is None and layer is not None:  # a pending copy resolves on its own, changing no optimizer
            layer = BlockLayer(layer.trunk, layer.config, Layouts.for_config(layer.config))
        new = BlockRunner(layer, self.index, block)
        new.stack, new.anatomy_name, new.verdicts = self.stack, self.anatomy_name, self.verdicts
        return new


def _split_hidden(block: nn.Module, args: tuple, kwargs: dict, name: str | None) -> tuple[Tensor, tuple, dict]:
    if args:
        return args[0], args[1:], kwargs
    if name is None:
        import inspect

        name = list(inspect.signature(type(block).forward).parameters)[1]
    kwargs = dict(kwargs)
    if name not in kwargs:
        raise TypeError(f"{type(block).__name__} was called without its hidden state {name!r}")
    return kwargs.pop(name), (), kwargs


@dataclass
class BlockLayer:
    """The composed blocks of one trunk on this rank, and what their commits changed."""

    trunk: Any
    config: BlockConfig
    layouts: Layouts = field(default_factory=Layouts)
    on_replace: Callable[[list[tuple[nn.Parameter, nn.Parameter, str]]], None] | None = None
    """Called at commit with ``(old parameter, new parameter, full name)`` of each replaced parameter."""
    before_commit: Callable[[nn.Module], None] | None = None
    """Called with a block just before its stack is resolved and committed (a deferred block materialises)."""
    runners: dict[int, BlockRunner] = field(default_factory=dict)
    winner: str | None = None  # the source of anatomy the first block verified with (the others try it first)
    proven: set[tuple] = field(default_factory=set)  # (source, fingerprint) of the blocks verified so far
    compiled_forwards: dict[int, Any] = field(default_factory=dict)  # index -> its wrapper's compiled forward

    @property
    def hidden_name(self) -> str | None:
        return self.trunk.hidden_name if self.trunk is not None else None

    def install(self, blocks: Iterable[tuple[int, nn.Module]]) -> BlockLayer:
        """Make each ``(index, block)`` run through a pending :class:`BlockRunner`. A block compiled in the model
        (``torch.compile(block)``: the trunk's wrappers) is called by its wrapper eagerly, so the runner composes
        it (splits, shards, recomputes); :meth:`compiled` compiles the composed block again where sound."""
        wrappers = self.trunk.wrappers if self.trunk is not None else ()
        for index, block in blocks:
            runner = BlockRunner(self, index, block)
            block.forward = runner
            self.runners[index] = runner
            if wrappers:
                self.compiled_forwards.setdefault(index, wrappers[index].forward)
                wrappers[index].forward = block.__call__
        return self

    def uninstall(self) -> None:
        for runner in self.runners.values():
            if runner.block.__dict__.get("forward") is runner:
                del runner.block.forward
        for index, forward in self.compiled_forwards.items():  # the wrappers compile their blocks again
            self.trunk.wrappers[index].forward = forward
        self.runners, self.compiled_forwards = {}, {}

    def prefix(self, index: int) -> str:
        if self.trunk is None:
            return ""
        name = list(dict(self.trunk.container.named_children()))[index]
        return f"{self.trunk.path}.{name}.{self.trunk.inner}"

    def compiled(self, index: int, stack: Callable[..., Any]) -> Callable[..., Any]:
        """``stack`` compiled with the user's ``torch.compile`` of block ``index`` (its backend and options: the
        trunk's blocks were compiled in the model, :func:`lightning_parallel.trunk.discover_trunk`), where the
        layout keeps the block whole and local (:meth:`BlockConfig.not_compiled_because`); else ``stack`` itself,
        eager, said once. One compiled function serves every block (dynamo takes a module's parameters as inputs)."""
        wrappers = self.trunk.wrappers if self.trunk is not None else ()
        if not wrappers:
            return stack
        assert self.trunk is not None
        reason = self.config.not_compiled_because()
        if reason is not None:
            _say_eager_once(self.trunk.path, reason)
            return stack

        def run(block: nn.Module, x: Tensor, args: tuple, kwargs: dict) -> Any:
            return stack(block, x, args, kwargs)

        return wrappers[index].dynamo_ctx(run)  # type: ignore[no-any-return]

    def groups(self) -> list[Any]:
        return [m.get_group() for m in (self.config.tp_mesh, self.config.sp_mesh) if m is not None and m.size() > 1]

    # ------------------------------------------------------------------------------ commit
    def commit_all(self, x: Tensor, block_args: list[tuple[tuple, dict]]) -> None:
        """Resolve, verify and commit every runner not committed yet, in block order, each on ``x`` (the trunk's
        input: verification needs a real hidden state of the right shape, any block's) with its block's own
        captured arguments. Used where something must see every block's final parameters before the first step
        (FSDP2 over tensor-parallel shards)."""
        for index in sorted(self.runners):
            runner = self.runners[index]
            if runner.stack is None:
                args, kwargs = block_args[index]
                self.install_runner(runner, x, args, kwargs)

    def commit(self, index: int, block: nn.Module, x: Tensor, args: tuple, kwargs: dict) -> BlockRunner:
        """Resolve, verify and commit block ``index`` on ``(x, args, kwargs)`` now, without making the runner the
        block's forward: HelixPipe's runtime calls the parts of ``runner.stack`` (a split) itself."""
        runner = BlockRunner(self, index, block)
        self.install_runner(runner, x, args, kwargs)
        return runner

    def install_runner(self, runner: BlockRunner, x: Tensor, args: tuple, kwargs: dict) -> None:
        """Resolve, verify and commit ``runner``'s stack on its first real input (the block materialised first:
        :attr:`before_commit`)."""
        block, config = runner.block, self.config
        if self.before_commit is not None:
            self.before_commit(block)
        if not config.needs_anatomy:
            runner.stack = self.compiled(runner.index, compose(block, runner.index, None, config, self.layouts))
            return
        with torch.inference_mode(False), torch.enable_grad():
            sample = _normal((x, args, kwargs))
            build = lambda anatomy: self._candidate(runner.index, anatomy)  # noqa: E731
            self.winner, anatomy = resolve.first_verified(block, sample, config, self.winner, build, self.groups(),
                                                          self.proven)  # fmt: skip
            through = resolve.chains(block, config)
            check = lambda b, x_, a, kw: verify(b, x_, a, kw, build(anatomy), name=anatomy.name,  # noqa: E731
                                                groups=self.groups(), through=through)  # fmt: skip
            what = f"block {runner.index} ({type(block).__name__})"
            runner.verdicts = Verdicts(block, args, kwargs, what, runner.index, check)
            self._commit(runner, anatomy)

    def _candidate(self, index: int, anatomy: Any) -> Callable[[nn.Module], tuple[Any, Any]]:
        config = self.config

        def build(copy_: nn.Module) -> tuple[Any, Any]:
            layouts = Layouts.for_config(config)
            stack = compose(copy_, index, anatomy, config, layouts)
            gradients = lambda m: single_process_gradients(m, layouts.tp, layouts.sp)  # noqa: E731
            return (lambda m, x, a, kw: stack(m, x, a, kw)), gradients

        return build

    def _commit(self, runner: BlockRunner, anatomy: Any) -> None:
        block = runner.block
        before = dict(block.named_parameters())
        stack = compose(block, runner.index, anatomy, self.config, self.layouts, self.prefix(runner.index))
        runner.stack = self.compiled(runner.index, stack)
        runner.anatomy_name = anatomy.name
        after = dict(block.named_parameters())
        prefix = self.prefix(runner.index)
        replaced = [(before[n], after[n], f"{prefix}{n}") for n in before if n in after and after[n] is not before[n]]
        if replaced and self.on_replace is not None:
            self.on_replace(replaced)


def _normal(value: Any) -> Any:
    """Inference-mode tensors (a first call under ``trainer.validate``) as normal tensors for autograd."""
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.clone() if isinstance(t, Tensor) and t.is_inference() else t, value)


def uninstall_runners(blocks: Iterable[nn.Module]) -> None:
    """Remove block runners (and the MLP chunking they installed) from ``blocks``."""
    from lightning_parallel.mlp_chunks import unchunk_mlps

    for block in blocks:
        if isinstance(block.__dict__.get("forward"), BlockRunner):
            del block.forward
        unchunk_mlps(block)


def parallelize(module: nn.Module, config: BlockConfig, *, trunk: str | None = None) -> BlockLayer:
    """Compose every trunk block of ``module`` under ``config`` (in place; no Lightning needed): the blocks
    resolve, verify and commit their stacks on their first call. Returns the layer (its ``layouts`` hold
    what gradients and checkpoints need)."""
    found = discover_trunk(module, trunk)
    uninstall_runners(found.blocks)
    prepare_model(module)
    return BlockLayer(found, config, Layouts.for_config(config)).install(enumerate(found.blocks))


def apply_recompute(
    module: nn.Module,
    policy: Policy = "full",
    *,
    every_n: int = 2,
    mlp_chunks: int = 1,
    trunk: str | None = None,
    mlp_module: str | None = None,
    attention_kernels: tuple[str, ...] = (),
    split_backward: bool = False,
) -> nn.Module:
    """Run each trunk block of ``module`` under the recomputation ``policy`` (and chunk its MLP); in place.

    ``attention_kernels`` names further ops (``"namespace::op"`` or ``"namespace::op.overload"``) that
    ``no_attention`` and ``selective`` must keep, for blocks whose attention runs a custom kernel. The
    blocks get the block layer's runners (:mod:`lightning_parallel.blocks`); with ``mlp_chunks > 1`` the
    MLP is found by the block's anatomy on the first call (and verified). ``split_backward=True``: the
    backward will run as an input-gradient and a weight-gradient call (a zero-bubble schedule, this
    package's or torch's): recomputation runs once and serves both (:func:`shared_checkpoint`). Works
    without Lightning. Re-applying replaces the previous wrapping. Returns ``module``.
    """
    extra = tuple(attention_kernels)
    config = BlockConfig(
        recompute=policy,
        every_n=every_n,
        mlp_chunks=mlp_chunks,
        mlp_module=mlp_module,
        attention_kernels=extra,
        split_backward=split_backward,
    )  # fmt: skip  (validated here)
    for name in extra:
        resolve_op(name)  # fail now, not at the first step
    found = discover_trunk(module, trunk)
    uninstall_runners(found.blocks)
    BlockLayer(found, config).install(enumerate(found.blocks))
    return module


__all__ = [
    "BlockConfig",
    "apply_recompute",
    "BlockLayer",
    "BlockRunner",
    "Layouts",
    "compose",
    "parallelize",
    "uninstall_runners",
]


@functools.cache  # said once per trunk and reason
def _say_eager_once(path: str, reason: str) -> None:
    from lightning.pytorch.utilities import rank_zero_warn

    rank_zero_warn(
        f"the blocks of trunk {path!r} were compiled with torch.compile; under {reason} the strategy runs them"
        " eagerly (the rest of the model stays compiled; a layout that keeps blocks whole, pipeline or data"
        " parallelism without recomputation, compiles them again). Their parameters keep their names"
        " ('_orig_mod.'), so checkpoints load into the compiled model"
    )
