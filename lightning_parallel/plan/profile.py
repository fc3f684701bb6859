"""Measure a model's own costs on the local device, fitted in the sequence length so they extrapolate.

For each length T of a short list (the user's batch cropped along dim 1), one micro-batch is captured
through the user's own ``training_step`` (``pipeline.capture``: the trunk input and each block's
arguments), and trunk block 0 runs forward, input-gradient (I) and weight-gradient (W) backward under a
dispatch-mode timer that splits every op's time into *attention* (the fused attention kernels that
``recompute`` keeps, forward and backward) and the rest, the rest into before and after the attention
call (HelixPipe's ``pre`` and ``post``). Per recomputation policy it also records the bytes the block
keeps for its backward (``memory.kept_for_backward``) and the recomputed forward's time. The post-trunk
code and loss (head) is timed forward and backward with the trunk output substituted.

Fits: attention time ``a + b T + c T^2`` (its work is quadratic in T), everything else and all bytes
``a + b T`` (least squares over the lengths). With two lengths the quadratic term is left out.
"""

from __future__ import annotations

import copy
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_parallel.memory import kept_for_backward
from lightning_parallel.pipeline.capture import (
    Capture,
    TrunkCallError,
    capture,
    loss_of,
    probe_output_structure,
    substitute,
    unwrap_output,
)
from lightning_parallel.pipeline.split_backward import backward_input
from lightning_parallel.recompute import POLICIES, apply_recompute, attention_ops
from lightning_parallel.trunk import Trunk, discover_trunk


def _attention_names() -> set[str]:
    """The fused attention kernels, forward and backward, by op name without overload."""
    names = {str(op.name()).split(".")[0] for op in attention_ops()}
    return names | {n + "_backward" for n in names}


class _Timer(TorchDispatchMode):
    """Seconds per op class: ``attention`` and, around it, ``pre`` (ops before the first attention op
    of the region) and ``post`` (after it)."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds = {"pre": 0.0, "attention": 0.0, "post": 0.0}
        self.seen_attention = False
        self._attention = _attention_names()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        t0 = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        dt = time.perf_counter() - t0
        if str(func.name()).split(".")[0] in self._attention:
            self.seconds["attention"] += dt
            self.seen_attention = True
        else:
            self.seconds["post" if self.seen_attention else "pre"] += dt
        return out


@dataclass
class Sample:
    """One length's measurements for one block (seconds; bytes)."""

    seq_len: int
    forward: dict[str, float]  # pre / attention / post
    input_grad: dict[str, float]  # the I action, split as above (its "pre" is the post-attention part: reversed)
    weight_grad: float  # the W action
    kept: dict[str, int]  # bytes kept for backward per policy
    recompute: dict[str, float]  # seconds of the recomputed forward per policy
    head_forward: float
    head_backward: float
    message: int  # bytes of the hidden state between blocks
    dtype_bytes: int
    split_bytes: int  # what I keeps for W beyond the forward's saved tensors (gradients at the intermediates)
    capture: float  # seconds to capture one micro-batch (the user's step up to the trunk)


@dataclass
class Fit:
    """``value(T) = sum(coef[i] * T**i)``, fitted by least squares."""

    coef: list[float]

    def __call__(self, seq_len: float) -> float:
        return max(0.0, sum(c * seq_len**i for i, c in enumerate(self.coef)))


def fit(xs: list[int], ys: list[float], degree: int) -> Fit:
    degree = min(degree, len(xs) - 1)
    a = torch.tensor([[float(x) ** i for i in range(degree + 1)] for x in xs], dtype=torch.float64)
    b = torch.tensor(ys, dtype=torch.float64).unsqueeze(1)
    coef = torch.linalg.lstsq(a, b).solution.squeeze(1).tolist()
    return Fit(coef)


@dataclass
class BlockCosts:
    """A model's fitted costs per trunk block and per micro-batch sequence (``profile``'s result)."""

    num_blocks: int
    hidden_bytes: Fit  # the message between blocks, bytes
    pre: Fit  # forward, seconds
    attention: Fit
    post: Fit
    pre_grad: Fit  # input-gradient (I) parts, seconds
    attention_grad: Fit
    post_grad: Fit
    weight_grad: Fit  # W, seconds
    kept: dict[str, Fit]  # bytes kept for backward per block, per policy
    recompute: dict[str, Fit]  # seconds of the recomputed forward per block, per policy
    head_forward: Fit
    head_backward: Fit
    split_bytes: Fit  # bytes held from I to W beyond the forward's kept tensors, per block
    capture: Fit  # seconds per micro-batch and stage
    block_parameter_bytes: int
    outer_parameter_bytes: int
    dtype_bytes: int
    micro_batch: int = 1  # samples per profiled micro-batch (costs scale linearly in samples)
    samples: list[Sample] = field(default_factory=list)
    source: str = "measured"

    def forward(self, t: float) -> float:
        return self.pre(t) + self.attention(t) + self.post(t)

    def input_grad(self, t: float) -> float:
        return self.pre_grad(t) + self.attention_grad(t) + self.post_grad(t)


def crop(batch: Any, seq_len: int) -> Any:
    """Every tensor of ``batch`` with at least two dims cut to ``seq_len`` along dim 1 (a [B, T, ...]
    batch; labels shifted by one are cut alike)."""
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t[:, :seq_len].contiguous() if isinstance(t, Tensor) and t.dim() >= 2 else t, batch)


def _capture(trunk: Trunk, step: Callable[[], Any]) -> tuple[Capture, Any]:
    try:
        return capture(trunk, step, None), None
    except TrunkCallError as err:
        if err.first_call is None:
            raise
        like = probe_output_structure(trunk.blocks[0], *err.first_call)
        return capture(trunk, step, like), like


