"""Fail-closed verification: a transformed block must reproduce the block's own forward and gradients.

On the first real input, on copies of the block (the block itself is not touched), in float64 (through
flash-attention's semantics where the block's attention is flash-attention, :mod:`lightning_parallel.anatomy
.flash`; in float32 where another of its kernels has no float64 version; autocast off): the block's own forward
gives the reference output, input gradient and parameter gradients; the candidate (any transformed copy: a split,
a tensor- or sequence-parallel stack, chunked MLP, recomputation) runs on the same input with the same
output weighting, its gradients are brought to the single-process view with the algebra the strategies
use (partial sums reduced, shards gathered), and all are compared at ``rtol=1e-9, atol=1e-10`` (at 1e-5
of each tensor's largest element where the block computes in float32 on its own, e.g. a norm that casts
to float32: a different summation order is only float32-exact there). The verdict is agreed over the
given process groups, so every rank raises the same error or none does. With active dropout both copies
run in eval mode (random masks cannot match); the dropout paths are tested separately. A verdict holds for the
structure of the call it was reached on; a call of another structure is verified again (:class:`Verdicts`).
"""

from __future__ import annotations

import copy
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from lightning_parallel import _collectives, watchdog
from lightning_parallel.block_protocol import Shared
from lightning_parallel.errors import ConfigurationError, VerificationError
from lightning_parallel.expert_parallel import expert_parameters, over_replicas
from lightning_parallel.rng import has_dropout

TOLERANCE = dict(rtol=1e-9, atol=1e-10)
# a block that computes in float32 on its own (e.g. a norm that casts to float32) rounds at float32 precision
# whatever its input, so a different summation order is only float32-exact there: relative to the tensor's
# largest element (an element near zero carries the rounding of the large partial sums that produced it)
FLOAT32_TOLERANCE = dict(rtol=1e-5, atol=1e-5)


def _close(a: Tensor, b: Tensor, tolerance: dict) -> bool:
    """``a`` and ``b`` (each rank's part of a DTensor: both sides of an expert sharded over ep) agree."""
    a, b = (t.to_local() if isinstance(t, DTensor) else t for t in (a, b))
    if tolerance is FLOAT32_TOLERANCE:
        scale = float(b.abs().max()) if b.numel() else 0.0
        return torch.allclose(a, b, rtol=tolerance["rtol"], atol=tolerance["atol"] * max(scale, 1e-30))
    return torch.allclose(a, b, **tolerance)


@contextmanager
def without_forward(block: nn.Module) -> Iterator[None]:
    """Temporarily drop an instance ``forward`` (a runner) so that a deep copy is the plain block."""
    forward = block.__dict__.pop("forward", None)
    try:
        yield
    finally:
        if forward is not None:
            block.forward = forward


def float64_copy(block: nn.Module) -> nn.Module:
    with without_forward(block):
        return copy.deepcopy(block).double()


def stand_in_copy(block: nn.Module) -> nn.Module:
    """A float64 copy of ``block`` for tracing, holding no data (each parameter one element broadcast to its
    shape; a DTensor parameter its global shape), without the block layer's runner and chunked MLP."""
    from lightning_parallel.mlp_chunks import unchunk_mlps

    def empty(t: Tensor) -> Tensor:  # no memory: one element broadcast to the shape, on the tensor's device
        dtype = torch.float64 if t.is_floating_point() else t.dtype
        device = t.device if t.device.type != "meta" else torch.device("cpu")
        return torch.zeros((), dtype=dtype, device=device).expand(t.shape)

    memo: dict[int, Any] = {}
    for p in block.parameters():
        memo[id(p)] = nn.Parameter(empty(p), requires_grad=p.requires_grad)
    for b in block.buffers():
        memo[id(b)] = empty(b)
    with without_forward(block):
        copied = copy.deepcopy(block, memo)
    unchunk_mlps(copied)
    return copied


def first_tensor(out: Any) -> Tensor:
    return out if isinstance(out, Tensor) else out[0]


