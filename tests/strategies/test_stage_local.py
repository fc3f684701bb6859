"""Pre- and post-trunk parameters are stored in shards over the pipeline stages and whole only on the
stages that run them: placement, each stage's share, parity (tied weights over pp=4, a skip from the
embedding to the head, a block argument computed from a parameter, helix), the gathered state.
Validation between steps (the shards gathered for lock-step evaluation) is `test_pipeline_lightning.py`'s
metrics test, checkpoints `test_checkpoints.py`'s."""

from __future__ import annotations

import pytest
import torch

from lightning_parallel import HelixParallelStrategy, HybridParallelStrategy, PipelineParallelStrategy
from tests.helpers.distributed import run_distributed
from tests.helpers.parity import assert_parity, build
from tests.helpers.trainers import quick_fit


def _pp(pp: int = 2, **kwargs):
    return lambda: PipelineParallelStrategy(pipeline_parallel_size=pp, num_microbatches=4, **kwargs)


def _placement(rank, world_size, model, strategy, validate):
    from lightning_parallel.tensor_parallel import local

    module, data = build(model, 8, "adamw")
    kwargs = dict(limit_val_batches=1, val_check_interval=1) if validate else {}
    trainer = quick_fit(module, data, strategy(), world_size, steps=2, **kwargs)
    placement = trainer.strategy.outer_placement
    named = dict(module.named_parameters(remove_duplicate=False))
    stored = {n: local(named[n]).numel() / named[n].numel() for n in placement}  # this stage's share of each
    in_optimizer = {id(p) for g in trainer.optimizers[0].param_groups for p in g["params"]}
    dropped = [n for n, p in module.named_parameters() if not p.is_meta and id(p) not in in_optimizer]
    return trainer.strategy.stage, placement, stored, dropped


def _check_shares(ranks, stages: int) -> None:
    """Every stage stores 1/stages of each sharded parameter (to a row), the shares add up to the whole, and
    each stage's optimizer steps every parameter it stores."""
    names = ranks[0][1]
    assert names and all(placement == names for _, placement, _, _ in ranks)  # the same decision everywhere
    for n in names:
        shares = [stored[n] for _, _, stored, _ in ranks]
        assert abs(sum(shares) - 1.0) < 1e-9, (n, shares)
        assert max(shares) - min(shares) <= 0.5, (n, shares)  # uneven by at most one row of a small tensor
    assert all(not dropped for *_, dropped in ranks)


def test_the_llamas_embedding_runs_on_the_first_stage_and_its_head_on_the_loss_stage():
    ranks = run_distributed(_placement, 2, "llama", _pp(), True, init_process_group=False)
    assert ranks[0][1] == {"embed_tokens.weight": (0,), "norm.weight": (1,), "lm_head.weight": (1,)}
    _check_shares(ranks, 2)


def test_a_tied_embedding_runs_on_the_first_and_the_loss_stage_and_is_stored_over_all_four():
    ranks = run_distributed(_placement, 4, "gpt", _pp(4), False, init_process_group=False)
    placement = ranks[0][1]
    assert placement["transformer.wte.weight"] == placement["lm_head.weight"] == (0, 3)
    assert placement["transformer.wpe.weight"] == (0,)
    assert placement["transformer.ln_f.weight"] == (3,)
    _check_shares(ranks, 4)


def test_helix_runs_the_embedding_and_head_on_its_stage_zero():
    ranks = run_distributed(
        _placement, 2, "llama", lambda: HelixParallelStrategy(pipeline_parallel_size=2), False,
        init_process_group=False,
    )  # fmt: skip
    assert ranks[0][1] == {"embed_tokens.weight": (0,), "norm.weight": (0,), "lm_head.weight": (0,)}
    _check_shares(ranks, 2)


def test_a_tied_embedding_over_four_stages_trains_with_parity():
    assert_parity("gpt", _pp(4), 4, data_parallel_size=1, gradient_clip_val=0.05)


def test_a_skip_from_the_embedding_to_the_head_runs_the_embedding_on_the_loss_stage_too():
    ranks = run_distributed(_placement, 2, "llama-skip", _pp(), False, init_process_group=False)
    assert ranks[0][1]["embed_tokens.weight"] == (0, 1)
    assert_parity("llama-skip", _pp(), 2, data_parallel_size=1, gradient_clip_val=0.05)


