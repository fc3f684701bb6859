"""A mixture's load-balancing loss (transformers' ``load_balancing_loss_func``, Switch Transformer's
``E · Σ_e f_e · P_e``: a product of two means over the batch's tokens) under every layout that splits the batch's
tokens over ranks: each rank computes it over every rank's router logits (lightning_parallel/anatomy/router_losses.py), as
one process does (Mixtral, ``output_router_logits=True``, coefficient 0.5 so that a wrong loss shows)."""

from __future__ import annotations

import tempfile

import lightning as L
import pytest
import torch.nn.functional as F

from lightning_parallel import HelixParallelStrategy, HybridParallelStrategy, PipelineParallelStrategy
from tests.helpers.distributed import run_distributed
from tests.helpers.parity import _OneReplicaSampler, assert_parity, build

pytest.importorskip("transformers")

ROW = "hf:mixtral@batched_mm+aux"


@pytest.mark.parametrize("ep", [1, 2])
def test_over_data_parallel_replicas_with_and_without_expert_parallelism(ep):
    """dp=2 (ep=1 and 2), float64: SGD, because transformers sums the router probabilities in float32 whatever the
    model's dtype and the replicas' tokens come in another order than one process's, so the loss agrees to
    float32's rounding: Adam turns that into updates 1e-8 off, SGD keeps the contract's 1e-9."""
    strategy = lambda: HybridParallelStrategy(data_parallel_size=2, expert_parallel_size=ep)  # noqa: E731
    assert_parity(ROW, strategy, 2, data_parallel_size=2, optimizer="sgd")


@pytest.mark.parametrize(
    "kwargs",
    [dict(sequence_parallel_size=2), dict(tensor_parallel_size=2),
     pytest.param(dict(sequence_parallel_size=2, data_parallel_size=2), marks=pytest.mark.slow),
     pytest.param(dict(sequence_parallel_size=2, data_parallel_size=2, expert_parallel_size=4), marks=pytest.mark.slow)],
)  # fmt: skip
def test_over_sequence_shards_and_under_tensor_parallelism(kwargs):
    """Sequence shards (their gradients summed: a shard's logits count once; also with ep over replicas and shards)
    and tensor parallelism (the blocks' verification copies no longer add their router logits to the model's): float32, SGD (Mixtral's norms compute in
    float32, so these layouts are float32-exact without the loss too)."""
    world = 4 if kwargs.get("data_parallel_size") else 2
    dp = kwargs.get("data_parallel_size", 1)
    assert_parity(ROW, lambda: HybridParallelStrategy(**kwargs), world, data_parallel_size=dp, dtype="float32")


# the balancing loss's value is float32 sums (transformers' own, whatever the model's dtype): the pipeline adds them
# per stage and micro-batch, so the loss agrees to float32's rounding of that term (one ulp of it: 2.4e-8 of the step's
# loss here); every parameter keeps float64's 1e-9, since the gradient the loss stage sends back is one device's
FLOAT32_SUMS = 1e-7


