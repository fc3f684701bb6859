"""The block layer: one explicit composition per trunk block, built once from the block's anatomy, the
mesh and the policies, and verified after the whole stack is installed.

A :class:`BlockRunner` is the block's forward (an instance attribute: the class is untouched, module
hooks still fire). On its first call with a real input it resolves the block's anatomy where a feature
needs one (:mod:`lightning_parallel.anatomy`: ``adapter=``, the hand-written adapters, Hugging Face
metadata, the traced graph, in that order; the first that verifies wins), composes the stack, verifies
it, and only then commits it to the block (shards its parameters, replaces them in the optimizers).
The stack, innermost first:

1. **tensor parallelism**: parameters sharded per the anatomy's plan, and the forward that runs on
   the shards (the block's own, a hand-written split forward, or the traced graph localised); dropout on
   its sharded activations draws from this tp rank's stream (:mod:`lightning_parallel.rng`);
2. **chunked MLP**: inside that forward (the MLP over sequence slices);
3. **sequence parallelism**: the block's tokens scattered on entry and gathered on exit, its
   sequence-carrying arguments sliced, its attention core distributed (Ulysses or ring); or, inside
   tensor parallelism, Megatron-style sequence sharding between the projections;
4. **recomputation**: outermost, so that under tensor or sequence parallelism its policies keep the
   outputs of the collectives of 1-3 instead of running them again;
5. **verification** of the whole stack against the block's own forward (float64, first real input).

Pipeline placement comes before all of it (a rank composes only the blocks it runs); data parallelism
after (gradients). Nothing links the layers but this composition: no attributes on modules.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_parallel.anatomy import resolve
from lightning_parallel.anatomy.verify import Verdicts, single_process_gradients, verify
from lightning_parallel.block_protocol import OwnForward
from lightning_parallel.errors import ConfigurationError, Unsupported
from lightning_parallel.recompute import Policy, Recomputed, resolve_op, validate
from lightning_parallel.rng import tensor_parallel_rng, tensor_parallel_split
from lightning_parallel.sequence_parallel import (
    SequenceParallelLayout,
    SequenceShard,
    SplitOverSequence,
    check_heads,
    shard_dropout,
)
from lightning_parallel.tensor_parallel import TensorParallelLayout

Forward = Callable[..., Any]  # (block, x, args, kwargs, shard) -> output


@dataclass(frozen=True, kw_only=True)
class BlockConfig:
    """What this rank applies to each trunk block it runs."""

    tp_mesh: DeviceMesh | None = None
    """1-D mesh of the tensor-parallel group (``None``: no tensor parallelism)."""
    tp_plan: Mapping[str, str] | None = None
    """A user plan (``{"name pattern inside a block": style}``), replacing the anatomy's."""
    tp_sequence_parallel: bool = False
    """Megatron-style sequence sharding of norms, residuals and dropout between the projections."""
    sp_mesh: DeviceMesh | None = None
    """1-D mesh of the sequence-parallel group (``None``: no sequence parallelism)."""
    sp_mode: str = "ulysses"
    recompute: str = "none"
    every_n: int = 2
    mlp_chunks: int = 1
    offload: bool = False
    """``recompute_offload``: what the recomputation policy keeps waits in host memory (lightning_parallel.offload)."""
    mlp_module: str | None = None
    """Path of the MLP inside a block, where the anatomy does not find it."""
    attention_kernels: tuple[str, ...] = ()
    adapter: Any = None
    """``adapter=``: a hand-written adapter's name or an object implementing the adapter protocol."""
    split: bool = False
    """HelixPipe: each block is cut at its attention call (the helix runtime drives the parts)."""
    split_backward: bool = False
    """A zero-bubble schedule runs the backward as two calls (input, then weight gradients): recomputation
    must serve both (``recompute.shared_checkpoint``)."""
    sources: tuple[str, ...] | None = None
    """The sources of anatomy tried after ``adapter=``, in order; ``None``: all of
    :data:`lightning_parallel.anatomy.resolve.SOURCES` (tests narrow them, e.g. without the hand-written adapters)."""

    @property
    def tp(self) -> int:
        return self.tp_mesh.size() if self.tp_mesh is not None else 1

    @property
    def sp(self) -> int:
        return self.sp_mesh.size() if self.sp_mesh is not None else 1

    @property
    def needs_anatomy(self) -> bool:
        return self.split or self.tp > 1 or self.sp > 1 or self.mlp_chunks > 1

    @property
    def communicates(self) -> bool:
        return self.tp > 1 or self.sp > 1

    def not_compiled_because(self) -> str | None:
        """Why a composed block is not compiled again as a whole, or ``None``: its stack communicates inside (dynamo
        would cut the graph at every collective, or trace them into functional collectives the stack does not wait
        on), is driven in parts (HelixPipe, the zero-bubble split backward) or wraps autograd itself."""
        reasons = {
            f"tensor parallelism (tp={self.tp})": self.tp > 1,
            f"sequence parallelism (sp={self.sp})": self.sp > 1,
            "HelixPipe's split at the attention call": self.split,
            "the zero-bubble schedule's split backward": self.split_backward,
            f"recompute={self.recompute!r}": self.recompute != "none",
            "recompute_offload": self.offload,
            f"mlp_chunks={self.mlp_chunks}": self.mlp_chunks > 1,
        }
        return ", ".join(r for r, on in reasons.items() if on) or None