class _LowPrecision(TorchDispatchMode):
    """Records whether any op produced a floating tensor below float64 (the block casts down itself)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, Tensor) and t.is_floating_point() and t.dtype != torch.float64:
                self.seen = True
        return out


def _run(module: nn.Module, fn: Callable[..., Any], x: Tensor, args: tuple, kwargs: dict,
         probe: _LowPrecision | None = None) -> tuple[Tensor, Tensor]:  # fmt: skip
    xi = x.clone().requires_grad_(True)
    with torch.random.fork_rng(), probe if probe is not None else nullcontext():
        torch.manual_seed(0)
        out = first_tensor(fn(module, xi, args, kwargs))
        weight = torch.linspace(-1, 1, out.numel(), dtype=out.dtype, device=out.device).view_as(out)
        (out * weight).sum().backward()
    return out.detach(), xi.grad


def verify(
    block: nn.Module,
    x: Tensor,
    args: tuple,
    kwargs: dict,
    build: Callable[[nn.Module], tuple[Callable[..., Any], Callable[[nn.Module], dict[str, Tensor]]]],
    *,
    name: str,
    groups: Sequence[Any] = (),
    through: bool = False,
) -> None:
    """Check ``build`` against ``block``'s own forward; raise :class:`VerificationError` if they differ.
    ``through``: both in float64 through the block's own casts (:mod:`lightning_parallel.anatomy.wide`: a
    recurrent mixer's scan that sequence parallelism splits over ranks).

    ``build(copy)`` transforms a float64 copy of the block and returns ``(forward, gradients)``:
    ``forward(copy, x, args, kwargs)`` runs it, ``gradients(copy)`` returns its parameter gradients by name
    as one process would see them (a collective where the copy is sharded)."""
    with torch.autocast(x.device.type, enabled=False), not_captured():
        with _reference(block, x, args, kwargs, through) as ran:
            _compare(block, build, name, groups, *ran)


@contextmanager
def not_captured() -> Iterator[None]:
    """transformers' output capturing (a model's router logits, hidden states: forward hooks that append to the
    model call's collector) off while a block's copies run for verification or tracing: the model's own call
    would otherwise collect their outputs too (and a balancing loss backward through the copies' graphs)."""
    from lightning_parallel.anatomy.router_losses import uncounted

    capturing = sys.modules.get("transformers.utils.output_capturing")
    collector = getattr(capturing, "_active_collector", None)
    with uncounted():  # nor a pipeline's router sums
        if collector is None:
            yield
            return
        token = collector.set(None)
        try:
            yield
        finally:
            collector.reset(token)


@contextmanager
def _reference(block: nn.Module, x: Tensor, args: tuple, kwargs: dict, through: bool = False) -> Iterator[tuple]:
    """The reference run, in the widest dtype the block's kernels take: float64; for a block whose attention is
    flash-attention, float64 through its semantics (:mod:`lightning_parallel.anatomy.flash`, open while the
    candidate runs too); else float32. Yields ``(reference, candidate, inputs, output, input gradient, probe)``."""
    from lightning_parallel.anatomy.flash import stand_in
    from lightning_parallel.anatomy.wide import float64_through

    own = lambda m, xi, a, kw: type(m).forward(m, xi, *a, **kw)  # noqa: E731
    failure: RuntimeError | None = None
    wide = float64_through if through else nullcontext
    for dtype, swap in ((torch.float64, False), (torch.float64, True), (torch.float32, False)):
        with stand_in(block) if swap else nullcontext() as swapped, wide() if dtype == torch.float64 else nullcontext():
            if swap and not swapped:
                continue
            probe = _LowPrecision()
            inputs = _cast((x, args, kwargs), dtype)
            reference, candidate = (float64_copy(block).to(dtype) for _ in range(2))
            _same_mode(block, reference, candidate)
            try:
                out, grad = _run(reference, own, *inputs, probe)
            except RuntimeError as err:  # a kernel without this dtype (grouped matrix products, flash-attention)
                failure = err
                continue
            probe.seen |= dtype != torch.float64
            yield reference, candidate, inputs, out, grad, probe
            return
    assert failure is not None
    raise failure


def _compare(block: nn.Module, build: Callable[[nn.Module], tuple[Callable[..., Any], Callable[[nn.Module], dict]]],
             name: str, groups: Sequence[Any], reference: nn.Module, candidate: nn.Module, inputs: tuple,
             ref_out: Tensor, ref_grad: Tensor, probe: _LowPrecision) -> None:  # fmt: skip
    x64, a64, kw64 = inputs
    tolerance = FLOAT32_TOLERANCE if probe.seen else TOLERANCE
    ref_params = over_replicas(reference, {n: p.grad for n, p in reference.named_parameters() if p.grad is not None})
    problems: list[str] = []
    try:
        forward, gradients = build(candidate)
        out, grad = _run(candidate, forward, x64, a64, kw64)
        params = over_replicas(candidate, gradients(candidate))
    except ConfigurationError:
        raise
    except Exception as err:  # noqa: BLE001  (any other failure of a candidate is a reason to refuse it)
        what = f"it raised {type(err).__name__}: {err}"
        watchdog.note(f"{name} failed here: {what}")
    else:
        if out.shape != ref_out.shape or not _close(out, ref_out, tolerance):
            problems.append("output")
        if grad is None or ref_grad is None or not _close(grad, ref_grad, tolerance):
            problems.append("input gradient")
        problems += [
            f"gradient of {n}"
            for n in ref_params
            if n not in params or not _close(params[n].to(ref_params[n].dtype), ref_params[n], tolerance)
        ]
        what = f"{', '.join(problems[:4])} differ(s) from the block's own forward" if problems else ""
    failed_anywhere = any(_collectives.any_over_group([bool(what)], g)[0] for g in groups)
    if what or failed_anywhere:
        raise VerificationError(
            f"{name} does not reproduce {type(block).__name__}: {what or 'verification failed on another rank'}"
        )


def _same_mode(block: nn.Module, *copies: nn.Module) -> None:
    """Copies of a block whose dropout is active run in eval mode (the reference and the candidate draw no masks)."""
    if block.training and has_dropout(block):
        for c in copies:
            c.eval()


def _cast(value: Any, dtype: torch.dtype) -> Any:
    return tree_map(lambda t: t.detach().to(dtype) if isinstance(t, Tensor) and t.is_floating_point() else t, value)


def plain_gradients(module: nn.Module) -> dict[str, Tensor]:
    return {n: p.grad for n, p in module.named_parameters() if p.grad is not None}


def verify_split(split: Any, block: nn.Module, x: Tensor, args: tuple = (), kwargs: dict | None = None) -> None:
    """Check a :class:`~lightning_parallel.anatomy.Split` against ``block``'s own forward (see :func:`verify`)."""
    verify(block, x, args, kwargs or {}, lambda copy_: (split, plain_gradients), name=split.name)


def single_process_gradients(module: nn.Module, tp: Any = None, sp: Any = None) -> dict[str, Tensor]:
    """The gradients of a composed copy as one process would hold them, given its tensor- and sequence-parallel
    layouts: DTensor partial sums reduced, replicated parameters that saw a shard summed over their group,
    shards gathered whole (and un-permuted)."""
    grads: dict[str, Tensor] = {}
    partial_tp = {id(p) for p in (tp.partial if tp else [])}
    experts = {id(p) for _, p, _ in expert_parameters(module)}  # not summed over sp: its ranks hold other experts
    partial_sp = {id(p) for p in (sp.partial if sp else []) if id(p) not in experts}
    for name, p in module.named_parameters():
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor) and tuple(g.placements) != tuple(p.placements):
            g = g.redistribute(placements=p.placements)
        for layout, partial in ((tp, partial_tp), (sp, partial_sp)):
            if id(p) in partial:
                g = g.clone()
                _collectives.all_reduce_sum_([g.to_local() if isinstance(g, DTensor) else g], layout.mesh.get_group())
        if sp is not None and id(p) in experts:  # each sp rank ran one shard, the block the whole (over_replicas)
            g = g * sp.mesh.size()
        grads[name] = tp.to_full(name, g) if tp is not None else g
    return grads


