"""Token-exact objectives: a loss that is a mean over a varying number of tokens, reproduced under micro-batches and
data-parallel replicas.

One device averages a causal LM's loss over every valid label of its batch (``F.cross_entropy(...,
ignore_index=-100)``, reduction ``"mean"``: what a Hugging Face model computes from ``labels=``). Under a pipeline
each micro-batch's loss averages its own labels, and under data parallelism each replica's; weighting them by their
share of samples (right for a mean over samples) trains another objective as soon as the counts differ (packed
documents, supervised fine-tuning's prompt masks, padding). Hugging Face's Trainer (``num_items_in_batch``),
Megatron (per-token loss) and torchtitan (the global count of valid tokens) normalise by the whole batch's count.

**Which losses.** A step's loss is a token mean when it *is* (the same tensor) the output of a cross-entropy with
reduction ``"mean"`` called in the step (:class:`CrossEntropyCalls`, a ``TorchFunctionMode`` open while the step
runs); its count is that call's number of targets other than ``ignore_index`` (their class weights' sum where the
call has ``weight=``; the number of rows for class-probability targets). A classifier's mean over samples is the
same rule with one target per sample. Any other loss (the user's own, a cross-entropy plus an auxiliary term) is
weighted by samples, and the run says so once (:func:`say_samples_once`).

**The algebra.** Micro-batch (or replica) ``i`` computes ``mean_i = s_i / c_i`` (``s_i`` its sum of per-token
losses). Seeding its backward with ``c_i`` gives ``s_i``'s gradients; after the step every gradient is multiplied
by ``R / N``, ``N = sum c_i`` over all micro-batches and the ``R`` data-parallel replicas (one all-reduce of a
number): the data-parallel average then yields ``(sum s_i)' / N``, one device's gradient of the batch's token
mean. The step's loss and the logged values that are token means are ``sum c_i mean_i / N`` on every rank.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torch.overrides import TorchFunctionMode

_SIGNATURE = inspect.signature(F.cross_entropy)


class CrossEntropyCalls(TorchFunctionMode):
    """While open, records each mean-reduced ``F.cross_entropy`` call (``nn.CrossEntropyLoss`` calls it too): its
    output and the number of targets its mean divides by."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Tensor, Tensor]] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is F.cross_entropy:
            count = _count(_SIGNATURE.bind(*args, **(kwargs or {})).arguments)
            if count is not None and isinstance(out, Tensor):
                self.calls.append((out, count))
        return out

    def count_of(self, value: Any) -> Tensor | None:
        """The count behind ``value`` if it is the output of a recorded call, else ``None``."""
        for out, count in self.calls:
            if value is out:
                return count
        return None


def _count(arguments: dict) -> Tensor | None:
    if arguments.get("reduction", "mean") != "mean" or arguments.get("size_average") is not None:
        return None
    if arguments.get("reduce") is not None:
        return None
    logits, target = arguments["input"], arguments["target"]
    if target.is_floating_point():  # class probabilities: a mean over the rows
        rows = logits.numel() // logits.shape[1] if logits.dim() > 1 else 1
        return torch.tensor(rows, dtype=torch.float64, device=logits.device)
    valid = target != arguments.get("ignore_index", -100)
    weight = arguments.get("weight")
    with torch.no_grad():
        if weight is not None:
            return weight.detach().to(torch.float64)[target.clamp_min(0)].mul(valid).sum()
        return valid.sum().to(torch.float64)


@functools.cache  # said once per kind of run
def say_samples_once(where: str) -> None:
    """The loss was not recognised as a token mean: it is weighted by samples."""
    rank_zero_warn(
        f"{where}: the loss returned by training_step is not the output of a mean-reduced F.cross_entropy, so its"
        " micro-batches / replicas are weighted by their number of samples. That is one device's objective for a mean"
        " over samples; for a mean over a number of tokens that varies between micro-batches or replicas it is not."
        " Return that loss from F.cross_entropy (or a Hugging Face model's labels=) to have it weighted by tokens, or"
        " return a sum over tokens and pass loss_reduction='sum'."
    )