@dataclass
class Layouts:
    """What the committed stacks sharded, for gradients and checkpoints (filled at commit)."""

    tp: TensorParallelLayout | None = None
    sp: SequenceParallelLayout | None = None

    @classmethod
    def for_config(cls, config: BlockConfig) -> Layouts:
        tp = TensorParallelLayout(config.tp_mesh) if config.tp > 1 else None
        sp = SequenceParallelLayout(config.sp_mesh, config.sp_mode) if config.sp > 1 else None
        return cls(tp, sp)


# ---------------------------------------------------------------------------------------- the stack
class _SequenceParallel:
    """Step 3: this rank's tokens in, the whole sequence out; the inner forward distributes attention."""

    def __init__(self, inner: Forward, anatomy: Any, mesh: DeviceMesh, mode: str) -> None:
        self.inner, self.anatomy, self.mesh, self.mode = inner, anatomy, mesh, mode

    def __call__(self, block: nn.Module, x: Tensor, args: tuple, kwargs: dict) -> Any:
        dim = self.anatomy.sequence_dim(block)
        mask = self.anatomy.attention_mask(block, args, kwargs) if self.mode == "ring" else None
        shard = SequenceShard.of(self.mesh, self.mode, x.shape[dim], x.device, mask)
        local_args, local_kwargs = self.anatomy.sequence_args(block, args, kwargs, shard.index)
        mine = shard.scatter(x, dim)
        with shard_dropout(block, self.mesh, x.device):  # each rank's tokens their own dropout masks
            out = self.inner(block, mine, local_args, local_kwargs, shard)
        return _map_first(out, lambda y: shard.gather(y, dim))

    def __deepcopy__(self, memo: dict) -> _SequenceParallel:
        return self


class _TokenShard:
    """Step 3 inside tensor parallelism (Korthikanti et al., arXiv 2205.05198): the block holds 1/tp of the
    tokens between its projections; it takes its slice on entry and all-gathers its output on exit."""

    def __init__(self, inner: Forward, mesh: DeviceMesh) -> None:
        self.inner, self.mesh = inner, mesh

    def __call__(self, block: nn.Module, x: Tensor, args: tuple, kwargs: dict) -> Any:
        tp, T = self.mesh.size(), x.shape[1]
        if T % tp:
            raise ConfigurationError(
                f"tp_sequence_parallel=True needs the sequence length ({T}) to be divisible by"
                f" tensor_parallel_size ({tp}); pad the batch or turn tp_sequence_parallel off"
            )
        shard = SequenceShard.of(self.mesh, "ulysses", T, x.device)
        with shard_dropout(block, self.mesh, x.device):  # all of it sharded (tokens, heads): this rank's masks
            out = self.inner(block, shard.scatter(x, 1), args, kwargs, None)
        return _map_first(out, lambda y: shard.gather(y, 1))

    def __deepcopy__(self, memo: dict) -> _TokenShard:
        return self