def _forward(block: Any, x: Tensor, args: tuple, kwargs: dict) -> Tensor:
    return unwrap_output(block(x, *args, **kwargs), block)


def _block_pass(block: Any, x: Tensor, args: tuple, kwargs: dict) -> tuple[dict, dict, float, int]:
    """Forward, I and W of one block on a leaf input, timed by op class; and the bytes of the gradients
    that I leaves at the weights' intermediates for W."""
    leaf = x.detach().requires_grad_(True)
    timer = _Timer()
    with timer:
        y = unwrap_output(block(leaf, *args, **kwargs), block)
    forward = dict(timer.seconds)
    grad = torch.randn_like(y)
    timer = _Timer()
    with timer:
        _, work = backward_input([y], [grad], [leaf])
    # backward runs post-attention ops first: what the timer calls "pre" is the post part's gradient
    backward = {"post": timer.seconds["pre"], "attention": timer.seconds["attention"], "pre": timer.seconds["post"]}
    kept = sum(g.numel() * g.element_size() for group in work.groups for grads in group["grads"] if grads
               for g in grads if g is not None)  # fmt: skip
    t0 = time.perf_counter()
    work.run()
    return forward, backward, time.perf_counter() - t0, kept


def _sample(lm: Any, trunk: Trunk, batch: Any, seq_len: int, repeats: int) -> Sample:
    cropped = crop(batch, seq_len)
    cap, like = _capture(trunk, lambda: lm.training_step(cropped, 0))
    x, (args, kwargs) = cap.trunk_input.detach(), cap.block_args[0]
    block = trunk.blocks[0]
    runs = [_block_pass(block, x, args, kwargs) for _ in range(repeats + 1)][1:]  # the first warms up
    med = lambda values: sorted(values)[len(values) // 2]  # noqa: E731
    forward = {k: med([r[0][k] for r in runs]) for k in runs[0][0]}
    backward = {k: med([r[1][k] for r in runs]) for k in runs[0][1]}
    weight = med([r[2] for r in runs])
    t0 = time.perf_counter()
    for _ in range(repeats):
        _capture(trunk, lambda: lm.training_step(cropped, 0))
    capture_seconds = (time.perf_counter() - t0) / repeats
    kept, recompute = {}, {}
    for policy in POLICIES:
        if policy == "every_n":
            continue
        holder = torch.nn.Module()
        holder.blocks = torch.nn.ModuleList([block, copy.deepcopy(block)])  # a trunk has two blocks or more
        apply_recompute(holder, policy, every_n=1)
        try:
            leaf = x.detach().requires_grad_(True)
            kept[policy], out = kept_for_backward(functools.partial(_forward, block, leaf, args, kwargs))
            t0 = time.perf_counter()
            out.backward(torch.ones_like(out))
            recompute[policy] = max(0.0, time.perf_counter() - t0 - sum(backward.values()) - weight)
        finally:
            apply_recompute(holder, "none")
        block.zero_grad(set_to_none=True)
    y = x.detach().requires_grad_(True)
    t0 = time.perf_counter()
    loss = loss_of(substitute(trunk, lambda: lm.training_step(cropped, 0), y if like is None else (y, *like[1:])))
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    lm.zero_grad(set_to_none=True)
    return Sample(seq_len, forward, backward, weight, kept, recompute, t1 - t0, t2 - t1, x.numel() * x.element_size(),
                  x.element_size(), runs[0][3], capture_seconds)  # fmt: skip


def profile(lm: Any, batch: Any, seq_lens: list[int], micro_batch: int = 1, repeats: int = 3) -> BlockCosts:
    """Measure ``lm``'s block and head costs at ``seq_lens`` on ``micro_batch`` samples of ``batch``."""
    if len(seq_lens) < 2:
        raise ValueError(f"profile needs at least two sequence lengths to fit, got {seq_lens}")
    from torch.utils._pytree import tree_map

    batch = tree_map(lambda t: t[:micro_batch] if isinstance(t, Tensor) and t.dim() >= 1 else t, batch)
    trunk = discover_trunk(lm)
    lm.train()
    samples = [_sample(lm, trunk, batch, t, repeats) for t in sorted(seq_lens)]
    xs = [s.seq_len for s in samples]
    linear = lambda key: fit(xs, [key(s) for s in samples], 1)  # noqa: E731
    block_bytes = sum(p.numel() * p.element_size() for p in trunk.blocks[0].parameters())
    in_blocks = {id(p) for b in trunk.blocks for p in b.parameters()}
    outer = sum(p.numel() * p.element_size() for p in lm.parameters() if id(p) not in in_blocks)
    return BlockCosts(
        num_blocks=len(trunk),
        hidden_bytes=linear(lambda s: s.message),
        pre=linear(lambda s: s.forward["pre"]),
        attention=fit(xs, [s.forward["attention"] for s in samples], 2),
        post=linear(lambda s: s.forward["post"]),
        pre_grad=linear(lambda s: s.input_grad["pre"]),
        attention_grad=fit(xs, [s.input_grad["attention"] for s in samples], 2),
        post_grad=linear(lambda s: s.input_grad["post"]),
        weight_grad=linear(lambda s: s.weight_grad),
        kept={p: linear(lambda s, p=p: s.kept[p]) for p in samples[0].kept},
        recompute={p: linear(lambda s, p=p: s.recompute[p]) for p in samples[0].recompute},
        head_forward=linear(lambda s: s.head_forward),
        head_backward=linear(lambda s: s.head_backward),
        split_bytes=linear(lambda s: s.split_bytes),
        capture=linear(lambda s: s.capture),
        block_parameter_bytes=block_bytes,
        outer_parameter_bytes=outer,
        dtype_bytes=samples[0].dtype_bytes,
        micro_batch=micro_batch,
        samples=samples,
    )