# ------------------------------------------------------------------------------------ call structure
def call_structure(args: tuple, kwargs: dict) -> tuple:
    """What a verdict holds for, of one block call's arguments besides the hidden state: each argument's kind
    (a tensor's dtype and rank, ``None``, a flag's or a name's value, another object's type) and, where an
    attention function would take the documents of a packed row from ``position_ids`` (no attention mask given,
    as flash-attention's variable-length path does), whether they restart within a row. Shapes are not part of
    it (a shorter last batch is the same structure)."""
    mask = kwargs.get("attention_mask")
    leaves: list[Any] = []
    for value in (*args, *(kwargs[k] for k in sorted(kwargs))):
        if isinstance(value, Tensor):
            leaves.append(("tensor", value.dtype, value.dim()))
        elif value is None or isinstance(value, (bool, str)):
            leaves.append(value)
        else:  # a number or another object: its type (a value that changes per step is the same structure)
            leaves.append(type(value).__name__)
    position_ids = kwargs.get("position_ids")
    restarts = None
    if mask is None and isinstance(position_ids, Tensor) and position_ids.dim() >= 1 and position_ids.shape[-1] > 1:
        restarts = bool((position_ids[..., 1:] != position_ids[..., :-1] + 1).any())
    return tuple(sorted(kwargs)), tuple(leaves), restarts