class _TensorParallelRNG:
    """Inside step 1: the block's call is a scope of :func:`lightning_parallel.rng.tensor_parallel_rng`, so that
    dropout on sharded activations (attention heads, the MLP's hidden layer) draws from this tp rank's stream
    and dropout on replicated ones from the default generator, the same on every tp rank."""

    def __init__(self, inner: Forward, mesh: DeviceMesh) -> None:
        self.inner, self.mesh = inner, mesh

    def __call__(self, block: nn.Module, x: Tensor, args: tuple, kwargs: dict, shard: Any = None) -> Any:
        with tensor_parallel_rng(block, self.mesh, x.device):
            return self.inner(block, x, args, kwargs, shard)

    def __deepcopy__(self, memo: dict) -> _TensorParallelRNG:
        return self


class _Plain:
    """No sequence split: the inner forward with ``shard=None``."""

    def __init__(self, inner: Forward) -> None:
        self.inner = inner

    def __call__(self, block: nn.Module, x: Tensor, args: tuple, kwargs: dict) -> Any:
        return self.inner(block, x, args, kwargs, None)

    def __deepcopy__(self, memo: dict) -> _Plain:
        return self


class _SavedToHost:
    """Step 4 without recomputation, with ``offload``: everything the block saves for its backward waits in host
    memory (:func:`lightning_parallel.offload.saved_to_host`)."""

    def __init__(self, inner: Callable[..., Any]) -> None:
        self.inner = inner

    def __call__(self, block: nn.Module, x: Tensor, args: tuple, kwargs: dict) -> Any:
        from lightning_parallel.offload import saved_to_host

        with saved_to_host():
            return self.inner(block, x, args, kwargs)

    def __deepcopy__(self, memo: dict) -> _SavedToHost:
        return self


