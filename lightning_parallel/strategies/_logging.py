"""Logging under a pipelined step: record, reduce over micro-batches, broadcast, replay.

While the schedule runs, ``LightningModule.log`` is replaced by a recorder. Only the loss stage runs
the user's post-trunk code, so only it records; its records are reduced per name over the
micro-batches according to ``reduce_fx`` (``mean`` weighted by each micro-batch's share of the batch,
so a per-sample mean equals the whole batch's), broadcast to every pipeline rank, and replayed there
through the real ``self.log``. Every rank then logs identical values, so ``sync_dist``, monitors,
``EarlyStopping`` and the progress bar behave as on one device.

torchmetrics objects: on the loss stage each metric is reset before the step, so after the schedule it
holds exactly the batch's state; its batch value (what Lightning logs ``on_step``) is computed from
that, the state is merged back into the state from before the step, and the merged state is broadcast
to every pipeline rank. Metric syncs use the dp group (set at setup), so tp/sp/pp replicas never
count a sample twice.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import Tensor
from torchmetrics import Metric

from lightning_parallel import _collectives

_REDUCE = {"mean": "mean", "avg": "mean", "sum": "sum", "max": "max", "min": "min"}
_REDUCE.update({torch.mean: "mean", torch.sum: "sum", torch.max: "max", torch.min: "min"})  # type: ignore[dict-item]


@dataclass
class LogRecorder:
    """Collects ``self.log`` calls per micro-batch while ``active``."""

    active: bool = False
    microbatch: int = 0
    #: (micro-batch, value, kwargs, token count: set where the value is a token-mean loss, see token_mean.py)
    records: dict[str, list[tuple[int, Any, dict, Any]]] = field(default_factory=lambda: defaultdict(list))
    count_of: Any = None  # while the loss is computed: the token count behind a logged value, or None

    def log(self, name: str, value: Any, **kwargs: Any) -> None:
        if self.active:  # detached: a record must not keep the step's graph (a split backward retains it)
            from torch.utils._pytree import tree_map

            count = self.count_of(value) if self.count_of is not None else None
            value = tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, value)
            self.records[name].append((self.microbatch, value, kwargs, count))


class TokenMeanLogs:
    """``self.log`` during a data-parallel step: a value that is a token-mean loss (``count_of`` gives its count,
    :mod:`lightning_parallel.token_mean`) waits in ``deferred`` for the replicas' token counts, to be logged after
    the step as one device's value; any other goes to Lightning at once."""

    def __init__(self, module: LightningModule, count_of: Any) -> None:
        self.module, self.count_of = module, count_of
        self.deferred: list[tuple[str, Any, dict, Tensor]] = []

    def log(self, name: str, value: Any, **kwargs: Any) -> None:
        count = self.count_of(value)
        if count is None or kwargs.get("reduce_fx", "mean") != "mean":
            type(self.module).log(self.module, name, value, **kwargs)
        else:
            self.deferred.append((name, value, kwargs, count))


@contextmanager
def recording(module: LightningModule, recorder: Any) -> Iterator[Any]:
    """``module.log`` goes to ``recorder.log`` while open (a :class:`LogRecorder`, :class:`TokenMeanLogs`)."""
    module.log = recorder.log  # type: ignore[method-assign]
    try:
        yield recorder
    finally:
        del module.log


def metrics_of(module: LightningModule) -> dict[str, Metric]:
    return {name: m for name, m in module.named_modules() if isinstance(m, Metric)}


def reduce_records(recorder: LogRecorder, shares: list[float], dp_group: Any = None) -> list[tuple[str, Any, dict]]:
    """One ``(name, value, kwargs)`` per logged name; tensor values reduced over the micro-batches: weighted by
    their token counts where every entry is a token-mean loss (then also over the data-parallel replicas of
    ``dp_group``, one device's value on every rank: :mod:`lightning_parallel.token_mean`), else by ``shares``."""
    from lightning_parallel.token_mean import global_means

    out, tokens = [], []
    for name, entries in recorder.records.items():
        kwargs = dict(entries[-1][2])
        value = entries[-1][1]
        if isinstance(value, Metric):
            out.append((name, value, kwargs))
            continue
        fx = _REDUCE.get(kwargs.get("reduce_fx", "mean"))
        if fx is None:
            raise ValueError(
                f"self.log({name!r}, reduce_fx={kwargs['reduce_fx']!r}): pipelining supports mean, sum, max, min"
            )
        values = torch.stack([torch.as_tensor(v, dtype=torch.float64).detach().cpu() for _, v, _, _ in entries])
        dtype = torch.as_tensor(value).dtype if isinstance(value, Tensor) else torch.get_default_dtype()
        dtype = dtype if dtype.is_floating_point else torch.get_default_dtype()
        if fx == "mean" and all(count is not None for *_, count in entries):
            counts = torch.stack([count.detach().to(torch.float64).cpu() for *_, count in entries])
            tokens.append((len(out), ((values * counts).sum(), counts.sum())))
            out.append((name, None, kwargs, dtype))
            continue
        if fx == "mean":
            weights = torch.tensor([shares[i] for i, *_ in entries], dtype=torch.float64)
            reduced = (values * weights).sum() / weights.sum()
        else:
            reduced = getattr(values, fx)()
        out.append((name, reduced.to(dtype), kwargs))
    if tokens:
        means, _ = global_means([pair for _, pair in tokens], dp_group)
        for (at, _), mean in zip(tokens, means):
            name, _, kwargs, dtype = out[at]
            out[at] = (name, mean.cpu().to(dtype), kwargs)
    return out


