"""Capture, then drive (docs/design.md, "Pipeline parallelism"): run the user's own step code around the trunk.

``capture`` runs the user's step for one micro-batch with every block standing in as a cheap recorder
that returns its hidden input unchanged. It records the trunk's input and the arguments each block is
called with (masks, RoPE tables, position ids; they may differ per block), and stops at the trunk's
last call with a private ``BaseException`` that user ``except Exception`` blocks cannot swallow.

``substitute`` re-enters the user's step on the loss stage with the trunk's output put in place of the
last block's result, so the user's post-trunk code, loss and logging run unchanged.

Neither keeps per-micro-batch state in module hooks: the runtime calls the local blocks itself with
the captured arguments, so recomputation (which re-runs a block's forward during backward, possibly
after other micro-batches ran) always sees that block's own saved inputs.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_parallel import _collectives
from lightning_parallel.errors import ConfigurationError, TrunkCallError
from lightning_parallel.trunk import Trunk

BlockArgs = tuple[tuple[Any, ...], dict[str, Any]]


class _TrunkExit(BaseException):
    """Raised by the last block's recorder to abandon the rest of the user's step."""


NONE_RETURNED = (
    "training_step returned None: on one device Lightning skips that batch, but a pipeline runs all the micro-batches"
    " of a batch through one schedule and cannot skip one of them; leave the batch out in the data (or return the"
    " loss times 0 to train on nothing)"
)


class NotCarried:
    """Stands, in what the pipeline's stand-in blocks return, for a block output other than the hidden state
    (a position bias, cached keys): pipeline stages pass only the hidden state from block to block."""

    def __init__(self, index: int) -> None:
        self.index = index

    def __repr__(self) -> str:
        return f"<output {self.index} of a block, not carried between pipeline stages>"

    def __getattr__(self, name: str) -> Any:
        raise ConfigurationError(
            f"the step reads {name!r} of output {self.index} of a trunk block; pipelined training carries only"
            " a block's hidden state (output 0) between stages; use a strategy that keeps the trunk whole"
            " (tensor_parallel, sequence_parallel, hybrid)"
        )


def structure_of(output: Any) -> Any:
    """``None`` for a tensor output, else a tuple/list of the same length: ``None`` where the block returned
    ``None``, a :class:`NotCarried` where it returned anything else (its hidden state first)."""
    if not isinstance(output, (tuple, list)):
        return None
    return type(output)([None, *(None if o is None else NotCarried(k) for k, o in enumerate(output) if k > 0)])


def refuse_not_carried(trunk: Trunk, j: int, args: tuple, kwargs: dict) -> None:
    """Refuse block ``j``'s call if an argument is another block's output that stages do not carry (T5's
    position bias, computed by its first layer and passed on to every later one)."""
    from torch.utils._pytree import tree_flatten

    named = [(f"positional argument {k + 1}", a) for k, a in enumerate(args)] + list(kwargs.items())
    for name, value in named:
        if any(isinstance(leaf, NotCarried) for leaf in tree_flatten(value)[0]):
            raise ConfigurationError(
                f"block {j} of trunk {trunk.path!r} ({type(trunk.blocks[j]).__name__}) takes as {name} what an"
                f" earlier block returned besides its hidden state ({value!r}); the stages of a pipeline (pipeline,"
                " helix) carry only the hidden state from block to block, so this model cannot be pipelined; use"
                " tensor_parallel, sequence_parallel or hybrid, which keep the trunk whole"
            )


@dataclass
class Capture:
    """What one micro-batch's step passed to the trunk."""

    trunk_input: Tensor
    block_args: list[BlockArgs]

    @property
    def needs_grad(self) -> bool:
        """Whether any captured block argument carries an autograd graph (e.g. positions from parameters)."""
        leaves = [a for args, kwargs in self.block_args for a in (*args, *kwargs.values())]
        return any(isinstance(a, Tensor) and a.requires_grad for a in leaves)


def split_hidden(trunk: Trunk, args: tuple, kwargs: dict) -> tuple[Tensor, BlockArgs]:
    """Separate the hidden state (first positional, or passed by name) from the other block arguments."""
    if args:
        return args[0], (args[1:], kwargs)
    kwargs = dict(kwargs)
    if trunk.hidden_name not in kwargs:
        raise TrunkCallError(f"a block of {trunk.path!r} was called without its hidden state {trunk.hidden_name!r}")
    return kwargs.pop(trunk.hidden_name), ((), kwargs)


def wrap_output(hidden: Tensor, like: Any) -> Any:
    """Shape ``hidden`` like a block's output: a tensor, or a tuple/list with the hidden state first."""
    if isinstance(like, (tuple, list)):
        return type(like)([hidden, *like[1:]])
    return hidden


def unwrap_output(output: Any, block: nn.Module) -> Tensor:
    if isinstance(output, Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], Tensor):
        return output[0]
    raise TrunkCallError(
        f"{type(block).__name__} returned {type(output).__name__}; pipelining needs a tensor or a tuple whose"
        " first element is the hidden state"
    )


@contextmanager
def _forwards(
    blocks: list[nn.Module], make: Callable[[int, nn.Module], Callable[..., Any]], hooks: bool = True
) -> Iterator[None]:
    """Temporarily replace each block's ``forward`` (an instance attribute; the class is untouched). With
    ``hooks=False`` the blocks' forward hooks are suspended too: a recorder or a pass-through computes
    nothing, so neither FSDP's parameter gathering nor a user's hook should see it. The replacements run
    eagerly where the user compiled the block (``torch.compile`` of the layer): they are no part of its graph."""
    saved = [b.__dict__.get("forward") for b in blocks]
    hooked = [(b._forward_pre_hooks, b._forward_hooks) for b in blocks]
    for j, b in enumerate(blocks):
        b.forward = torch._dynamo.disable(make(j, b))
        if not hooks:
            b._forward_pre_hooks, b._forward_hooks = OrderedDict(), OrderedDict()
    try:
        yield
    finally:
        for b, old, (pre, post) in zip(blocks, saved, hooked):
            b._forward_pre_hooks, b._forward_hooks = pre, post
            if old is None:
                del b.forward
            else:
                b.forward = old