@pytest.mark.parametrize(
    "kwargs, world",
    [(dict(), 2),
     pytest.param(dict(data_parallel_size=2), 4, marks=pytest.mark.slow),
     pytest.param(dict(data_parallel_size=2, expert_parallel_size=2), 4, marks=pytest.mark.slow),
     pytest.param(dict(data_parallel_size=2, data_parallel_sharding="optimizer"), 4, marks=pytest.mark.slow),
     pytest.param(dict(data_parallel_size=2, data_parallel_sharding="full"), 4, marks=pytest.mark.slow),
     pytest.param(dict(sequence_parallel_size=2), 4, marks=pytest.mark.slow),
     pytest.param(dict(recompute="full"), 2, marks=pytest.mark.slow),
     pytest.param(dict(recompute="selective"), 2, marks=pytest.mark.slow),
     pytest.param(dict(schedule="1f1b", num_microbatches=1), 2, marks=pytest.mark.slow),
     pytest.param(dict(schedule="interleaved_1f1b", num_microbatches=2, row=ROW + "#4"), 2, marks=pytest.mark.slow),
     pytest.param(dict(schedule="zb_h1", num_microbatches=1), 2, marks=pytest.mark.slow)],
)  # fmt: skip
def test_over_pipeline_stages(kwargs, world):
    """pp=2 under GPipe (4 micro-batches; with dp, dp x ep, ZeRO, FSDP2, sp, full and selective recomputation, one micro-batch under 1F1B and ZB-H1, interleaved 1F1B with as many as stages: every
    schedule that runs every forward first):
    every stage sums its own routers' calls, the loss stage computes the batch's loss from the totals and sends its
    gradient back (lightning_parallel/pipeline/balancing.py); float64, SGD as over the replicas."""
    kwargs = dict(dict(schedule="gpipe"), **kwargs)
    dp, row = kwargs.get("data_parallel_size", 1), kwargs.pop("row", ROW)
    strategy = lambda: PipelineParallelStrategy(pipeline_parallel_size=2, **kwargs)  # noqa: E731
    assert_parity(row, strategy, world, data_parallel_size=dp, optimizer="sgd", loss_rtol=FLOAT32_SUMS)


@pytest.mark.slow
def test_over_pipeline_stages_with_an_attention_mask():
    """Padded rows (an attention mask): every stage weights its routers' rows by the model's mask, kept from the
    micro-batch's capture (the loss stage checks the loss is given the same); and the gradient stays exact with it."""
    strategy = lambda: PipelineParallelStrategy(pipeline_parallel_size=2, schedule="gpipe")  # noqa: E731
    assert_parity(ROW + "+mask", strategy, 2, data_parallel_size=1, optimizer="sgd", loss_rtol=FLOAT32_SUMS)


@pytest.mark.slow
@pytest.mark.parametrize("kwargs, world", [(dict(), 2), (dict(tensor_parallel_size=2), 4)])
def test_over_pipeline_stages_float32(kwargs, world):
    """The float32 tier of the same (the contract's SGD at 1e-5, losses included), and with tp (Mixtral's norms
    compute in float32, so tp is float32-exact only, with or without the loss)."""
    strategy = lambda: PipelineParallelStrategy(pipeline_parallel_size=2, schedule="gpipe", **kwargs)  # noqa: E731
    assert_parity(ROW, strategy, world, data_parallel_size=1, dtype="float32")


@pytest.mark.slow
def test_over_pipeline_stages_with_padding_microbatches():
    """A batch of 2 samples in 4 micro-batches: the two padding micro-batches (copies of the last sample, weight 0)
    count in no sum."""
    strategy = lambda: PipelineParallelStrategy(pipeline_parallel_size=2, schedule="gpipe", num_microbatches=4)  # noqa: E731
    assert_parity(ROW, strategy, 2, data_parallel_size=1, optimizer="sgd", global_batch=2, loss_rtol=FLOAT32_SUMS)


@pytest.mark.slow
def test_qwen3_moe_over_pipeline_stages():
    """Another family (its own router class and load_balancing_loss_func)."""
    strategy = lambda: PipelineParallelStrategy(pipeline_parallel_size=2, schedule="gpipe")  # noqa: E731
    assert_parity("hf:qwen3_moe+aux", strategy, 2, data_parallel_size=1, optimizer="sgd", loss_rtol=FLOAT32_SUMS)


@pytest.mark.parametrize(
    "kwargs, world",
    [(dict(), 2), pytest.param(dict(data_parallel_size=2), 4, marks=pytest.mark.slow),
     pytest.param(dict(sequence_parallel_size=2), 4, marks=pytest.mark.slow),
     pytest.param(dict(data_parallel_size=2, expert_parallel_size=2), 4, marks=pytest.mark.slow)],
)  # fmt: skip
def test_over_helix_stages(kwargs, world):
    """Helix (p=2, every forward first in its FILO schedule, recompute='none'): each stage sums the routers of the
    post-attention parts it runs; with dp, sp and dp x ep."""
    dp = kwargs.get("data_parallel_size", 1)
    strategy = lambda: HelixParallelStrategy(pipeline_parallel_size=2, recompute="none", mlp_chunks=1, **kwargs)  # noqa: E731
    assert_parity(ROW, strategy, world, data_parallel_size=dp, optimizer="sgd", loss_rtol=FLOAT32_SUMS)


