"""The LM head and its cross-entropy in chunks of tokens, never holding the whole logits.

An unchanged model computes ``logits = lm_head(h)``, of ``tokens x vocabulary`` values (T=32k, V=128k: 16 GiB
in float32), and ``F.cross_entropy(logits.view(-1, V), targets)`` then holds as much again for its gradient.
The loss needs none of it whole: per token it is ``logsumexp(z) - z[target]`` with ``z = h W^T + b``, and the
gradient ``softmax(z) - onehot(target)`` can be formed chunk by chunk and multiplied into the gradients of ``h``
and ``W`` at once (the idea of Liger-Kernel's fused linear cross-entropy, Hsu et al., arXiv 2410.10989, and of
torchtune's chunked loss). This module does it for modules that do not know about it:

- :func:`lazy_heads` makes each head module return :class:`LazyLogits` for the duration of a step: a tensor of
  the logits' shape, dtype and device that holds no values, only the head's input rows and its weight. The
  step's own code then reshapes it (``view``, ``reshape``, ``flatten``, ``float()``, ``contiguous()``, slices of
  its leading dimensions such as Hugging Face's and nanoGPT's shift ``[:, :-1]``), each applied to the rows;
- ``F.cross_entropy`` on it (class dimension last, no class weights or label smoothing; ``mean``, ``sum``; any
  ``ignore_index``) runs :class:`_ChunkedCrossEntropy`: forward and backward over ``chunks`` slices of the rows,
  recomputing each slice's logits in the backward (one matmul more per slice, the price of the memory);
- anything else done with it (an accuracy from ``argmax``, logging the logits) computes the whole logits there
  and goes on exactly as without this module (said once, as a warning: memory is then not saved).

Under tensor parallelism the head is vocabulary-parallel (each tp rank holds V/tp rows of the weight: Megatron-
LM's parallel cross-entropy, Shoeybi et al., arXiv 1909.08053): a slice's maximum, sum of exponentials and
target logit are all-reduced over the tp group, and its input gradient summed there; nobody gathers logits.

Exact against the whole-logits loss up to the summation order of the softmax (float64: 1e-12; float32: 1e-6).
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard
from torch.utils._pytree import tree_map

from lightning_parallel import _collectives

_RESHAPES = {Tensor.view, Tensor.reshape, torch.reshape, Tensor.flatten, torch.flatten}
_SAME = {Tensor.contiguous, Tensor.clone}
_CASTS = {Tensor.float, Tensor.double, Tensor.half, Tensor.bfloat16, Tensor.to, Tensor.type_as}
_METADATA = {Tensor.size, Tensor.dim, Tensor.numel, Tensor.__len__, Tensor.shape.__get__,  # type: ignore[attr-defined]
             Tensor.dtype.__get__, Tensor.device.__get__, Tensor.ndim.__get__,  # type: ignore[attr-defined]
             Tensor.requires_grad.__get__, Tensor.is_floating_point}  # type: ignore[attr-defined]  # fmt: skip


class LazyLogits(Tensor):
    """The logits ``(rows @ weight^T + bias).view(*lead, V).to(dtype)`` of a head, not computed (module
    docstring). ``rows``: ``(N, H)``, with their autograd graph. Under tensor parallelism ``weight`` is this
    rank's ``(V/tp, H)`` shard from vocabulary row ``start`` of ``vocab``, and ``mesh`` the tp mesh."""

    rows: Tensor
    weight: Tensor
    bias: Tensor | None
    chunks: int
    mesh: Any
    start: int
    vocab: int

    @staticmethod
    def __new__(cls, rows: Tensor, weight: Tensor, bias: Tensor | None, lead: tuple[int, ...], dtype: torch.dtype,
                chunks: int, mesh: Any = None, start: int = 0, vocab: int | None = None) -> LazyLogits:  # fmt: skip
        vocab = weight.shape[0] if vocab is None else vocab
        out = Tensor._make_wrapper_subclass(cls, (*lead, vocab), dtype=dtype, device=rows.device)
        out.rows, out.weight, out.bias, out.chunks = rows, weight, bias, chunks
        out.mesh, out.start, out.vocab = mesh, start, vocab
        return out

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # noqa: D105
        return f"LazyLogits(shape={tuple(self.shape)}, dtype={self.dtype}, chunks={self.chunks})"

    def _like(self, rows: Tensor, lead: tuple[int, ...], dtype: torch.dtype | None = None) -> LazyLogits:
        return LazyLogits(rows, self.weight, self.bias, lead, dtype or self.dtype, self.chunks, self.mesh,
                          self.start, self.vocab)  # fmt: skip

    @property
    def lead(self) -> tuple[int, ...]:
        return tuple(self.shape[:-1])

    def materialize(self) -> Tensor:
        """The whole logits, as the head would have returned them (then cast and reshaped like this tensor)."""
        z = F.linear(self.rows, self.weight, self.bias)
        if self.mesh is not None:  # this rank's vocabulary columns -> all of them (all-gather, with autograd)
            z = DTensor.from_local(z, self.mesh, [Shard(1)], run_check=False).full_tensor()
        return z.view(*self.lead, self.vocab).to(self.dtype)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if args and isinstance(args[0], LazyLogits):
            out = args[0]._transformed(func, args[1:], kwargs)
            if out is not None:
                return out
        if func is F.cross_entropy:
            out = _cross_entropy(*args, **kwargs)
            if out is not None:
                return out
        name = getattr(func, "__qualname__", None) or getattr(func, "__name__", str(func))
        warnings.warn(f"loss_chunks: {name} uses the LM head's whole logits, so they are computed whole here (the"
                      " result is exact; the memory is not saved)", stacklevel=2)  # fmt: skip
        real = lambda t: t.materialize() if isinstance(t, LazyLogits) else t  # noqa: E731
        return func(*tree_map(real, args), **tree_map(real, kwargs))

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        """Every use is handled (or materialised) at the Python level above; nothing reaches the kernels."""
        raise RuntimeError(f"loss_chunks: {func} reached the LM head's uncomputed logits")

    def _transformed(self, func: Any, args: tuple, kwargs: dict) -> LazyLogits | None:
        """This tensor after a reshape, cast or slice that keeps the vocabulary as the last dimension."""
        if func in _SAME:
            return self
        if func in _CASTS:
            dtype = _cast_dtype(func, args, kwargs)
            return None if dtype is None else self._like(self.rows, self.lead, dtype)
        if func in _RESHAPES:
            shape = _target_shape(func, self, args, kwargs)
            if shape is None or shape[-1] != self.vocab:
                return None
            return self._like(self.rows, tuple(shape[:-1]))
        if func is Tensor.__getitem__:
            index = args[0] if isinstance(args[0], tuple) else (args[0],)
            if not _keeps_last(index, self.dim()):
                return None
            rows = self.rows.view(*self.lead, self.rows.shape[-1])[index]
            return self._like(rows.reshape(-1, rows.shape[-1]), tuple(rows.shape[:-1]))
        return None


