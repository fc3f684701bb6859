"""The micro-batches of a pipeline step (docs/design.md, "Pipeline parallelism"): the batch split along its batch
dimension, the user's step run on each as the runtime asks (``MicroBatchSteps``), and what the step returns
assembled as one device's step over the whole batch returns it.

Every tensor in the batch collection is split with ``torch.tensor_split``, so a batch that does not
divide evenly (the DataLoader's default last batch) gives micro-batches whose sizes differ by at most
one; each micro-batch's loss is then weighted by its share of the batch.

A batch of fewer samples than micro-batches (an epoch's last batch) gives one micro-batch per sample and
fills the schedule with *padding*: copies of the last sample with share 0. Their loss weight is 0, so they
add exact zeros to every gradient, and the strategies run them quietly (no ``self.log``, metric states
restored), so the step trains exactly as one device trains the short batch; every schedule keeps its shape.
"""

from __future__ import annotations

import zlib
from typing import Any, Optional

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn, tensor_split
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from lightning_parallel.pipeline.capture import loss_of
from lightning_parallel.strategies._logging import LogRecorder, restore_metrics, snapshot_metrics
from lightning_parallel.token_mean import CrossEntropyCalls, TokenWeights


def split_microbatches(batch: Any, num_microbatches: int) -> tuple[list[Any], list[float]]:
    """Return ``num_microbatches`` micro-batches and each one's share of the batch (summing to 1)."""
    leaves, spec = tree_flatten(batch)
    sizes = {leaf.shape[0] for leaf in leaves if isinstance(leaf, Tensor) and leaf.dim() > 0}
    if not sizes:
        raise ValueError(f"the batch ({type(batch).__name__}) holds no tensor to split into micro-batches")
    if len(sizes) > 1:
        raise ValueError(f"the batch's tensors have different sizes along dim 0: {sorted(sizes)}; cannot micro-batch")
    size = sizes.pop()
    if size == 0:
        raise ValueError("the batch is empty (0 samples along dim 0); there is nothing to train on")
    real = min(size, num_microbatches)
    pieces = [
        tensor_split(leaf, real) if isinstance(leaf, Tensor) and leaf.dim() > 0 else [leaf] * real for leaf in leaves
    ]
    micro = [tree_unflatten([p[i] for p in pieces], spec) for i in range(real)]
    first_tensor = next(i for i, leaf in enumerate(leaves) if isinstance(leaf, Tensor) and leaf.dim() > 0)
    shares = [pieces[first_tensor][i].shape[0] / size for i in range(real)]
    padding = num_microbatches - real  # the last sample again, share 0 (see the module's docstring); fresh
    last = [p[real - 1] for p in pieces]  # containers each time, so a step that edits its batch edits its own
    return micro + [tree_unflatten(last, spec) for _ in range(padding)], shares + [0.0] * padding


def batch_checksum(batch: Any) -> int:
    """A CRC32 of every tensor in the batch, to check that the ranks of one replica got the same batch."""
    crc = 0
    for leaf in tree_leaves(batch):
        if isinstance(leaf, Tensor):
            raw = leaf.detach().cpu().contiguous().view(-1).view(torch.uint8)  # any dtype, bf16 included
            crc = zlib.crc32(raw.numpy().tobytes(), crc)
    return crc


def check_padding(lm: nn.Module, samples: int, num_microbatches: int) -> None:
    """Padding micro-batches must not change the model: running statistics (batch norm) would see them.
    Padding is exact but costs compute: say so once."""
    stats = [n for n, m in lm.named_modules() if getattr(m, "track_running_stats", False) and m.training]
    if stats:
        raise ValueError(
            f"a batch of {samples} samples is shorter than num_microbatches={num_microbatches}; the schedule is"
            f" filled with padding micro-batches, which would update the running statistics of {stats[:3]}; use"
            " a batch size divisible into num_microbatches with drop_last=True, or a smaller num_microbatches"
        )
    rank_zero_warn(
        f"a batch of {samples} samples is shorter than num_microbatches={num_microbatches}: the schedule is filled"
        f" with {num_microbatches - samples} padding micro-batch(es) of weight 0 (exact, but they cost compute; an"
        " epoch's last batch does this, a batch size below num_microbatches does it every step)"
    )