def test_a_block_argument_computed_from_a_parameter_keeps_everything_everywhere():
    ranks = run_distributed(_placement, 2, "llama-learned-rope", _pp(), False, init_process_group=False)
    placement = ranks[0][1]
    assert placement["embed_tokens.weight"] == placement["lm_head.weight"] == (0, 1)  # whole on both in a step
    assert "rope_scale" not in placement  # 0-dim: never sharded
    assert_parity("llama-learned-rope", _pp(), 2, data_parallel_size=1)


@pytest.mark.slow  # (time) test_helix's dp2 x pp2 with clipping and accumulation is fast
def test_pp2_x_dp2_with_helix_and_accumulation():
    make = lambda: HelixParallelStrategy(pipeline_parallel_size=2, data_parallel_size=2)  # noqa: E731
    assert_parity("llama", make, 4, data_parallel_size=2, accumulate_grad_batches=2, steps=2)


def test_the_gathered_full_state_holds_every_parameter():
    def run(rank, world_size):
        module, data = build("llama", 8, "adamw")
        trainer = quick_fit(module, data, _pp()(), world_size, steps=1)
        state = trainer.strategy.full_state_dict()
        return sorted(state), {k: tuple(v.shape) for k, v in state.items()}

    names, shapes = run_distributed(run, 2, init_process_group=False)[0]
    module, _ = build("llama", 8, "adamw")
    assert names == sorted(module.state_dict())
    assert all(shapes[k] == tuple(v.shape) for k, v in module.state_dict().items())


def _saves_in_validation(rank, world_size, directory):
    import lightning as L

    from lightning_parallel.checkpoint import load_sharded

    module, data = build("gpt", 8, "adamw")
    seen = []

    class SaveInValidation(L.Callback):  # what ModelCheckpoint does at a validation end
        def on_validation_end(self, trainer, pl_module):
            path = f"{directory}/batch{len(seen)}.ckpt"
            trainer.save_checkpoint(path)
            seen.append((path, trainer.strategy.full_state_dict(), trainer.strategy._outer.state))

    quick_fit(
        module, data, _pp()(), world_size, steps=2, limit_val_batches=1, val_check_interval=1,
        accumulate_grad_batches=2, callbacks=[SaveInValidation()],
    )  # fmt: skip
    out = []
    for path, whole, state in seen:
        saved = load_sharded(path)
        out.append((state, {k: v for k, v in saved["state_dict"].items()}, whole, saved["optimizer_states"][0]))
    return out


def test_a_checkpoint_saved_inside_validation_holds_every_parameter_and_its_optimizer_state(tmp_path):
    """Validation after every batch with gradient accumulation over two: it runs once mid-accumulation (the
    step's tensors in the module) and once after the optimizer step (the shards); both checkpoints hold the
    whole model as the strategy gathers it, and optimizer state for every parameter once a step was taken."""
    seen = run_distributed(_saves_in_validation, 2, str(tmp_path), init_process_group=False)[0]
    assert [state for state, *_ in seen][:2] == ["step-eval", "eval"]
    names = {n for n, _ in build("gpt", 8, "adamw")[0].named_parameters()}
    for i, (_, on_disk, whole, optimizer) in enumerate(seen):
        assert set(whole) <= set(on_disk)
        for k, v in whole.items():
            torch.testing.assert_close(on_disk[k], v, rtol=0, atol=0, msg=lambda m, k=k: f"{k}: {m}")
        if i >= 1:  # after the first optimizer step: every parameter's AdamW state, by name
            assert set(optimizer["state"]) == names


def test_foreach_optimizers_and_clipping_by_value_step_shards_next_to_plain_parameters():
    """The sharded embedding (DTensors) and the plain blocks share one param group: torch's foreach kernels
    (its optimizers' default on CUDA, and ``clip_grad_value_``'s everywhere) refuse such a list, so the
    group steps tensor by tensor and clipping by value clamps each local gradient, with parity."""
    kwargs = dict(optimizer="adamw-foreach", gradient_clip_val=0.002, gradient_clip_algorithm="value")
    assert_parity("gpt", _pp(), 2, data_parallel_size=1, **kwargs)


def test_foreach_optimizers_and_clipping_by_value_under_tensor_parallelism():
    """The same mix under tensor parallelism: sharded block and vocabulary parameters, plain norms."""
    kwargs = dict(optimizer="adamw-foreach", gradient_clip_val=0.002, gradient_clip_algorithm="value")
    make = lambda: HybridParallelStrategy(data_parallel_size=1, tensor_parallel_size=2)  # noqa: E731
    assert_parity("gpt", make, 2, data_parallel_size=1, **kwargs)