def test_helix_with_its_recomputation_or_mlp_chunks_refuses_it_naming_both():
    with pytest.raises(Exception, match=r"under helix its load-balancing loss needs recompute='none' and mlp_chunks=1"):
        assert_parity(ROW, lambda: HelixParallelStrategy(pipeline_parallel_size=2), 2, data_parallel_size=1)


@pytest.mark.slow
def test_helix_with_tensor_parallelism_refuses_it_before_training():
    """helix x tp's split blocks call the routers without their modules' hooks: refused at set-up (the step's count
    of router calls would catch it too, after the forwards)."""
    make = lambda: HelixParallelStrategy(pipeline_parallel_size=2, tensor_parallel_size=2, recompute="none",  # noqa: E731
                                         mlp_chunks=1)  # fmt: skip
    with pytest.raises(Exception, match=r"helix x tensor parallelism does not compute its load-balancing loss"):
        assert_parity(ROW, make, 4, data_parallel_size=1, dtype="float32")


@pytest.mark.slow
def test_mlp_chunks_are_refused_naming_mlp_chunks_1():
    """Each router would run once per slice of the sequence, its rows no longer the attention mask's."""
    make = lambda: PipelineParallelStrategy(pipeline_parallel_size=2, schedule="gpipe", mlp_chunks=2)  # noqa: E731
    with pytest.raises(Exception, match=r"with mlp_chunks=2 each router runs once per slice.*use mlp_chunks=1"):
        assert_parity(ROW, make, 2, data_parallel_size=1)


def test_under_a_schedule_that_interleaves_backwards_it_is_refused():
    """1F1B runs micro-batch 0's backward before micro-batch 3's forward: the batch's loss is not known yet."""
    with pytest.raises(Exception, match=r"use schedule='gpipe'"):
        assert_parity(ROW, lambda: PipelineParallelStrategy(pipeline_parallel_size=2), 2, data_parallel_size=1)


def _validation_step(self, batch, batch_idx):
    idx, targets = batch
    out = self.model(input_ids=idx)
    loss = F.cross_entropy(out.logits.flatten(0, 1), targets.flatten())
    self.log_dict({"val_loss": loss + self.model.config.router_aux_loss_coef * out.aux_loss, "val_aux": out.aux_loss})


def _fit_then_validate(rank, world_size, pipelined):
    module, data = build(ROW, 8, "sgd")
    module.__class__ = type("Validated", (type(module),), {"validation_step": _validation_step})
    strategy = PipelineParallelStrategy(pipeline_parallel_size=2, schedule="gpipe") if pipelined else "auto"
    with tempfile.TemporaryDirectory() as root:
        trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, precision="64-true", logger=False,
                            enable_progress_bar=False, enable_model_summary=False, default_root_dir=root, max_steps=2,
                            limit_val_batches=2, num_sanity_val_steps=0, enable_checkpointing=False,
                            callbacks=[] if pipelined else [_OneReplicaSampler()])  # fmt: skip
        trainer.fit(module, datamodule=data)
        return trainer.validate(module, datamodule=data, verbose=False)[0]


def test_validation_under_a_pipeline_sums_every_stage():
    """Lock-step evaluation: each stage's model call holds its own routers' logits only; the loss is computed from
    every stage's sums (``pipeline.balancing.over_stages``), as one device computes it."""
    ranks = run_distributed(_fit_then_validate, 2, True, init_process_group=False)
    single = _fit_then_validate(0, 1, False)
    for got in ranks:
        assert got.keys() == single.keys() == {"val_loss", "val_aux"}
        for key, want in single.items():
            assert got[key] == pytest.approx(want, rel=1e-7), key
