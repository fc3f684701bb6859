"""The parity contract (docs/design.md, "Parity tests"): a strategy must reproduce single-process training.

``assert_parity`` trains an example model for K optimizer steps twice on the same global batches:
once in the pytest process on one device (cached per configuration), once under the strategy on N
forked gloo ranks with real ``Trainer``s. It then asserts, with ``torch.testing.assert_close``:

- the parameters before the first step (replicas start from the same weights),
- the loss of every batch (averaged over the data-parallel replicas),
- every parameter after every optimizer step, under its original name,
- and that the parameters did change (a no-op step cannot pass).

Tolerances: float64 with any optimizer ``rtol=1e-9, atol=1e-12``; float32 only with SGD,
``rtol=atol=1e-5`` (Adam turns summation-order noise in near-zero gradients into lr-sized updates,
see ``build``).

The parallel run is also checked against NCCL's communication rules (``tests/helpers/comm_check.py``: tag-blind
p2p matching, per-pair in-order streams, collective order, no host tensors in an op), and a run with pipeline
stages must have recorded point-to-point traffic. ``comm_check=False`` or ``LP_COMM_CHECK=0`` turns it off. The
host-tensor rule costs about a sixth of a run's time, so it runs where asked (``host_check=True``, or
``LP_COMM_HOST=1`` for every run): tests/strategies/test_host_tensors.py asks it for every communication path.
"""

from __future__ import annotations

import functools
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, DistributedSampler

from tests.helpers.distributed import run_distributed

TOLERANCES = {"float64": dict(rtol=1e-9, atol=1e-12), "float32": dict(rtol=1e-5, atol=1e-5)}
PRECISION = {"float64": "64-true", "float32": "32-true"}

#: Small configurations of the three example models (8 blocks: pp=4 x 2 virtual stages fits).
MODEL_KWARGS: dict[str, dict[str, Any]] = {
    "gpt": dict(n_layer=8, n_head=2, n_embd=32),
    "llama": dict(n_layer=8, n_head=4, n_kv_head=2, dim=32, mlp_hidden=64),
    "encoder": dict(d_model=32, nhead=4, num_layers=8, dim_feedforward=64, max_len=16, vocab_size=32),
}
SEQ_LEN = 16


@dataclass
class Records:
    """What one training run observed, on one rank."""

    initial: dict[str, Tensor] = field(default_factory=dict)
    losses: list[Tensor] = field(default_factory=list)
    params: list[dict[str, Tensor]] = field(default_factory=list)
    anatomy: list[str] = field(default_factory=list)  # which anatomy served each composed block (or helix split)
    logged: list[Tensor | None] = field(default_factory=list)  # the logged "train_loss" of every batch, if any


