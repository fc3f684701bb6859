"""Data parallelism's gradient buckets, issued during the backward (``strategies/_overlap.py``): parity with one
process whatever the bucket size (one bucket per parameter, or everything in one), with accumulation and with a
parameter the backward never reaches; and the buckets really go during the backward."""

import lightning as L
import pytest
import torch

from lightning_parallel import HelixParallelStrategy, HybridParallelStrategy, PipelineParallelStrategy
from tests.helpers.distributed import run_distributed
from tests.helpers.parity import assert_parity, build
from tests.helpers.trainers import quick_fit


@pytest.mark.parametrize("cap", [1e-4, 25.0])
def test_buckets_give_one_process_training(cap):
    assert_parity("llama", lambda: HybridParallelStrategy(data_parallel_size=2, bucket_cap_mb=cap), 2,
                  data_parallel_size=2, optimizer="adamw", steps=3)  # fmt: skip


def test_buckets_with_accumulation_and_clipping():
    assert_parity("gpt", lambda: HybridParallelStrategy(data_parallel_size=2, bucket_cap_mb=1e-4), 2,
                  data_parallel_size=2, steps=2, accumulate_grad_batches=2, gradient_clip_val=0.05)  # fmt: skip


def _issued(rank: int, world: int, cap: float, extra: str) -> tuple[int, int, list[float], object]:
    torch.set_default_dtype(torch.float64)
    module, data = build("gpt", 4, "sgd")
    if extra != "none":  # a parameter in the middle of the model (its bucket is neither first nor last)
        module.transformer.h[3].register_parameter("extra", torch.nn.Parameter(torch.ones(3)))
    if extra == "rank0":  # reached by rank 0's graph only (as an expert only one replica's tokens chose)
        step = module.training_step

        def training_step(batch, batch_idx):  # type: ignore[no-untyped-def]
            loss = step(batch, batch_idx)
            return loss + 1e-3 * module.transformer.h[3].extra.sum() if rank == 0 else loss

        module.training_step = training_step  # type: ignore[method-assign]
    strategy = HybridParallelStrategy(data_parallel_size=2, bucket_cap_mb=cap)
    quick_fit(module, data, strategy, world, steps=3, use_distributed_sampler=False)
    buckets = strategy._dp.buckets
    params = [p.detach().sum().item() for p in module.parameters()]
    last = getattr(module.transformer.h[3], "extra", None)
    return buckets.issued_in_backward, len(buckets.buckets), params, None if last is None else last.detach().clone()


def test_buckets_are_issued_during_the_backward():
    (issued, n, params0, _), (issued1, _, params1, _) = run_distributed(
        _issued, 2, 1e-4, "none", init_process_group=False
    )
    assert n > 10 and issued == issued1 == 2 * n  # steps 2 and 3 (buckets are made at the first step's average)
    assert params0 == params1  # the replicas stayed equal


def test_a_parameter_no_replica_reaches_keeps_no_gradient_and_holds_nothing_back():
    (issued, n, params0, extra), (_, _, params1, _) = run_distributed(
        _issued, 2, 1e-4, "unused", init_process_group=False
    )
    assert issued == 2 * n  # counted ready before the backward: no bucket waited for the optimizer step
    assert params0 == params1
    assert torch.equal(extra, torch.ones(3))  # no gradient, as on one device (SGD would not move it anyway)


def test_a_parameter_one_replica_reaches_gets_the_mean_with_the_others_zeros():
    (issued, n, params0, extra0), (_, _, params1, extra1) = run_distributed(
        _issued, 2, 1e-4, "rank0", init_process_group=False
    )
    assert issued == 2 * n and params0 == params1
    # three steps of SGD (lr 0.05, momentum 0.9: 1 + 1.9 + 2.71 gradients) of the mean (1e-3 + 0) / 2 per element
    want = torch.full((3,), 1 - (1 + 1.9 + 2.71) * 0.05 * 5e-4, dtype=torch.float64)
    torch.testing.assert_close(extra0, want, rtol=0, atol=1e-15)
    assert torch.equal(extra0, extra1)


def _reentrant(rank: int, world: int, cap: float) -> tuple[bool | None, list[torch.Tensor]]:
    from torch.utils.checkpoint import checkpoint

    torch.set_default_dtype(torch.float64)
    module, data = build("gpt", 4, "sgd")
    block = module.transformer.h[2]
    forward = block.forward
    block.forward = lambda x: checkpoint(forward, x, use_reentrant=True)  # hides the block's parameters
    strategy = HybridParallelStrategy(data_parallel_size=2, bucket_cap_mb=cap)
    quick_fit(module, data, strategy, world, steps=3, use_distributed_sampler=False)
    enabled = strategy._dp.buckets.enabled if strategy._dp.buckets is not None else None
    return enabled, [p.detach().clone() for p in module.parameters()]


def test_a_reentrant_checkpoint_spoils_the_buckets_and_the_step_is_averaged_again():
    (enabled, params), (_, params1) = run_distributed(_reentrant, 2, 1e-4, init_process_group=False)
    (_, want), _ = run_distributed(_reentrant, 2, 0.0, init_process_group=False)
    assert enabled is False  # turned off at the second step, said once
    for a, b, c in zip(params, params1, want):
        assert torch.equal(a, b) and torch.equal(a, c)


