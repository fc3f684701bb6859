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


def test_parity_p2_one_fold_two_microbatches_receives_ahead_in_nccls_order():
    """The configuration whose receives posted ahead went out of order (a 32768-byte send into a 49152-byte receive
    under NCCL's matching, from step 2): parity, and assert_parity's communication check finds nothing."""
    assert_parity("llama", helix(pipeline_parallel_size=2, folds=1, num_microbatches=2), 2, data_parallel_size=1)


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


class _PeakLive(L.Callback):
    """Peak live bytes (activations, kept or checkpointed, and gradients) of this rank's schedule."""

    def on_train_batch_start(self, trainer, *args):
        from lightning_parallel.memory import LiveTensorTracker

        runtime = trainer.strategy.runtime
        if getattr(runtime, "_measured", False):
            return
        run = runtime.run

        def measured(*a, **kw):
            with LiveTensorTracker() as tracker:
                out = run(*a, **kw)
            self.peak = tracker.peak
            return out

        runtime.run, runtime._measured = measured, True


def _peak_live(rank, world_size, name):
    import torch

    from examples.data import CharDataModule
    from examples.models import GPT
    from lightning_parallel import PipelineParallelStrategy

    torch.manual_seed(0)
    data = CharDataModule(block_size=256, batch_size=8, shuffle=False)
    module = GPT(vocab_size=data.vocab_size, block_size=256, n_layer=8, n_head=2, n_embd=32, optimizer="sgd")
    strategy = (
        HelixParallelStrategy(pipeline_parallel_size=2, num_microbatches=4)
        if name == "helix"
        else PipelineParallelStrategy(pipeline_parallel_size=2, num_microbatches=4)
    )
    peak = _PeakLive()
    with tempfile.TemporaryDirectory() as root:
        trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=1, logger=False, enable_checkpointing=False, limit_val_batches=0,
                            enable_progress_bar=False, enable_model_summary=False, default_root_dir=root, strategy=strategy,
                            callbacks=[peak])  # fmt: skip
        trainer.fit(module, datamodule=data)
    return peak.peak


def test_peak_live_bytes_are_balanced_across_stages_under_helix_default_recomputation():
    helix_peaks = run_distributed(_peak_live, 2, "helix", init_process_group=False)
    one_f_one_b = run_distributed(_peak_live, 2, "1f1b", init_process_group=False)
    ratio = max(helix_peaks) / min(helix_peaks)
    skew = max(one_f_one_b) / min(one_f_one_b)
    print(
        f"peak live bytes per stage: helix {helix_peaks} (max/min {ratio:.3f}), 1F1B {one_f_one_b} (max/min {skew:.3f})"
    )
    assert ratio <= 1.15, helix_peaks
    assert skew > ratio  # 1F1B keeps p - s micro-batches in flight on stage s


def _bf16(rank, world_size, strategy):
    from tests.helpers.parity import _OneReplicaSampler

    module, data = build("gpt", 8, "sgd")
    with tempfile.TemporaryDirectory() as root:
        trainer = L.Trainer(
            accelerator="cpu", devices=world_size, max_steps=3, logger=False, enable_checkpointing=False,
            limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
            precision="bf16-mixed", strategy=strategy() if strategy else "auto",
            callbacks=[] if strategy else [_OneReplicaSampler()],
        )  # fmt: skip
        trainer.fit(module, datamodule=data)
        return trainer.callback_metrics["train_loss"].item()


def test_bf16_mixed_trains_like_single_device():
    got = run_distributed(_bf16, 2, helix(pipeline_parallel_size=2), init_process_group=False)
    want = _bf16(0, 1, None)
    assert got[0] == got[1] == pytest.approx(want, rel=2e-2)


def test_last_batch_shorter_than_num_microbatches_trains_as_one_device():
    """An epoch's last batch of 3 samples under helix p=2, two folds, m=4: one micro-batch per
    sample and one padding micro-batch of share 0, exactly as one device trains the short batch."""
    from lightning_parallel import HelixParallelStrategy

    strategy = lambda: HelixParallelStrategy(pipeline_parallel_size=2, num_microbatches=4)  # noqa: E731
    assert_parity("gpt", strategy, 2, data_parallel_size=1, steps=2, train_samples=11)


def _pending_sends(rank, world_size):
    import torch

    from examples.data import CharDataModule
    from examples.models import GPT
    from lightning_parallel.pipeline.context import StepContext

    counts = {"posted": 0, "most": 0}
    posted, received = StepContext.posted, StepContext.received

    def count_posted(ctx, microbatch, sends):
        posted(ctx, microbatch, sends)
        counts["posted"] += len(sends)
        counts["most"] = max(counts["most"], sum(len(s) for s in ctx.sends.values()))

    StepContext.posted = count_posted
    try:
        torch.manual_seed(0)
        data = CharDataModule(block_size=64, batch_size=4, shuffle=False)
        module = GPT(vocab_size=data.vocab_size, block_size=64, n_layer=8, n_head=2, n_embd=32, optimizer="sgd")
        with tempfile.TemporaryDirectory() as root:
            trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=1, logger=False, enable_checkpointing=False,
                                limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False,
                                default_root_dir=root, strategy=helix(num_microbatches=4)())  # fmt: skip
            trainer.fit(module, datamodule=data)
    finally:
        StepContext.posted, StepContext.received = posted, received
    return counts


def test_a_stage_holds_a_sent_message_only_until_its_micro_batch_comes_back():
    # a packed message (two sends: header and payload) is a copy; each stage completes its sends of a
    # micro-batch at the micro-batch's next message from the other stage, so few are ever pending at once
    for counts in run_distributed(_pending_sends, 2, init_process_group=False):
        assert counts["posted"] >= 48, counts  # 4 micro-batches x 8 layers: every one of them crosses stages
        assert counts["most"] <= 2 * 2 * 4, counts  # at most two messages per micro-batch in flight