def describe_structure(structure: tuple) -> str:
    names, leaves, restarts = structure
    documents = {None: "", True: "; position_ids restart (packed documents, no mask)",
                 False: "; position_ids do not restart (one document per row, no mask)"}[restarts]  # fmt: skip
    return f"keyword arguments {list(names)}, arguments {list(leaves)}{documents}"


class StructureChanged(VerificationError):
    """A block call of a structure its stack was not verified on, and on which the stack does not reproduce it."""


def skeleton(block: nn.Module) -> nn.Module:
    """A copy of ``block`` whose parameters are on ``meta`` (no memory; buffers kept), without a runner: what
    :class:`Verdicts` verifies later calls on, taken before the block is composed (sharded, chunked)."""
    memo: dict[int, Any] = {
        id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
        for p in block.parameters()
    }
    with without_forward(block):
        return copy.deepcopy(block, memo)


def synthetic(skeleton_: nn.Module, device: torch.device, seed: int) -> nn.Module:
    """``skeleton_`` with parameters of seeded values, the same on every rank: uniform in [-1, 1] over the square
    root of the fan-in for matrices, 1 +- 0.5 for vectors (norm weights, biases), so that every path of the block
    carries signal of order one; buffers as the block has them."""
    g = torch.Generator().manual_seed(seed)
    memo: dict[int, Any] = {}
    for p in skeleton_.parameters():
        if id(p) in memo:
            continue
        u = torch.rand(p.shape, generator=g, dtype=torch.float64) * 2 - 1
        values = u / math.sqrt(p.shape[-1]) if p.dim() > 1 else 1 + 0.5 * u
        values = values.to(p.dtype) if p.is_floating_point() else torch.zeros(p.shape, dtype=p.dtype)
        memo[id(p)] = nn.Parameter(values.to(device), requires_grad=p.requires_grad)
    block = copy.deepcopy(skeleton_, memo)
    for module in block.modules():
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = b.to(device)
    return block


class Verdicts(Shared):
    """The call structures (:func:`call_structure`) one composed block is known to reproduce the block on, and how
    to verify another. The first verdict is the one its stack was chosen by (the block's real parameters, its first
    call). A call of another structure (a row of packed documents after a row of one, a mask where there was
    none) is verified before it runs, by ``check(block, x, args, kwargs)`` (:func:`verify` with the committed
    anatomy's candidate, agreed over the tp and sp groups, whose members meet the same call together) on the
    block's :func:`skeleton` given :func:`synthetic` values and a seeded hidden state; the call runs if it
    passes, and is refused with :class:`StructureChanged` if not."""

    def __init__(self, block: nn.Module, args: tuple, kwargs: dict, what: str, seed: int,
                 check: Callable[[nn.Module, Tensor, tuple, dict], None]) -> None:  # fmt: skip
        self.first = call_structure(args, kwargs)
        self.known = {self.first}
        self.skeleton, self.what, self.seed, self.check = skeleton(block), what, seed, check

    def ensure(self, x: Tensor, args: tuple, kwargs: dict) -> None:
        """Verify the stack on a call of this structure unless it already was; raise if it does not reproduce."""
        now = call_structure(args, kwargs)
        if now in self.known:
            return
        device = x.device if x.device.type != "meta" else torch.device("cpu")
        g = torch.Generator().manual_seed(self.seed)
        hidden = torch.randn(x.shape, generator=g, dtype=torch.float64).to(device=device, dtype=x.dtype)
        args, kwargs = tree_map(lambda t: t.clone() if isinstance(t, Tensor) and t.is_inference() else t,
                                (args, kwargs))  # fmt: skip
        try:
            with torch.inference_mode(False), torch.enable_grad():
                self.check(synthetic(self.skeleton, device, self.seed), hidden, args, kwargs)
        except VerificationError as err:
            raise StructureChanged(
                f"{self.what} was verified on a call with {describe_structure(self.first)}, and is now called with"
                f" {describe_structure(now)}, on which its stack does not reproduce it ({err}). Make the first batch"
                " of the kind the run trains on (packed rows first, if any are packed), give the model an explicit"
                " attention mask (attn_implementation='sdpa' builds the document mask from position_ids), or train"
                " this model without splitting its blocks (pipeline, data parallelism)"
            ) from err
        self.known.add(now)
