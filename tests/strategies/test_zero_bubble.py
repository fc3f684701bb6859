"""Zero-bubble schedules (``zb_h1``, ``zbv``) against single-process training (docs/design.md, "Parity
tests"): the backward split into input- and weight-gradient actions trains exactly like one backward,
under every recomputation policy, with dp, clipping, accumulation and batches of varying length.

Fast tier: each schedule once per model family and policy kind; the ``slow`` marker runs models x
pp {2, 4} x both schedules x every policy, and dp2 x pp2.
"""

import pytest

from lightning_parallel import PipelineParallelStrategy
from tests.helpers.parity import assert_parity

MODELS = ["gpt", "llama", "encoder"]
POLICIES = ["none", "selective", "no_attention", "full"]


def pipeline(**kwargs):
    return lambda: PipelineParallelStrategy(**kwargs)


# ----------------------------------------------------------------------------------- fast tier
@pytest.mark.parametrize(
    "model,schedule,recompute",
    [
        ("gpt", "zb_h1", "none"),
        ("llama", "zbv", "selective"),
        ("encoder", "zb_h1", "no_attention"),
        ("gpt", "zbv", "full"),
    ],
)
def test_zero_bubble_pp2(model, schedule, recompute):
    strategy = pipeline(pipeline_parallel_size=2, num_microbatches=4, schedule=schedule, recompute=recompute)
    assert_parity(model, strategy, 2, data_parallel_size=1, steps=2, accumulate_grad_batches=2, gradient_clip_val=0.05)


def test_zb_h1_float32_and_batches_of_varying_length():
    strategy = pipeline(pipeline_parallel_size=2, num_microbatches=2, schedule="zb_h1")
    assert_parity("gpt-varlen", strategy, 2, data_parallel_size=1, steps=4)
    strategy = pipeline(pipeline_parallel_size=2, num_microbatches=4, schedule="zbv")
    assert_parity("llama", strategy, 2, data_parallel_size=1, dtype="float32", steps=2, train_samples=11)


def test_zbv_dp2_x_pp2_with_sharded_optimizer_state():
    strategy = pipeline(
        pipeline_parallel_size=2, data_parallel_size=2, num_microbatches=4, schedule="zbv",
        data_parallel_sharding="optimizer", recompute="no_attention",
    )  # fmt: skip
    assert_parity("gpt", strategy, 4, data_parallel_size=2, global_batch=16, steps=2, gradient_clip_val=0.05)


def test_refusals_name_the_argument():
    with pytest.raises(ValueError, match="FSDP2's per-block gradient reduction.*data_parallel_sharding='optimizer'"):
        PipelineParallelStrategy(schedule="zb_h1", data_parallel_size=2, data_parallel_sharding="full")
    with pytest.raises(ValueError, match="'zbv' runs two chunks per stage \\(a V\\); got virtual_stages=3"):
        PipelineParallelStrategy(schedule="zbv", virtual_stages=3)
    with pytest.raises(ValueError, match="virtual_stages=2 needs schedule='interleaved_1f1b'"):
        PipelineParallelStrategy(schedule="zb_h1", virtual_stages=2)


# ------------------------------------------------------------------------------------ slow tier
@pytest.mark.slow
@pytest.mark.parametrize("recompute", POLICIES)
@pytest.mark.parametrize("schedule", ["zb_h1", "zbv"])
@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("model", MODELS)
def test_matrix(model, pp, schedule, recompute):
    strategy = pipeline(pipeline_parallel_size=pp, num_microbatches=8, schedule=schedule, recompute=recompute)
    assert_parity(model, strategy, pp, data_parallel_size=1, steps=2, gradient_clip_val=0.05)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["zb_h1", "zbv"])
@pytest.mark.parametrize("model", MODELS)
def test_matrix_dp2_x_pp2(model, schedule):
    strategy = pipeline(pipeline_parallel_size=2, data_parallel_size=2, num_microbatches=4, schedule=schedule)
    assert_parity(
        model, strategy, 4, data_parallel_size=2, global_batch=16, accumulate_grad_batches=2,
        gradient_clip_val=0.05, steps=2,
    )  # fmt: skip