def _validate_then_fit(rank, world_size, layout, validate_first):
    import lightning as L

    module, data = build("gpt-deferred" if layout.endswith("deferred") else "llama", 8, "adamw")
    strategy = {
        "pipeline": _pp(),
        "helix": lambda: HelixParallelStrategy(pipeline_parallel_size=2),
        "helix-deferred": lambda: HelixParallelStrategy(pipeline_parallel_size=2),
        "tp-deferred": lambda: HybridParallelStrategy(data_parallel_size=1, tensor_parallel_size=2),
    }[layout]()
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_steps=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=1,
    )  # fmt: skip
    if validate_first:  # set up once for validation (the outer part is sharded there), then again for fit
        trainer.validate(module, datamodule=data)
    trainer.fit(module, datamodule=data)
    return {k: v for k, v in trainer.strategy.gather_named_parameters().items()}


@pytest.mark.parametrize(
    "layout",
    [
        "pipeline",
        pytest.param("helix", marks=pytest.mark.slow),
        "helix-deferred",
        pytest.param("tp-deferred", marks=pytest.mark.slow),
    ],
)  # helix-deferred sets up helix twice too (tp-deferred: slow tier, time)
def test_validate_then_fit_with_one_strategy_trains_like_fit_alone(layout):
    """A second set-up must not broadcast the stored shards as if every stage held the same values; a
    deferred block first called by validation materialises there (helix: whole, until the first step splits
    it) with the values it would get at the first training step."""
    alone = run_distributed(_validate_then_fit, 2, layout, False, init_process_group=False)[0]
    after = run_distributed(_validate_then_fit, 2, layout, True, init_process_group=False)[0]
    assert alone.keys() == after.keys()
    for k in alone:
        torch.testing.assert_close(after[k], alone[k], rtol=0, atol=0, msg=lambda m, k=k: f"{k}: {m}")


def _stop_mid_accumulation(rank, world_size):
    import lightning as L
    from torch.distributed.tensor import DTensor

    module, data = build("llama", 8, "adamw")

    class StopAfterFirstBatch(L.Callback):  # what max_time= or an early stop does between two batches
        def on_train_batch_end(self, trainer, *args):
            trainer.should_stop = True

    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=_pp()(), max_steps=4, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=1, accumulate_grad_batches=2, callbacks=[StopAfterFirstBatch()],
    )  # fmt: skip
    trainer.fit(module, datamodule=data)
    steps = trainer.global_step
    outer = {n: isinstance(p, DTensor) for n, p in module.named_parameters() if not n.startswith("layers.")}
    before = trainer.strategy.gather_named_parameters()
    trainer.validate(module, datamodule=data)  # set up again: every stage must agree on what it broadcasts
    after = trainer.strategy.gather_named_parameters()
    return steps, outer, trainer.strategy._outer.state, all(torch.equal(before[k], after[k]) for k in before)


def test_a_fit_stopped_while_gradients_accumulate_leaves_the_shards_in_the_module():
    for steps, outer, state, unchanged in run_distributed(_stop_mid_accumulation, 2, init_process_group=False):
        assert steps == 0  # stopped after the first of two accumulated batches: no optimizer step
        assert state == "rest" and all(outer.values()), outer
        assert unchanged  # validation changes nothing


def _rows(rank, world_size):
    import torch.distributed as dist

    from lightning_parallel import _collectives

    full = torch.arange(7 * 2, dtype=torch.float64).view(7, 2)
    chunks = list(full.chunk(world_size))  # DTensor's Shard(0) cut: 3, 3, 1 rows
    mine = chunks[rank] if rank < len(chunks) else full[:0]
    whole = _collectives.gather_rows(mine, 7, dist.group.WORLD, [2, 0])
    grad = full * (rank + 1) if rank in (0, 2) else None
    summed = _collectives.scatter_rows_sum(grad, mine, 7, dist.group.WORLD, [0, 2])
    return whole, summed, mine


def test_gather_rows_and_scatter_rows_sum_reach_only_the_ranks_that_run_the_parameter():
    """The step's gather and reduction when only some ranks run a parameter (the embedding on the first
    stage): the running ranks get the whole tensor, the others send their shard only; each rank gets its
    chunk of the running ranks' summed gradients."""
    for rank, (whole, summed, mine) in enumerate(run_distributed(_rows, 3)):
        if rank in (0, 2):
            torch.testing.assert_close(whole, torch.arange(14, dtype=torch.float64).view(7, 2), rtol=0, atol=0)
        else:
            assert whole is None
        torch.testing.assert_close(summed, mine * 4, rtol=0, atol=0)  # 1x + 3x the full tensor, this chunk