# ------------------------------------------------------------------ composed layouts: the dp mean goes first
class _BucketsWent(L.Callback):
    """At the end of a fit of ``steps`` steps: every bucket of the steps after the first (buckets are made at the
    first step's sync) went during a backward, none at the optimizer step, and the buckets hold every trainable
    parameter of the trunk's blocks this rank holds (under a pipeline: in the unit of its last backward action)."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        buckets = strategy._dp.buckets
        assert buckets is not None and buckets.enabled, "no gradient buckets served this fit"
        assert buckets.issued_in_backward == (self.steps - 1) * len(buckets.buckets), (
            buckets.issued_in_backward,
            len(buckets.buckets),
        )
        blocks = strategy._blocks.trunk.blocks if strategy._blocks is not None else [pl_module]  # (no trunk: dp x ep)
        held = {id(p) for b in blocks for p in b.parameters() if p.requires_grad}
        trainable = {id(p) for p in pl_module.parameters() if p.requires_grad and not p.is_meta}
        layout = strategy._experts.layout  # experts: averaged over their replicas after the backward
        experts = {id(p) for p in layout.params} if layout is not None else set()
        missing = (held & trainable) - {id(p) for p in buckets.params} - experts
        assert not missing, f"{len(missing)} block parameters were averaged after the backward"
        assert not experts & {id(p) for p in buckets.params}, "an expert's gradient went in a dp bucket"


COMPOSED = {
    "pp2-1f1b": (lambda: PipelineParallelStrategy(pipeline_parallel_size=2, data_parallel_size=2,
                                                  num_microbatches=4, bucket_cap_mb=1e-3), "llama"),
    "pp2-interleaved": (lambda: PipelineParallelStrategy(pipeline_parallel_size=2, data_parallel_size=2,
                                                         schedule="interleaved_1f1b", num_microbatches=4,
                                                         bucket_cap_mb=1e-3), "llama"),
    "pp2-zbv": (lambda: PipelineParallelStrategy(pipeline_parallel_size=2, data_parallel_size=2, schedule="zbv",
                                                 num_microbatches=4, bucket_cap_mb=1e-3), "llama"),
    "helix2": (lambda: HelixParallelStrategy(pipeline_parallel_size=2, data_parallel_size=2, bucket_cap_mb=1e-3),
               "llama"),
    "tp2": (lambda: HybridParallelStrategy(data_parallel_size=2, tensor_parallel_size=2, bucket_cap_mb=1e-3),
            "llama"),
    "ulysses2": (lambda: HybridParallelStrategy(data_parallel_size=2, sequence_parallel_size=2, bucket_cap_mb=1e-3),
                 "gpt"),
    "pp2-ep2": (lambda: PipelineParallelStrategy(pipeline_parallel_size=2, data_parallel_size=2, expert_parallel_size=2,
                                                 num_microbatches=4, bucket_cap_mb=1e-3), "hf:mixtral@batched_mm"),
    "ulysses2-ep4": (lambda: HybridParallelStrategy(data_parallel_size=2, sequence_parallel_size=2,
                                                    expert_parallel_size=4, bucket_cap_mb=1e-3), "hf:mixtral@batched_mm"),
}  # fmt: skip
FAST_COMPOSED = {"pp2-1f1b"}  # (time) the others: slow tier


@pytest.mark.parametrize(
    "layout", [pytest.param(k, marks=() if k in FAST_COMPOSED else pytest.mark.slow) for k in COMPOSED]
)
def test_buckets_go_during_the_backward_of_every_layout_with_one_process_training(layout):
    """The dp mean of a layout's gradients taken bucket by bucket during the backward (a pipeline's in each unit's
    last backward action), before the tensor-, sequence- and pipeline-parallel sums: float64 AdamW parity, under
    NCCL's rules (the harness's communication check) with no host tensor in a collective."""
    make, model = COMPOSED[layout]
    assert_parity(model, make, 4, data_parallel_size=2, optimizer="adamw", steps=3, host_check=True,
                  callbacks=lambda: [_BucketsWent(3)])  # fmt: skip


def test_buckets_skip_the_experts_under_expert_parallelism():
    """dp=2 x ep=2 (Mixtral): the non-expert gradients' dp mean goes bucket by bucket during the backward, among the
    experts' all-to-alls (another group: NCCL's rules checked by the harness), the experts' average over their
    replicas after it; float64 AdamW parity."""
    make = lambda: HybridParallelStrategy(data_parallel_size=2, expert_parallel_size=2, bucket_cap_mb=1e-3)  # noqa: E731
    assert_parity("hf:mixtral@batched_mm", make, 2, data_parallel_size=2, optimizer="adamw", steps=3, host_check=True,
                  callbacks=lambda: [_BucketsWent(3)])  # fmt: skip


class _NoBucketWent(L.Callback):
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        buckets = trainer.strategy._dp.buckets
        assert buckets is not None and buckets.enabled and buckets.issued_in_backward == 0, buckets


def test_a_pipeline_with_accumulation_averages_after_the_window():
    """Under a pipeline the schedule's gradients join the earlier batches' after it: buckets serve only
    windows of one batch; with accumulate_grad_batches=2 the average runs after the backward (and is exact). Armed
    there, a bucket would average the last batch's part alone: the storage check would spoil the step (buckets
    off, said once), which this test would see."""
    make = lambda: PipelineParallelStrategy(pipeline_parallel_size=2, data_parallel_size=2,  # noqa: E731
                                            num_microbatches=2, bucket_cap_mb=1e-3)  # fmt: skip
    assert_parity("gpt", make, 4, data_parallel_size=2, steps=2, accumulate_grad_batches=2,
                  callbacks=lambda: [_NoBucketWent()])  # fmt: skip