class Recorder(L.Callback):
    def __init__(self) -> None:
        self.records = Records()

    def _params(self, trainer: L.Trainer) -> dict[str, Tensor]:
        gather = getattr(trainer.strategy, "gather_named_parameters", None)
        if gather is not None:
            return {k: v.cpu() for k, v in gather().items()}
        return {k: p.detach().cpu().clone() for k, p in trainer.lightning_module.named_parameters()}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.records.initial = self._params(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        names = [split.name for split in getattr(strategy, "_splits", [])]
        blocks = getattr(strategy, "_blocks", None)
        names += [r.anatomy_name for r in blocks.runners.values() if r.anatomy_name] if blocks is not None else []
        self.records.anatomy = names

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean")
        self.records.losses.append(loss.cpu().clone())
        logged = trainer.callback_metrics.get("train_loss")  # as the module logged it (one device's value)
        self.records.logged.append(None if logged is None else logged.detach().cpu().clone())
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            self.records.params.append(self._params(trainer))


def build(
    model: str, batch_size: int, optimizer: str, seed: int = 0
) -> tuple[L.LightningModule, L.LightningDataModule]:
    """An example model and its data, deterministically initialised and unshuffled."""
    from examples.data import CharDataModule, ClassificationDataModule
    from examples.models import GPT, EncoderClassifier, Llama

    torch.manual_seed(seed)
    from tests.helpers import zoo

    if (
        model.partition("#")[0].partition("@")[0] in zoo.MODELS
    ):  # "hf:mixtral@batched_mm#4": batched_mm experts, 4 layers
        return zoo.build(model, batch_size, optimizer, 0.05 if optimizer == "sgd" else 1e-3, SEQ_LEN)
    if model.startswith("packed:"):  # packed rows of documents (tests/helpers/packed.py)
        from tests.helpers import packed

        return packed.build(model.removeprefix("packed:"), batch_size, optimizer, 0.05 if optimizer == "sgd" else 1e-3)
    # Adam's lr stays small: parameters whose exact gradient is zero (the key bias of nn.MultiheadAttention:
    # softmax ignores a per-key constant) get updates of about lr * rounding-noise / eps from Adam, which at
    # lr=1e-2 reach the fp64 atol of 1e-12 by themselves. Real updates stay ~1e-3 per step.
    kwargs = dict(MODEL_KWARGS.get(model, {}), optimizer=optimizer, lr=0.05 if optimizer == "sgd" else 1e-3)
    if model == "encoder":
        data: L.LightningDataModule = ClassificationDataModule(
            vocab_size=kwargs["vocab_size"], seq_len=SEQ_LEN, batch_size=batch_size, shuffle=False
        )
        return EncoderClassifier(**kwargs), data
    if model in ("hf", "hf4"):
        from tests.helpers.models import HFStyleDecoder

        data = CharDataModule(block_size=SEQ_LEN, batch_size=batch_size, shuffle=False)
        layers = 4 if model == "hf4" else 8
        return HFStyleDecoder(vocab_size=data.vocab_size, num_layers=layers, lr=kwargs["lr"], optimizer=optimizer), data
    if model in ("hf-llama", "hf-gpt2"):
        from tests.helpers.models import HFCausalLM

        data = CharDataModule(block_size=SEQ_LEN, batch_size=batch_size, shuffle=False)
        return HFCausalLM(model[3:], vocab_size=data.vocab_size, lr=kwargs["lr"], optimizer=optimizer), data
    if model in ("hf-llama-deferred", "hf-gpt2-deferred", "hf-mixtral-deferred"):
        from tests.helpers.models import DeferredHFCausalLM

        data = CharDataModule(block_size=SEQ_LEN, batch_size=batch_size, shuffle=False)
        family = model[3:].removesuffix("-deferred")
        return DeferredHFCausalLM(family, vocab_size=data.vocab_size, lr=kwargs["lr"], optimizer=optimizer), data
    if model == "twice":
        from tests.helpers.models import TwoPassGPT

        data = CharDataModule(block_size=SEQ_LEN, batch_size=batch_size, shuffle=False)
        return TwoPassGPT(vocab_size=data.vocab_size, block_size=SEQ_LEN, **MODEL_KWARGS["gpt"]), data
    if model == "gpt-rank-seeded":  # each rank initialises from its own seed, as unseeded processes do
        import os

        torch.manual_seed(int(os.environ.get("RANK", "0")))
        data = CharDataModule(block_size=SEQ_LEN, batch_size=batch_size, shuffle=False)
        kw = dict(MODEL_KWARGS["gpt"], optimizer=optimizer, lr=kwargs["lr"])
        return GPT(vocab_size=data.vocab_size, block_size=SEQ_LEN, **kw), data
    if model in ("gpt-deferred", "gpt-empty-init", "gpt-own-init"):
        from tests.helpers.models import DeferredGPT, OwnInitGPT

        data = CharDataModule(block_size=SEQ_LEN, batch_size=batch_size, shuffle=False)
        kw = dict(MODEL_KWARGS["gpt"], optimizer=optimizer, lr=kwargs["lr"])
        cls = OwnInitGPT if model == "gpt-own-init" else DeferredGPT
        return cls(vocab_size=data.vocab_size, block_size=SEQ_LEN, **kw), data
    if model in ("llama-ckpt", "gpt-sum", "llama-skip", "llama-learned-rope", "gpt-direct-head"):
        from tests.helpers import models

        data = CharDataModule(block_size=SEQ_LEN, batch_size=batch_size, shuffle=False)
        cls, base = {
            "llama-ckpt": (models.CheckpointedLlama, "llama"),
            "gpt-sum": (models.SumLossGPT, "gpt"),
            "llama-skip": (models.SkipHeadLlama, "llama"),
            "llama-learned-rope": (models.LearnedRopeLlama, "llama"),
            "gpt-direct-head": (models.DirectHeadGPT, "gpt"),
        }[model]
        return cls(
            vocab_size=data.vocab_size,
            block_size=SEQ_LEN,
            **dict(MODEL_KWARGS[base], optimizer=optimizer, lr=kwargs["lr"]),
        ), data
    if model == "gpt-varlen":
        from tests.helpers.models import VarLenCharData

        data = VarLenCharData(block_size=SEQ_LEN, batch_size=batch_size, shuffle=False)
        return GPT(
            vocab_size=data.vocab_size, block_size=SEQ_LEN, **MODEL_KWARGS["gpt"], optimizer=optimizer, lr=kwargs["lr"]
        ), data
    data = CharDataModule(block_size=SEQ_LEN, batch_size=batch_size, shuffle=False)
    cls = GPT if model == "gpt" else Llama
    return cls(vocab_size=data.vocab_size, block_size=SEQ_LEN, **kwargs), data


def _fit(
    model: str, dtype: str, optimizer: str, steps: int, batch_size: int, trainer_kwargs: dict, extra_callbacks=(), **kw
) -> Records:
    module, data = build(model, batch_size, optimizer)
    if model == "gpt-empty-init":  # built in __init__ under Trainer.init_module(empty_init=True), below
        module = None
    if "train_samples" in trainer_kwargs:  # uneven last batches: an epoch of few samples
        trainer_kwargs = dict(trainer_kwargs)
        data.train_dataloader = _limit_samples(data.train_dataloader, trainer_kwargs.pop("train_samples"))
    recorder = Recorder()
    with tempfile.TemporaryDirectory() as root:
        trainer = L.Trainer(
            accelerator="cpu",
            precision=PRECISION[dtype],
            max_steps=steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
            default_root_dir=root,
            callbacks=[recorder, *extra_callbacks],
            **trainer_kwargs,
            **kw,
        )
        if module is None:
            from tests.helpers.models import DeferredGPT

            gpt = dict(MODEL_KWARGS["gpt"], optimizer=optimizer, lr=0.05 if optimizer == "sgd" else 1e-3)
            with trainer.init_module(empty_init=True):
                module = DeferredGPT(vocab_size=data.vocab_size, block_size=SEQ_LEN, init_module=True, **gpt)
        trainer.fit(module, datamodule=data)
    return recorder.records


class _OneReplicaSampler(L.Callback):
    """Give the single-process run the batch order of Lightning's training ``DistributedSampler``.

    Under any data-parallel strategy Lightning replaces the training sampler by
    ``DistributedSampler(shuffle=True, seed=PL_GLOBAL_SEED or 0)``; replica r of R takes every R-th index
    of one seeded permutation, so the union of the replicas' k-th batches is exactly the k-th batch of
    the same sampler at ``num_replicas=1``, which is what the reference must train on.
    """

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        data = trainer.datamodule
        make = data.train_dataloader

        def train_dataloader() -> DataLoader:
            loader = make()
            sampler = DistributedSampler(loader.dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
            return DataLoader(
                loader.dataset, batch_size=loader.batch_size, sampler=sampler, collate_fn=loader.collate_fn
            )

        data.train_dataloader = train_dataloader


def _limit_samples(make: Any, num_samples: int) -> Any:
    """A train loader over the first ``num_samples`` samples, so an epoch ends in an uneven last batch."""

    def train_dataloader() -> DataLoader:
        loader = make()
        subset = torch.utils.data.Subset(loader.dataset, range(num_samples))
        return DataLoader(subset, batch_size=loader.batch_size, collate_fn=loader.collate_fn)

    return train_dataloader


@functools.lru_cache(maxsize=64)
def reference(model: str, dtype: str, optimizer: str, steps: int, global_batch: int, extra: tuple) -> Records:
    """The single-process run every layout is compared with (cached: many layouts share it)."""
    kwargs = dict(extra)
    return _fit(
        model,
        dtype,
        optimizer,
        steps,
        global_batch,
        kwargs,
        devices=1,
        strategy="auto",
        extra_callbacks=[_OneReplicaSampler(), *([_EmptyInitReference()] if model in EMPTY_INIT else [])],
    )


# built under Trainer.init_module(empty_init=True): one process holds uninitialised memory, so the reference takes
# the rule every such layout follows. A model built in configure_model is compared with one process's eager build
# as it is (the strategies replay its initialisation: lightning_parallel.init_replay).
EMPTY_INIT = ("gpt-empty-init",)


class _EmptyInitReference(L.Callback):
    """The single-process run of a model built under ``empty_init``: uninitialised, then initialised by the rule
    every such layout follows (``lightning_parallel.materialize``)."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from lightning_parallel.materialize import initialize_

        initialize_(pl_module, torch.initial_seed())


class _ExpectP2P(L.Callback):
    """Under the communication check: a run with more than one pipeline stage must record p2p ops."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from tests.helpers import comm_check

        dims = getattr(trainer.strategy, "parallel_dims", None)
        comm_check.expect_p2p(getattr(dims, "pp", 1) > 1)


def _parallel_rank(
    rank: int, world_size: int, strategy: Callable[[], Any], args: tuple, extra: dict, callbacks: Any
) -> Records:
    more = [*(callbacks() if callbacks is not None else []), _ExpectP2P()]
    return _fit(*args, dict(extra), devices=world_size, strategy=strategy(), extra_callbacks=more)


def assert_parity(
    model: str,
    strategy: Callable[[], Any],
    world_size: int,
    *,
    data_parallel_size: int,
    dtype: str = "float64",
    optimizer: str | None = None,
    steps: int = 3,
    global_batch: int = 8,
    callbacks: Callable[[], list] | None = None,
    comm_check: bool | None = None,
    host_check: bool = False,
    logged_loss: bool = False,
    loss_rtol: float | None = None,
    **trainer_kwargs: Any,
) -> list[Records]:
    """Train ``model`` under ``strategy()`` on ``world_size`` ranks and single-process; assert equality.

    ``strategy`` is a zero-argument factory called inside each rank. ``trainer_kwargs`` (e.g.
    ``accumulate_grad_batches``, ``gradient_clip_val``) go to both Trainers; ``callbacks()`` (e.g. the
    profilers, which must not change numerics) only to the parallel one. ``logged_loss``: compare the module's
    logged ``train_loss`` of every batch on every rank (one device's value), instead of the step's returned loss
    averaged over the replicas. ``comm_check`` (default: on unless
    ``LP_COMM_CHECK=0``) checks the parallel run's communication against NCCL's rules (module docstring).
    ``loss_rtol`` bounds the losses alone where a model computes part of its loss in float32 whatever its dtype, in
    sums that no split of the batch reproduces bit for bit (a mixture's balancing loss); the parameters keep the
    dtype's bound.
    """
    optimizer = optimizer or ("adamw" if dtype == "float64" else "sgd")
    if dtype == "float32" and optimizer != "sgd":
        raise ValueError("float32 parity is defined for SGD only (Adam turns rounding noise into lr-sized updates)")
    if global_batch % data_parallel_size:
        raise ValueError(f"global_batch={global_batch} must divide by data_parallel_size={data_parallel_size}")
    extra = tuple(sorted(trainer_kwargs.items()))
    ref = reference(model, dtype, optimizer, steps, global_batch, extra)
    args = (model, dtype, optimizer, steps, global_batch // data_parallel_size)
    if comm_check is None:
        comm_check = os.environ.get("LP_COMM_CHECK") != "0"
    host = host_check or os.environ.get("LP_COMM_HOST") == "1"
    os.environ["LP_COMM_HOST"], before = ("1" if host else "0"), os.environ.get("LP_COMM_HOST")
    try:
        per_rank = _run_parallel(strategy, world_size, args, trainer_kwargs, callbacks, comm_check)
    finally:
        if before is None:
            del os.environ["LP_COMM_HOST"]
        else:
            os.environ["LP_COMM_HOST"] = before
    return _compare(per_rank, ref, dtype, model, steps, logged_loss, loss_rtol)


def _run_parallel(
    strategy: Callable[[], Any], world_size: int, args: tuple, trainer_kwargs: dict, callbacks: Any, comm_check: bool
) -> list[Records]:
    return run_distributed(
        _parallel_rank,
        world_size,
        strategy,
        args,
        trainer_kwargs,
        callbacks,
        init_process_group=False,
        comm_check=comm_check,
    )


def _compare(per_rank: list[Records], ref: Records, dtype: str, model: str, steps: int,
             logged_loss: bool = False, loss_rtol: float | None = None) -> list[Records]:  # fmt: skip
    tol = TOLERANCES[dtype]
    loss_tol = tol if loss_rtol is None else dict(tol, rtol=loss_rtol)
    for rank, got in enumerate(per_rank):
        where = f"{model} {dtype} rank {rank}"
        _assert_params(got.initial, ref.initial, f"{where}, initial parameters", tol)
        if len(got.losses) != len(ref.losses) or len(got.params) != len(ref.params):
            raise AssertionError(
                f"{where}: {len(got.losses)} losses / {len(got.params)} steps, "
                f"single process had {len(ref.losses)} / {len(ref.params)}"
            )
        got_losses, ref_losses = (got.logged, ref.logged) if logged_loss else (got.losses, ref.losses)
        assert not logged_loss or all(v is not None for v in [*got_losses, *ref_losses]), f"{where}: no train_loss"
        for i, (a, b) in enumerate(zip(got_losses, ref_losses)):
            torch.testing.assert_close(a, b, **loss_tol, msg=lambda m, i=i, w=where: f"{w}, loss of batch {i}: {m}")
        for step, (a, b) in enumerate(zip(got.params, ref.params)):
            _assert_params(a, b, f"{where}, parameters after step {step + 1}", tol)
    moved = max((ref.params[-1][k] - ref.initial[k]).abs().max().item() for k in ref.initial)
    assert moved > 1e-6, f"{model}: parameters did not change in {steps} steps; the comparison would be vacuous"
    return per_rank


def _assert_params(got: dict[str, Tensor], want: dict[str, Tensor], where: str, tol: dict) -> None:
    if got.keys() != want.keys():
        missing, unexpected = sorted(want.keys() - got.keys()), sorted(got.keys() - want.keys())
        raise AssertionError(f"{where}: parameter names differ; missing {missing}, unexpected {unexpected}")
    for name in want:
        torch.testing.assert_close(got[name], want[name], **tol, msg=lambda m, n=name: f"{where}, {n}: {m}")