class TokenWeights:
    """A pipelined step's loss weights, learnt as its micro-batches' losses are computed (each is read when that
    micro-batch's backward is seeded, after its loss): where the step's losses are token means, ``count_i x u /
    accumulate`` with ``u = share_0 / count_0`` (a count in units of the first micro-batch's tokens per share: the
    share itself wherever the counts follow the samples, so a seed stays of order one and low-precision
    intermediates round as before); else the micro-batch's share of samples over ``accumulate``; 0 for a padding
    micro-batch. After the step the gradients take ``replicas / (N x u)`` (:meth:`scale`).

    With ``replicas`` (the dp group of the loss stage) the first micro-batch's kind of loss and ``u`` are agreed
    over the replicas (one all-reduce: ``u = sum of share_0 / sum of count_0``), so the factor after the step is
    the same on every replica and commutes with the dp mean, which the gradient buckets take during the schedule.
    """

    def __init__(self, shares: list[float], accumulate: int, reduction: str, replicas: Any = None) -> None:
        self.shares, self.accumulate, self.reduction = shares, accumulate, reduction
        self.replicas = replicas
        self.counts: list[Tensor | None] = [None] * len(shares)
        self.tokens: bool | None = None if reduction == "mean" else False
        self.unit: Tensor | None = None

    def learn(self, i: int, count: Tensor | None) -> None:
        if self.shares[i] == 0.0:
            return  # padding
        if self.tokens is None and self.replicas is not None:
            self._agree(i, count)
        elif self.tokens is None:
            self.tokens = count is not None and bool(count > 0)
        if self.tokens and count is None:
            raise ValueError(
                f"micro-batch {i}'s loss is not the output of a mean-reduced F.cross_entropy, while the step's first"
                " micro-batch's was (a token mean): return the same kind of loss for every micro-batch"
            )
        if self.tokens and self.unit is None:
            self.unit = self.shares[i] / count
        self.counts[i] = count

    def _agree(self, i: int, count: Tensor | None) -> None:
        """The kind of loss (a token mean on every replica) and the unit, over the replicas (class docstring)."""
        from lightning_parallel import _collectives

        device = _collectives.comm_device(self.replicas)
        mine = [float(count is not None), self.shares[i], 0.0]
        agreed = torch.tensor(mine, dtype=torch.float64, device=device)
        if count is not None:
            agreed[2] = count.to(device, torch.float64)
        _collectives.all_reduce_sum_([agreed], self.replicas)
        everyone, _, counts = agreed.tolist()
        self.tokens = everyone == _collectives.group_size(self.replicas) and counts > 0
        if self.tokens:
            assert count is not None
            self.unit = (agreed[1] / agreed[2]).to(count.device)

    def __getitem__(self, i: int) -> Any:
        if self.shares[i] == 0.0:
            return 0.0
        if self.tokens:
            return self.counts[i] * self.unit / self.accumulate
        share = self.shares[i] if self.reduction == "mean" else 1.0
        return share / self.accumulate

    def __len__(self) -> int:
        return len(self.shares)

    def loss_weights(self) -> list[Any]:
        """The weights of the micro-batch losses in the step's loss: token counts (then over every replica's tokens:
        :func:`global_means`), or shares."""
        if self.tokens:
            return [0.0 if s == 0.0 else self.counts[i] for i, s in enumerate(self.shares)]
        return [s if self.reduction == "mean" else float(s > 0) for s in self.shares]

    def scale(self, tokens: Tensor, replicas: int) -> float:
        """The factor of the step's gradients: ``replicas / (tokens x u)``, ``tokens`` the count over all replicas."""
        assert self.unit is not None
        return float(replicas / (tokens.to(self.unit.device) * self.unit))


def global_means(pairs: list[tuple[Tensor, Tensor]], group: Any) -> tuple[list[Tensor], Tensor]:
    """``pairs`` of (weighted sum, count) on this replica -> each one's mean over every replica of ``group`` (one
    all-reduce), and the first pair's total count."""
    from lightning_parallel import _collectives

    stacked = torch.stack([t for pair in pairs for t in pair]).to(torch.float64)
    if group is not None and _collectives.group_size(group) > 1:
        stacked = stacked.to(_collectives.comm_device(group))
        _collectives.all_reduce_sum_([stacked], group)
    sums, counts = stacked[0::2], stacked[1::2]
    return list(sums / counts), counts[0]
