"""Recomputation under the strategies: parity with single-process training (no recomputation there),
and the attention kernel count of ``no_attention`` across pipeline stages."""

import tempfile

import lightning as L
import pytest
import torch

from lightning_parallel import HybridParallelStrategy, PipelineParallelStrategy
from lightning_parallel.memory import LiveTensorTracker
from lightning_parallel.recompute import POLICIES
from tests.helpers.distributed import run_distributed
from tests.helpers.parity import assert_parity, build

MODELS = ["gpt", "llama", "encoder"]
FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


def pipeline(**kw):
    return lambda: PipelineParallelStrategy(pipeline_parallel_size=2, num_microbatches=4, **kw)


@pytest.mark.parametrize(
    "model,kw",
    [
        ("gpt", dict(recompute="no_attention")),
        ("llama", dict(recompute="selective", mlp_chunks=2)),
        ("encoder", dict(recompute="every_n", recompute_every_n=3)),
        ("llama", dict(recompute="no_attention", mlp_chunks=4)),
    ],
)
def test_pipeline_pp2_parity_with_recomputation(model, kw):
    assert_parity(model, pipeline(**kw), 2, data_parallel_size=1)


def test_hybrid_dp2_parity_with_no_attention_and_chunked_mlp():
    strategy = lambda: HybridParallelStrategy(data_parallel_size=2, recompute="no_attention", mlp_chunks=2)  # noqa: E731
    assert_parity("gpt", strategy, 2, data_parallel_size=2)


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("mlp_chunks", [1, 2])
def test_matrix_pipeline_pp2(model, policy, mlp_chunks):
    assert_parity(model, pipeline(recompute=policy, mlp_chunks=mlp_chunks), 2, data_parallel_size=1)


def _count_attention(rank, world_size, policy):
    module, data = build("gpt", 8, "sgd")  # 8 blocks
    with tempfile.TemporaryDirectory() as root:
        trainer = L.Trainer(
            accelerator="cpu", devices=2, max_steps=1, logger=False, enable_checkpointing=False, limit_val_batches=0,
            enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
            strategy=PipelineParallelStrategy(pipeline_parallel_size=2, num_microbatches=4, recompute=policy),
        )  # fmt: skip
        with LiveTensorTracker() as tracker:
            trainer.fit(module, datamodule=data)
    return tracker.counts[FLASH]


def test_no_attention_runs_exactly_l_times_m_attention_kernels_per_step():
    counts = run_distributed(_count_attention, 2, "no_attention", init_process_group=False)
    assert counts == [16, 16] and sum(counts) == 8 * 4  # L=8 blocks x m=4 micro-batches
    full = run_distributed(_count_attention, 2, "full", init_process_group=False)
    assert sum(full) == 2 * 8 * 4  # full recomputation re-runs every attention once more


def test_bad_recompute_arguments_fail_at_construction():
    with pytest.raises(ValueError, match="unknown recompute policy 'attention'"):
        PipelineParallelStrategy(recompute="attention")
    with pytest.raises(ValueError, match="recompute_every_n must be an int >= 1, got 0"):
        HybridParallelStrategy(recompute="every_n", recompute_every_n=0)
    with pytest.raises(ValueError, match="mlp_chunks must be an int >= 1, got 0"):
        HybridParallelStrategy(mlp_chunks=0)


@pytest.mark.parametrize(
    "make, dp",
    [
        pytest.param(pipeline(recompute="no_attention", recompute_offload=True), 1, id="pipeline-no_attention"),
        pytest.param(
            lambda: HybridParallelStrategy(
                data_parallel_size=1, tensor_parallel_size=2, recompute="selective", recompute_offload=True
            ),
            1,
            id="tp2-selective",
        ),  # fmt: skip
        pytest.param(
            lambda: HybridParallelStrategy(
                sequence_parallel_size=2,
                sequence_parallel_mode="ring",
                recompute="no_attention",
                recompute_offload=True,
            ),
            1,
            id="ring-no_attention",
        ),  # fmt: skip
        pytest.param(lambda: HybridParallelStrategy(data_parallel_size=2, recompute_offload=True), 2, id="dp2-none"),
    ],
)
def test_offloaded_activations_train_exactly(make, dp):
    """recompute_offload=True: the policy's kept tensors wait in host memory (lightning_parallel/offload.py); the
    outputs of asynchronous collectives (tensor parallelism) stay on the device."""
    assert_parity("llama", make, 2, data_parallel_size=dp)


def test_helix_refuses_offload():
    from lightning_parallel import HelixParallelStrategy

    with pytest.raises(ValueError, match="helix with recompute_offload=True is not supported"):
        HelixParallelStrategy(pipeline_parallel_size=2, recompute_offload=True)
