"""PipelineParallelStrategy against single-process training (docs/design.md, "Parity tests").

The fast tier covers every schedule, model family, dtype and Lightning feature once; the ``slow``
marker runs the full matrix: models x pp {2, 4} x schedules x m {1, 4, 8} x dtypes, with
gradient clipping on and accumulate_grad_batches in {1, 2}.
"""

import pytest

from lightning_parallel import PipelineParallelStrategy
from tests.helpers.parity import assert_parity

MODELS = ["gpt", "llama", "encoder"]


def pipeline(**kwargs):
    return lambda: PipelineParallelStrategy(**kwargs)


# ----------------------------------------------------------------------------------- fast tier
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_1f1b_pp2(model, dtype):
    assert_parity(model, pipeline(pipeline_parallel_size=2, num_microbatches=4), 2, data_parallel_size=1, dtype=dtype)


@pytest.mark.parametrize("schedule,v", [("gpipe", None), ("interleaved_1f1b", 2)])
def test_other_schedules_pp2(schedule, v):
    strategy = pipeline(pipeline_parallel_size=2, num_microbatches=4, schedule=schedule, virtual_stages=v)
    assert_parity("llama", strategy, 2, data_parallel_size=1)


def test_1f1b_pp4_with_clipping_and_accumulation():
    strategy = pipeline(pipeline_parallel_size=4, num_microbatches=8)
    assert_parity("gpt", strategy, 4, data_parallel_size=1, steps=2, accumulate_grad_batches=2, gradient_clip_val=0.05)


def test_dp2_x_pp2():
    strategy = pipeline(pipeline_parallel_size=2, data_parallel_size=2, num_microbatches=2)
    assert_parity("encoder", strategy, 4, data_parallel_size=2, gradient_clip_val=0.05, global_batch=8)


def test_clipping_uses_the_global_norm():
    # a clip value far below the gradient norm: every step is clipped, by the norm over all stages
    strategy = pipeline(pipeline_parallel_size=2, num_microbatches=4)
    assert_parity("gpt", strategy, 2, data_parallel_size=1, dtype="float32", gradient_clip_val=0.01)


@pytest.mark.parametrize("recompute_in", ["strategy", "model"])
def test_recomputation_keeps_parity_when_recompute_runs_after_later_forwards(recompute_in):
    # 1F1B with m=4 at pp=2: stage 0 recomputes micro-batch i after the forward of i+1
    if recompute_in == "strategy":
        assert_parity(
            "gpt", pipeline(pipeline_parallel_size=2, num_microbatches=4, recompute="full"), 2, data_parallel_size=1
        )
    else:  # the user's own torch.utils.checkpoint inside a block
        assert_parity("llama-ckpt", pipeline(pipeline_parallel_size=2, num_microbatches=4), 2, data_parallel_size=1)


def test_uneven_microbatches_and_last_batch_are_weighted_by_share():
    # batches of 8 split 3/3/2, and the epoch's last batch of 4 splits 2/1/1
    strategy = pipeline(pipeline_parallel_size=2, num_microbatches=3)
    assert_parity("gpt", strategy, 2, data_parallel_size=1, steps=3, train_samples=20)


@pytest.mark.parametrize(
    "model,kwargs",
    [
        ("gpt", dict(schedule="1f1b")),
        ("llama", dict(schedule="gpipe")),
        ("gpt", dict(schedule="interleaved_1f1b", virtual_stages=2)),
        ("gpt-sum", dict(schedule="1f1b", loss_reduction="sum")),
    ],
)
def test_last_batch_shorter_than_num_microbatches_trains_as_one_device(model, kwargs):
    # batches of 8 in 4 micro-batches, then the epoch's last batch of 3: 3 micro-batches of one sample + padding
    strategy = pipeline(pipeline_parallel_size=2, num_microbatches=4, **kwargs)
    assert_parity(model, strategy, 2, data_parallel_size=1, steps=2, train_samples=11)


def test_loss_reduction_sum():
    strategy = pipeline(pipeline_parallel_size=2, num_microbatches=4, loss_reduction="sum")
    assert_parity("gpt-sum", strategy, 2, data_parallel_size=1)


def test_hugging_face_style_blocks_with_tuple_outputs_and_kwargs():
    assert_parity("hf", pipeline(pipeline_parallel_size=2, num_microbatches=4), 2, data_parallel_size=1)


def test_batches_of_varying_sequence_length():
    assert_parity(
        "gpt-varlen", pipeline(pipeline_parallel_size=2, num_microbatches=2), 2, data_parallel_size=1, steps=4
    )


def test_layers_per_stage_and_by_name():
    assert_parity(
        "gpt", pipeline(pipeline_parallel_size=2, num_microbatches=2, layers_per_stage=[3, 5]), 2, data_parallel_size=1
    )
    assert_parity("gpt", lambda: "pipeline", 2, data_parallel_size=1)


# ------------------------------------------------------------------------------------ slow tier
MATRIX = [
    (model, pp, schedule, m, dtype)
    for model in MODELS
    for pp in (2, 4)
    for schedule in ("gpipe", "1f1b", "interleaved_1f1b")
    for m in (1, 4, 8)
    for dtype in ("float64", "float32")
]


@pytest.mark.slow
@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("model,pp,schedule,m,dtype", MATRIX)
def test_matrix(model, pp, schedule, m, dtype, accumulate):
    strategy = pipeline(pipeline_parallel_size=pp, num_microbatches=m, schedule=schedule)
    run = lambda: assert_parity(  # noqa: E731
        model, strategy, pp, data_parallel_size=1, dtype=dtype, steps=2, global_batch=8,
        accumulate_grad_batches=accumulate, gradient_clip_val=0.05,
    )  # fmt: skip
    if schedule == "interleaved_1f1b" and m % pp:
        with pytest.raises(
            Exception, match=rf"num_microbatches \({m}\) to be a multiple of the number of pipeline stages \({pp}\)"
        ):
            run()
    else:
        run()


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b"])
def test_matrix_dp2_x_pp2(model, schedule):
    strategy = pipeline(pipeline_parallel_size=2, data_parallel_size=2, num_microbatches=4, schedule=schedule)
    assert_parity(
        model,
        strategy,
        4,
        data_parallel_size=2,
        global_batch=16,
        accumulate_grad_batches=2,
        gradient_clip_val=0.05,
        steps=2,
    )