def capture(
    trunk: Trunk, step: Callable[[], Any], output_like: Any, probe: Callable[[], nn.Module] | None
) -> tuple[Capture, Any]:
    """Run ``step`` up to the trunk's last block call; return what the trunk was given and the blocks' output
    structure: ``output_like``, or where ``probe`` is given (it makes a block whose parameters are on meta),
    learned at the first block's call from ``probe()`` called on meta tensors (:func:`probe_output_structure`),
    so that user code indexing a block's output (``layer(h)[0]``, ``h, bias = layer(h, bias)``) sees its
    structure. An argument that is another block's output other than its hidden state is refused
    (:func:`refuse_not_carried`)."""
    n = len(trunk)
    args: list[BlockArgs | None] = [None] * n
    state: dict[str, Any] = {"next": 0, "input": None, "last_out": None, "like": output_like}

    def make(j: int, block: nn.Module) -> Callable[..., Any]:
        def record(*a: Any, **kw: Any) -> Any:
            hidden, rest = split_hidden(trunk, a, kw)
            if j != state["next"]:
                raise TrunkCallError(
                    f"block {j} of trunk {trunk.path!r} was called when block {state['next']} was expected; "
                    "pipelining needs every block called once per trunk pass, in order"
                )
            if j == 0:
                state["input"] = hidden = _collectives.settled(hidden)
                if probe is not None:
                    state["like"] = probe_output_structure(probe(), hidden, rest, state["like"])
            elif not _same_tensor(hidden, state["last_out"]):
                raise TrunkCallError(
                    f"block {j} of trunk {trunk.path!r} did not receive block {j - 1}'s output as its hidden state;"
                    " pipelining needs the hidden state passed directly from block to block"
                )
            refuse_not_carried(trunk, j, *rest)
            args[j] = rest
            state["next"] = j + 1
            if j == n - 1:
                raise _TrunkExit
            state["last_out"] = hidden
            return wrap_output(hidden, state["like"])

        return record

    with _forwards(trunk.blocks, make, hooks=False):
        try:
            out = step()
        except _TrunkExit:
            pass
        else:
            if out is None:
                raise TrunkCallError(NONE_RETURNED)
            raise TrunkCallError(
                f"the step returned after calling {state['next']} of the {n} blocks of trunk {trunk.path!r}"
            )
    return Capture(trunk_input=state["input"], block_args=args), state["like"]  # type: ignore[arg-type]


def substitute(trunk: Trunk, step: Callable[[], Any], trunk_output: Any) -> Any:
    """Run ``step`` with the blocks as pass-throughs and the last one returning ``trunk_output``."""
    n = len(trunk)
    passes = [0]

    def make(j: int, block: nn.Module) -> Callable[..., Any]:
        def passthrough(*a: Any, **kw: Any) -> Any:
            hidden, _ = split_hidden(trunk, a, kw)
            if j == 0:
                _collectives.settled(hidden)  # (dropped: the trunk's output replaces what the blocks would make of it)
                passes[0] += 1
                if passes[0] > 1:
                    raise TrunkCallError(
                        f"the training step called trunk {trunk.path!r} more than once; pipelined training supports"
                        " exactly one trunk pass per step (validation, test and predict support any number)"
                    )
            return trunk_output if j == n - 1 else wrap_output(hidden, trunk_output)

        return passthrough

    with _forwards(trunk.blocks, make, hooks=False):
        return step()


def loss_of(output: Any) -> Tensor:
    """The loss in a ``training_step``'s output: the tensor itself, or a dict's ``"loss"``."""
    if isinstance(output, Tensor):
        return output
    if output is None:
        raise ValueError(NONE_RETURNED)
    if isinstance(output, dict) and isinstance(output.get("loss"), Tensor):
        return output["loss"]
    raise ValueError(
        f"training_step must return the loss (a tensor or a dict with 'loss'); got {type(output).__name__}"
    )


def _same_tensor(a: Any, b: Any) -> bool:
    return isinstance(a, Tensor) and isinstance(b, Tensor) and a.shape == b.shape and a.data_ptr() == b.data_ptr()


def probe_output_structure(block: nn.Module, hidden: Tensor, block_args: BlockArgs, default: Any = None) -> Any:
    """The output structure (:func:`structure_of`) of ``block`` (its meta copy, where its parameters are real;
    the module a ``torch.compile`` wrapper holds), from a call on ``meta`` tensors; ``default`` where the block
    cannot run on meta (a kernel with no meta version)."""
    from torch.utils._pytree import tree_map

    block = getattr(block, "_orig_mod", block)
    if any(not t.is_meta for t in (*block.parameters(), *block.buffers())):
        block = copy.deepcopy(block).to("meta")
    to_meta = lambda x: x.to("meta") if isinstance(x, Tensor) else x  # noqa: E731
    a, kw = tree_map(to_meta, block_args)  # nested too (e.g. rotary tables as a tuple)
    from lightning_parallel.anatomy.verify import not_captured

    try:  # (its router logits on meta are no part of the model's call: not collected)
        with torch.no_grad(), not_captured():
            # the class's own forward: the instance's may be replaced by a recorder right now
            out = type(block).forward(block, to_meta(hidden), *a, **kw)
    except Exception:  # noqa: BLE001  (the structure stays unknown: user code indexing the output then fails)
        return default
    return structure_of(out)
