"""HelixPipe (``strategy="helix"``) against single-process training, its timeline, and bad input."""

import tempfile

import lightning as L
import pytest

from lightning_parallel import HelixParallelStrategy
from lightning_parallel.pipeline.helix_schedule import attention_stage
from tests.helpers.distributed import RankFailed, run_distributed
from tests.helpers.parity import assert_parity, build

MODELS = ["gpt", "llama", "encoder"]


def helix(**kw):
    return lambda: HelixParallelStrategy(**kw)


@pytest.mark.parametrize("model", MODELS)
def test_parity_p2_two_folds_default_recomputation(model):
    assert_parity(model, helix(pipeline_parallel_size=2), 2, data_parallel_size=1)


def test_parity_p4_one_fold_no_recomputation_fp32():
    assert_parity(
        "llama",
        helix(pipeline_parallel_size=4, folds=1, recompute="none", mlp_chunks=1),
        4,
        data_parallel_size=1,
        dtype="float32",
    )


def test_parity_dp2_x_pp2_with_clipping_and_accumulation():
    strategy = helix(pipeline_parallel_size=2, data_parallel_size=2)
    assert_parity(
        "gpt",
        strategy,
        4,
        data_parallel_size=2,
        global_batch=16,
        steps=2,
        accumulate_grad_batches=2,
        gradient_clip_val=0.05,
    )


def test_by_registered_name():
    assert_parity("encoder", lambda: "helix", 2, data_parallel_size=1)


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("folds", [1, 2])
@pytest.mark.parametrize("recompute", ["no_attention", "none"])
def test_matrix(model, p, folds, recompute):
    assert_parity(
        model,
        helix(pipeline_parallel_size=p, folds=folds, recompute=recompute),
        p,
        data_parallel_size=1,
        gradient_clip_val=0.05,
    )


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_matrix_dp2_x_pp2(model):
    assert_parity(
        model, helix(pipeline_parallel_size=2, data_parallel_size=2), 4, data_parallel_size=2, global_batch=16
    )


class _KeepTimeline(L.Callback):
    def on_train_batch_end(self, trainer, *args):
        self.stage, self.timeline = trainer.strategy.stage, list(trainer.strategy.runtime.timeline)


def _timeline(rank, world_size, folds):
    module, data = build("gpt", 8, "sgd")
    keep = _KeepTimeline()
    with tempfile.TemporaryDirectory() as root:
        trainer = L.Trainer(
            accelerator="cpu", devices=world_size, max_steps=1, logger=False, enable_checkpointing=False,
            limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
            strategy=HelixParallelStrategy(pipeline_parallel_size=world_size, folds=folds, num_microbatches=2 * world_size * folds),
            callbacks=[keep],
        )  # fmt: skip
        trainer.fit(module, datamodule=data)
    return keep.stage, keep.timeline


@pytest.mark.parametrize("p,folds", [(2, 2), (4, 1)])
def test_timeline_attention_placement_and_filo(p, folds):
    per_rank = run_distributed(_timeline, p, folds, init_process_group=False)
    attentions = 0
    for stage, timeline in per_rank:
        assert timeline, "the runtime recorded no timeline"
        forward = [(e.kind[1], e.chunk, e.microbatch) for e in timeline if e.kind[0] == "F"]
        backward = [(e.kind[1], e.chunk, e.microbatch) for e in timeline if e.kind[0] == "B"]
        assert backward == forward[::-1], f"stage {stage}: backward order is not the forward order reversed"
        for e in timeline:
            if e.kind == "FA":
                attentions += 1
                assert stage == attention_stage(e.chunk, e.microbatch, p, folds), e
    assert attentions == 8 * 2 * p * folds  # every (layer, micro-batch) once


def test_bad_input():
    with pytest.raises(
        ValueError,
        match=r"helix needs num_microbatches \(6\) to be a multiple of pipeline_parallel_size x folds \(2 x 2 = 4\)",
    ):
        L.Trainer(accelerator="cpu", devices=2, strategy=HelixParallelStrategy(num_microbatches=6))
    with pytest.raises(ValueError, match="folds must be 1 or 2, got 3"):
        HelixParallelStrategy(folds=3)
    with pytest.raises(ValueError, match="helix recomputes everything but attention"):
        HelixParallelStrategy(recompute="full")


def _blocks_not_divisible(rank, world_size):
    module, data = build("hf4", 8, "adamw")  # 4 blocks on 3 stages
    with tempfile.TemporaryDirectory() as root:
        trainer = L.Trainer(accelerator="cpu", devices=3, max_steps=1, logger=False, enable_checkpointing=False,
                            default_root_dir=root, strategy=HelixParallelStrategy(num_microbatches=6))  # fmt: skip
        trainer.fit(module, datamodule=data)


def test_blocks_must_divide_by_stages():
    with pytest.raises(
        RankFailed, match=r"number of blocks \(4\) to be a multiple of the number of pipeline stages \(3\)"
    ):
        run_distributed(_blocks_not_divisible, 3, init_process_group=False)