def _cast_dtype(func: Any, args: tuple, kwargs: dict) -> torch.dtype | None:
    simple = {Tensor.float: torch.float32, Tensor.double: torch.float64, Tensor.half: torch.float16,
              Tensor.bfloat16: torch.bfloat16}  # fmt: skip
    if func in simple:
        return simple[func]
    if func is Tensor.type_as:
        return args[0].dtype
    dtypes = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.dtype)]
    others = [a for a in (*args, *kwargs.values()) if not isinstance(a, (torch.dtype, bool))]
    return dtypes[0] if len(dtypes) == 1 and not others else None  # .to(dtype) only, not to a device


def _target_shape(func: Any, lazy: LazyLogits, args: tuple, kwargs: dict) -> list[int] | None:
    shape = list(lazy.shape)
    if func in (Tensor.flatten, torch.flatten):
        start = kwargs.get("start_dim", args[0] if args else 0)
        end = kwargs.get("end_dim", args[1] if len(args) > 1 else -1)
        start, end = start % len(shape), end % len(shape)
        flat = 1
        for n in shape[start : end + 1]:
            flat *= n
        return shape[:start] + [flat] + shape[end + 1 :]
    sizes = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) else args
    if func is torch.reshape:
        sizes = args[0]
    if not all(isinstance(n, int) for n in sizes):
        return None
    sizes = list(sizes)
    if sizes.count(-1) == 1:
        known = 1
        for n in sizes:
            known *= n if n != -1 else 1
        sizes[sizes.index(-1)] = lazy.numel() // known
    return sizes


