"""``data_parallel_sharding="full"`` (FSDP2) above tensor and sequence parallelism and the pipeline, on one
(dp, pp, sp, tp) mesh (torchtitan's composition): parity with one process, what each rank holds, and
checkpoints that resume exactly across these layouts."""

import lightning as L
import pytest
import torch

from lightning_parallel import HybridParallelStrategy, PipelineParallelStrategy
from tests.helpers.distributed import run_distributed
from tests.helpers.parity import assert_parity, build


def full(**kw):
    return lambda: HybridParallelStrategy(data_parallel_size=2, data_parallel_sharding="full", **kw)


def pipeline_full(**kw):
    return lambda: PipelineParallelStrategy(
        pipeline_parallel_size=2, data_parallel_size=2, num_microbatches=4, data_parallel_sharding="full", **kw
    )


@pytest.mark.parametrize("model", ["gpt", pytest.param("llama", marks=pytest.mark.slow)])
def test_dp2_x_tp2(model):
    assert_parity(model, full(tensor_parallel_size=2), 4, data_parallel_size=2, gradient_clip_val=0.05)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["encoder", "hf-llama", "hf-gpt2", "gpt-deferred"])
def test_dp2_x_tp2_matrix(model):
    assert_parity(model, full(tensor_parallel_size=2), 4, data_parallel_size=2)


@pytest.mark.parametrize(  # slow tier (time): dp2 x tp2 full and the quarter-per-rank test are fast
    "mode", [pytest.param("ulysses", marks=pytest.mark.slow), pytest.param("ring", marks=pytest.mark.slow)]
)
def test_dp2_x_sp2(mode):
    assert_parity("llama", full(sequence_parallel_size=2, sequence_parallel_mode=mode), 4, data_parallel_size=2)


@pytest.mark.slow
def test_dp2_x_pp2_x_tp2_on_8_ranks():
    assert_parity("llama", pipeline_full(tensor_parallel_size=2), 8, data_parallel_size=2, global_batch=16)


@pytest.mark.slow
def test_dp2_x_pp2_x_tp2_deferred():
    """A deferred model under pp x dp x tp full: blocks pending until the first step commits and shards them."""
    assert_parity("gpt-deferred", pipeline_full(tensor_parallel_size=2), 8, data_parallel_size=2, global_batch=16)


def _validated(rank: int, world: int, pipeline: bool) -> float:
    from tests.helpers.trainers import quick_fit

    module, data = build("llama", 4, "sgd")
    make = pipeline_full(tensor_parallel_size=2) if pipeline else full(tensor_parallel_size=2)
    trainer = quick_fit(module, data, make(), world, steps=2, limit_val_batches=2, val_check_interval=2,
                        num_sanity_val_steps=1)  # fmt: skip
    return float(trainer.callback_metrics["val_loss"])


@pytest.mark.parametrize("pipeline", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_an_evaluation_before_the_first_step_commits_and_shards_then_training_goes_on(pipeline):
    """The sanity check is the first call: it captures, commits and shards the blocks; the validation after two
    steps equals one device's."""
    from tests.helpers.parity import _OneReplicaSampler
    from tests.helpers.trainers import quick_fit

    module, data = build("llama", 8, "sgd")
    trainer = quick_fit(module, data, "auto", 1, steps=2, limit_val_batches=2, val_check_interval=2,
                        callbacks=[_OneReplicaSampler()])  # fmt: skip
    want = float(trainer.callback_metrics["val_loss"])
    for got in run_distributed(_validated, 8 if pipeline else 4, pipeline, init_process_group=False):
        assert got == pytest.approx(want, rel=1e-5), (got, want)


# ---------------------------------------------------------------------------------------------- what a rank holds
def _held(rank: int, world: int, make) -> dict:
    from lightning_parallel.tensor_parallel import local

    module, data = build("gpt", 4, "adamw")
    sizes: dict = {}

    class Measure(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            params = [p for g in optimizer.param_groups for p in g["params"]]
            sizes["grads"] = sum(local(p.grad).numel() for p in params if p.grad is not None)

    trainer = L.Trainer(
        accelerator="cpu", devices=world, max_steps=1, logger=False, enable_checkpointing=False, callbacks=[Measure()],
        strategy=make(), enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, datamodule=data)
    state = [v for s in trainer.optimizers[0].state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
    sizes["params"] = sum(local(p).numel() for p in module.parameters() if not p.is_meta)
    sizes["state"] = sum(local(v).numel() for v in state)
    sizes["total"] = sum(p.numel() for p in build("gpt", 4, "adamw")[0].parameters())
    return sizes


def test_each_rank_holds_a_quarter_under_dp2_x_tp2_full():
    """Parameters, gradients and AdamW state per rank: within 1.05x of the one-process figure / 4 (the blocks
    cut over tp then dp, the vocabulary over tp then dp; norms and row-parallel biases over dp only)."""
    ranks = run_distributed(_held, 4, full(tensor_parallel_size=2), init_process_group=False)
    total = ranks[0]["total"]
    for r in ranks:
        assert r["params"] <= 1.05 * total / 4, (r, total / 4)
        assert r["grads"] <= 1.05 * total / 4, (r, total / 4)
        assert r["state"] <= 2 * 1.05 * total / 4, (r, total / 4)  # AdamW: exp_avg and exp_avg_sq


# ------------------------------------------------------------------------------------ units outside the trunk
@pytest.mark.parametrize("row", ["hf:bert", "lightning:demo"])
def test_units_outside_the_trunk_that_share_or_read_a_childs_parameters(row):
    """BERT's head shares its bias with its decoder (a child): FSDP2 manages the decoder through the head, so
    the root holds only the units' top modules. Lightning's demo Transformer has nn.MultiheadAttention outside
    the trunk, whose forward reads out_proj.weight without calling out_proj: the two are one unit."""
    assert_parity(row, lambda: HybridParallelStrategy(data_parallel_size=2, data_parallel_sharding="full"), 2,
                  data_parallel_size=2, dtype="float32", steps=2)  # fmt: skip


@pytest.mark.slow
def test_dp2_x_tp2_x_sp2_on_8_ranks():
    """The whole (dp, sp, tp) mesh under full sharding: FSDP2 over dp above tp's shards, ring attention over sp."""
    make = full(tensor_parallel_size=2, sequence_parallel_size=2, sequence_parallel_mode="ring")
    assert_parity("llama", make, 8, data_parallel_size=2, global_batch=16)