def replay_logs(
    module: LightningModule,
    logged: list[tuple[str, Any, dict]] | None,
    metrics: MetricStepper,
    extra: Any,
    src: int,
    group: Any,
    device: torch.device,
) -> Any:
    """Broadcast ``logged`` (and ``extra``) from ``src``, settle metric states, call the real
    ``self.log`` once per name on every rank. Returns ``extra`` as ``src`` had it."""
    names = {id(m): n for n, m in module.named_modules()}
    payload = None
    if logged is not None:  # metrics travel by module name; the objects themselves stay on each rank
        payload = (
            extra,
            [(n, ("metric", names[id(v)]) if isinstance(v, Metric) else v.cpu(), kw) for n, v, kw in logged],
        )
    extra, shared = _collectives.broadcast_object(payload, src, group)
    replay = [(n, module.get_submodule(v[1]) if isinstance(v, tuple) else v.to(device), kw) for n, v, kw in shared]
    metrics.after_step(replay, src, group)
    for name, value, kwargs in replay:
        type(module).log(module, name, value, **kwargs)
    return extra


class MetricStepper:
    """Batch-level values and consistent states for torchmetrics objects under a pipelined step."""

    def __init__(self, module: LightningModule, is_loss_stage: bool) -> None:
        self.metrics = metrics_of(module)
        self.is_loss_stage = is_loss_stage
        self._before: dict[str, Metric] = {}

    def before_step(self) -> None:
        if self.is_loss_stage:
            self._before = {n: _state_of(m) for n, m in self.metrics.items() if _mergeable(m)}
            for name in self._before:
                self.metrics[name].reset()

    def after_step(self, logged: list[tuple[str, Any, dict]], src: int, group: Any) -> None:
        """Compute batch values, merge states, broadcast them from ``src`` (the loss stage's rank)."""
        states = None
        if self.is_loss_stage:
            logged_metrics = {id(v) for _, v, _ in logged if isinstance(v, Metric)}
            for name, before in self._before.items():
                metric = self.metrics[name]
                batch_value = _local_compute(metric) if id(metric) in logged_metrics and metric.update_count else None
                count = before["count"] + metric.update_count
                metric.merge_state(before["state"])
                _load_state(metric, {**_state_of(metric), "count": count, "forward": batch_value})
            self._before = {}
            states = {n: _state_of(m) for n, m in self.metrics.items()}
        if group is not None:
            states = _collectives.broadcast_object(states, src, group)
        for name, metric in self.metrics.items():
            _load_state(metric, states[name])


def _local_compute(metric: Metric) -> Any:
    """The metric's value on this rank's state alone (what Lightning logs on_step), leaving no cache."""
    sync = metric.sync_on_compute
    metric.sync_on_compute, metric._computed = False, None
    try:
        return metric.compute()
    finally:
        metric.sync_on_compute, metric._computed = sync, None


def _mergeable(metric: Metric) -> bool:
    # metrics that need the full state on every update cannot be split into a batch part and merged back;
    # they keep accumulating, and their on_step value is the last micro-batch's
    return metric.full_state_update is False and not metric.dist_sync_on_step


def _state_of(metric: Metric) -> dict[str, Any]:
    state = {k: copy.deepcopy(getattr(metric, k)) for k in metric._defaults}
    return {"state": state, "count": metric._update_count, "forward": metric._forward_cache}


def _load_state(metric: Metric, saved: dict[str, Any]) -> None:
    for k, v in saved["state"].items():
        setattr(metric, k, v)
    metric._update_count = saved["count"]
    metric._forward_cache = saved["forward"]
    metric._computed = None


def snapshot_metrics(metrics: dict[str, Metric]) -> dict[str, dict[str, Any]]:
    return {name: _state_of(metric) for name, metric in metrics.items()}


def restore_metrics(metrics: dict[str, Metric], saved: dict[str, dict[str, Any]]) -> None:
    for name, metric in metrics.items():
        _load_state(metric, saved[name])