def _keeps_last(index: tuple, ndim: int) -> bool:
    """Whether ``index`` leaves the last (vocabulary) dimension whole: it indexes leading dimensions only."""
    if any(i is None or isinstance(i, (Tensor, list)) for i in index):
        return False
    if Ellipsis in index:
        after = index[index.index(Ellipsis) + 1 :]
        return not after or after[-1] == slice(None)
    return len(index) < ndim or index[-1] == slice(None)


def _cross_entropy(input: Any, target: Tensor, weight: Tensor | None = None, size_average: Any = None,
                   ignore_index: int = -100, reduce: Any = None, reduction: str = "mean",
                   label_smoothing: float = 0.0) -> Tensor | None:  # fmt: skip
    """``F.cross_entropy`` of :class:`LazyLogits` over ``(N, V)`` rows, or ``None`` (then computed whole)."""
    if not isinstance(input, LazyLogits) or input.dim() != 2 or target.dim() != 1 or target.is_floating_point():
        return None
    if weight is not None or label_smoothing or size_average is not None or reduce is not None:
        return None
    if reduction not in ("mean", "sum"):
        return None
    group = input.mesh.get_group() if input.mesh is not None else None
    statics = (input.dtype, input.chunks, group, input.start, ignore_index, reduction)
    return _ChunkedCrossEntropy.apply(input.rows, input.weight, input.bias, target, *statics)