def step_extras(outputs: list[Any], shares: list[float]) -> Optional[dict[str, Any]]:
    """The keys besides ``"loss"`` of the dicts the micro-batches' steps returned, as one device's step over the
    whole batch returns them: a number or a scalar tensor as the micro-batches' mean weighted by their share of the
    samples; a tensor with a row per sample as the rows of the batch, in order. ``None`` when the steps returned
    the loss alone. Anything else cannot be assembled from micro-batches and is refused, naming the key."""
    real = [(o, s) for o, s in zip(outputs, shares) if s > 0]
    if not isinstance(real[0][0], dict) or set(real[0][0]) == {"loss"}:
        return None
    extras: dict[str, Any] = {}
    for key in (k for k in real[0][0] if k != "loss"):
        values = [o[key] for o, _ in real]
        if all(isinstance(v, (int, float)) or isinstance(v, Tensor) and v.dim() == 0 for v in values):
            weighted = sum(torch.as_tensor(v, dtype=torch.float64).cpu() * s for v, (_, s) in zip(values, real))
            first = values[0]
            extras[key] = weighted.to(first.dtype) if isinstance(first, Tensor) and first.is_floating_point() else (
                weighted if isinstance(first, Tensor) else float(weighted))  # fmt: skip
        elif all(isinstance(v, Tensor) and v.dim() > 0 for v in values):
            extras[key] = torch.cat([v.detach().cpu() for v in values])
        else:
            kinds = sorted({type(v).__name__ for v in values})
            raise ValueError(
                f"training_step returned {key!r} of type {', '.join(kinds)}: a pipeline assembles a returned dict's"
                " values from its micro-batches (numbers and scalar tensors as a mean, tensors with a row per sample"
                " as the batch's rows); return one of those, or log the value with self.log"
            )
    return extras


class MicroBatchSteps:
    """The user's ``training_step`` on each micro-batch of one step, as the runtime calls it
    (:class:`~lightning_parallel.pipeline.context.UserStep`): only the loss pass logs (into ``recorder``, as micro-batch
    ``i``) and learns the micro-batch's token count; a padding micro-batch (it fills a short batch's schedule) and a
    replay log nothing and leave the metric states as they were."""

    def __init__(self, metrics: dict[str, Any], lm: Any, micro: list, shares: list[float], rest: tuple,
                 kwargs: dict, recorder: LogRecorder, weights: TokenWeights) -> None:  # fmt: skip
        self.metrics, self.lm, self.micro, self.shares = metrics, lm, micro, shares
        self.rest, self.kwargs, self.recorder, self.weights = rest, kwargs, recorder, weights

    def __len__(self) -> int:
        return len(self.micro)

    def capture(self, i: int) -> Any:
        self.recorder.microbatch, self.recorder.active = i, False
        return self._run(i, quiet=self.shares[i] == 0.0)

    def loss(self, i: int) -> Any:
        padding = self.shares[i] == 0.0
        self.recorder.microbatch, self.recorder.active = i, not padding
        with CrossEntropyCalls() as calls:  # the loss the schedule's backward is seeded with
            self.recorder.count_of = calls.count_of
            try:
                out = self._run(i, quiet=padding)
            finally:
                self.recorder.count_of = None
        self.weights.learn(i, calls.count_of(loss_of(out)))
        return out

    def replay(self, i: int) -> Any:
        self.recorder.microbatch, self.recorder.active = i, False
        return self._run(i, quiet=True)

    def _run(self, i: int, quiet: bool) -> Any:
        if not quiet:
            return self.lm.training_step(self.micro[i], *self.rest, **self.kwargs)
        saved = snapshot_metrics(self.metrics)
        try:
            return self.lm.training_step(self.micro[i], *self.rest, **self.kwargs)
        finally:
            restore_metrics(self.metrics, saved)