def _map_first(out: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    if isinstance(out, Tensor):
        return fn(out)
    return type(out)([fn(out[0]), *out[1:]])


def compose(block: nn.Module, index: int, anatomy: Any, config: BlockConfig, layouts: Layouts,
            prefix: str = "") -> Callable[[nn.Module, Tensor, tuple, dict], Any]:  # fmt: skip
    """Apply ``config`` to ``block`` (in place: parameters sharded, MLP chunked) and return its forward
    ``(block, x, args, kwargs)``, in the order of the module docstring; under HelixPipe (``config.split``) the
    block's :class:`~lightning_parallel.block_protocol.Split`, which is also such a forward. ``anatomy`` is
    ``None`` when no feature needs one (recomputation alone)."""
    if config.split:
        return _split(block, anatomy, config, layouts, prefix)
    if anatomy is None:
        inner: Forward = OwnForward()
    else:  # steps 1 and 2, in the anatomy's own way
        inner = anatomy.local_forward(block, config, layouts.tp, prefix)
        if config.tp > 1 and not config.tp_sequence_parallel:  # (Megatron's sequence parallelism: _TokenShard)
            inner = _TensorParallelRNG(inner, config.tp_mesh)
    if config.sp > 1:
        heads = anatomy.heads(block)
        check_heads(*heads, config.sp, config.sp_mode, type(block).__name__, config.tp)
        stack: Any = _SequenceParallel(inner, anatomy, config.sp_mesh, config.sp_mode)
        if layouts.sp is not None:
            layouts.sp.partial += list(block.parameters())
    elif config.tp_sequence_parallel and config.tp > 1:
        stack = _TokenShard(inner, config.tp_mesh)
    else:
        stack = _Plain(inner)
    policy = config.recompute
    if policy == "every_n":
        policy = "full" if index % config.every_n == 0 else "none"
    if policy != "none":
        extra = frozenset(resolve_op(name) for name in config.attention_kernels)
        stack = Recomputed(
            stack,
            policy,
            type(block).__name__,
            extra,
            keep_communication=config.communicates,
            shared=config.split_backward,
            offload=config.offload,
        )
    elif config.offload:
        stack = _SavedToHost(stack)
    return stack


def _split(block: nn.Module, anatomy: Any, config: BlockConfig, layouts: Layouts, prefix: str) -> Any:
    """HelixPipe (Zhang et al., arXiv 2507.00394, §2.1): ``block`` cut at its attention call, the parts run by the
    helix runtime. Step 1 happens inside the anatomy's split (the block sharded, the parts on this rank's heads,
    their dropout from the tp rank's stream); step 3 wraps the parts (:class:`SplitOverSequence`). Helix recomputes
    inside its runtime, so step 4 is not applied."""
    split = anatomy.helix_split(block, config, layouts.tp, prefix)
    if config.tp > 1:
        split = tensor_parallel_split(split, config.tp_mesh)
    if config.sp == 1:
        return split
    if split.carried:
        raise Unsupported(
            f"its attention call takes {split.carried} parameter(s) besides q, k, v (learned sinks), which"
            " HelixPipe carries to the attention stage but not through sequence parallelism's attention;"
            " helix without sequence_parallel_size, or sequence parallelism (Ulysses or ring) alone, trains it"
        )
    check_heads(*anatomy.heads(block), config.sp, config.sp_mode, type(block).__name__, config.tp)
    if layouts.sp is not None:
        layouts.sp.partial += list(block.parameters())
    return SplitOverSequence(split, anatomy, config.sp_mesh, config.sp_mode)


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
    runners: dict[int, BlockRunner] = field(default_factory=dict)
    winner: str | None = None  # the source of anatomy the first block verified with (the others try it first)
    proven: set[tuple] = field(default_factory=set)  # (source, fingerprint) of the blocks verified so far
    compiled_forwards: dict[int, Any] = field(default_factory=dict)  # index -> its wrapper's compiled forward

    def __post_init__(self) -> None:
        validate(self.config.recompute, self.config.every_n, self.config.mlp_chunks, self.config.offload)

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
    def commit_all(
        self, x: Tensor, block_args: list[tuple[tuple, dict]], before: Callable[[nn.Module], None] | None = None
    ) -> None:
        """Resolve, verify and commit every runner not committed yet, in block order, each on ``x`` (the trunk's
        input: verification needs a real hidden state of the right shape, any block's) with its block's own
        captured arguments; ``before(block)`` runs first (a deferred block materialises). Used where something
        must see every block's final parameters before the first step (FSDP2 over tensor-parallel shards)."""
        for index in sorted(self.runners):
            runner = self.runners[index]
            if runner.stack is None:
                if before is not None:
                    before(runner.block)
                args, kwargs = block_args[index]
                self.install_runner(runner, x, args, kwargs)

    def commit(self, index: int, block: nn.Module, x: Tensor, args: tuple, kwargs: dict) -> BlockRunner:
        """Resolve, verify and commit block ``index`` on ``(x, args, kwargs)`` now, without making the runner the
        block's forward: HelixPipe's runtime calls the parts of ``runner.stack`` (a split) itself."""
        runner = BlockRunner(self, index, block)
        self.install_runner(runner, x, args, kwargs)
        return runner

    def install_runner(self, runner: BlockRunner, x: Tensor, args: tuple, kwargs: dict) -> None:
        """Resolve, verify and commit ``runner``'s stack on its first real input."""
        block, config = runner.block, self.config
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
    from lightning_parallel.anatomy.families import prepare_model
    from lightning_parallel.trunk import discover_trunk

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
    from lightning_parallel.trunk import discover_trunk

    validate(policy, every_n, mlp_chunks)
    extra = tuple(attention_kernels)
    for name in extra:
        resolve_op(name)  # fail now, not at the first step
    found = discover_trunk(module, trunk)
    uninstall_runners(found.blocks)
    config = BlockConfig(recompute=policy, every_n=every_n, mlp_chunks=mlp_chunks, mlp_module=mlp_module,
                         attention_kernels=extra, split_backward=split_backward)  # fmt: skip
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