class _ChunkedCrossEntropy(torch.autograd.Function):
    """``F.cross_entropy(rows @ W^T + b, target)`` over slices of the rows (module docstring); under a tp group,
    ``W`` holds the vocabulary rows ``[start, start + W.shape[0])`` and the softmax's statistics are all-reduced."""

    @staticmethod
    def forward(ctx: Any, rows: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, dtype: torch.dtype,
                chunks: int, group: Any, start: int, ignore_index: int, reduction: str) -> Tensor:  # fmt: skip
        # the softmax's statistics in at least float32, as F.cross_entropy keeps them (under autocast it takes
        # low-precision logits to float32 and returns float32); the logits themselves rounded as the head gives them
        acc, device = torch.promote_types(dtype, torch.float32), rows.device.type
        autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        valid = target != ignore_index
        lse = torch.empty(rows.shape[0], dtype=acc, device=rows.device)
        total = torch.zeros((), dtype=acc, device=rows.device)
        for sl in _slices(rows.shape[0], chunks):
            z = F.linear(rows[sl], weight, bias).to(dtype).to(acc)
            m = z.amax(-1)
            if group is not None:
                _collectives.all_reduce_max_(m, group)
            s = (z - m.unsqueeze(-1)).exp_().sum(-1)
            t = _target_logit(z, target[sl], start, ignore_index)
            if group is not None:
                _collectives.all_reduce_sum_([s, t], group)
            lse[sl] = m + s.log()
            total += ((lse[sl] - t) * valid[sl]).sum()
        ctx.save_for_backward(rows, weight, bias, target, lse)
        ctx.count = valid.sum() if reduction == "mean" else None
        ctx.statics = (dtype, chunks, group, start, ignore_index, autocast)
        out = total / ctx.count if reduction == "mean" else total
        return out if autocast[1] else out.to(dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
        rows, weight, bias, target, lse = ctx.saved_tensors
        dtype, chunks, group, start, ignore_index, (device, enabled, autocast_dtype) = ctx.statics
        g = (grad / ctx.count if ctx.count is not None else grad).to(lse.dtype)
        grad_rows = torch.empty_like(rows) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        grad_bias = torch.zeros_like(bias) if bias is not None and ctx.needs_input_grad[2] else None
        # the products under the forward's autocast state: the same logits, and the same precision as the head's
        # own backward would use
        with torch.autocast(device, dtype=autocast_dtype, enabled=enabled):
            for sl in _slices(rows.shape[0], chunks):
                logits = F.linear(rows[sl], weight, bias).to(dtype)  # the slice's logits again, then in place:
                p = logits.to(lse.dtype).sub_(lse[sl].unsqueeze(-1)).exp_()  # the softmax, from the log-sum-exp
                local, valid = target[sl] - start, target[sl] != ignore_index
                hit = valid & (local >= 0) & (local < p.shape[-1])
                p[hit, local[hit]] -= 1.0
                dz = p.mul_(valid.unsqueeze(-1) * g).to(rows.dtype)
                if grad_rows is not None:
                    grad_rows[sl] = dz @ weight
                    if group is not None:  # this rank's vocabulary columns' part of the input gradient
                        _collectives.all_reduce_sum_([grad_rows[sl]], group)
                if grad_weight is not None:
                    grad_weight += dz.t() @ rows[sl]
                if grad_bias is not None:
                    grad_bias += dz.sum(0)
        return grad_rows, grad_weight, grad_bias, *([None] * 7)


def _target_logit(z: Tensor, target: Tensor, start: int, ignore_index: int) -> Tensor:
    """``z[i, target[i]]`` where this rank holds that vocabulary row, else 0 (summed over tp by the caller)."""
    local = target - start
    hit = (target != ignore_index) & (local >= 0) & (local < z.shape[-1])
    picked = z.gather(-1, local.clamp(0, z.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    return torch.where(hit, picked, torch.zeros((), dtype=z.dtype, device=z.device))


def _slices(n: int, chunks: int) -> Iterator[slice]:
    size = -(-n // max(1, chunks))
    for begin in range(0, n, max(1, size)):
        yield slice(begin, min(n, begin + size))


# ------------------------------------------------------------------------------------------ the heads
class _LazyHead:
    """A head module's forward while :func:`lazy_heads` is active: its input rows and weight as LazyLogits."""

    def __init__(self, head: nn.Linear, chunks: int) -> None:
        self.head, self.chunks, self.calls = head, chunks, 0

    def __call__(self, x: Tensor) -> LazyLogits:
        self.calls += 1
        weight, bias = self.head.weight, self.head.bias
        mesh, start, vocab = None, 0, None
        if isinstance(weight, DTensor):  # vocabulary-parallel (tensor parallelism): this rank's rows
            mesh, vocab, start = weight.device_mesh, weight.shape[0], _shard_start(weight)
            weight = weight.to_local()
            bias = bias.to_local() if isinstance(bias, DTensor) else bias
        dtype = F.linear(x[..., :0, :], weight, bias).dtype  # what the head returns here (autocast included)
        rows = x.reshape(-1, x.shape[-1])
        return LazyLogits(rows, weight, bias, tuple(x.shape[:-1]), dtype, self.chunks, mesh, start, vocab)


def _shard_start(weight: DTensor) -> int:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, weight.placements)
    return int(offset[0])


@contextmanager
def lazy_heads(heads: list[nn.Linear], chunks: int) -> Iterator[list[_LazyHead]]:
    """While active, each of ``heads`` returns :class:`LazyLogits` (yields their forwards, which count their
    calls); their module hooks are suspended (under tensor parallelism they would gather the logits)."""
    saved = [(h.__dict__.get("forward"), h._forward_pre_hooks, h._forward_hooks) for h in heads]
    forwards = [_LazyHead(h, chunks) for h in heads]
    for h, forward in zip(heads, forwards):
        h.forward = forward
        h._forward_pre_hooks, h._forward_hooks = OrderedDict(), OrderedDict()
    try:
        yield forwards
    finally:
        for h, (forward, pre, post) in zip(heads, saved):
            h._forward_pre_hooks, h._forward_hooks = pre, post
            if forward is None:
                del h.forward
            else:
                h.forward = forward


__all__ = ["LazyLogits", "lazy_heads"]
