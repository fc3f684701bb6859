"""Pre- and post-trunk parameters live on the pipeline stages that use them: placement, parity (tied
weights over pp=4, a skip from the embedding to the head, a block argument computed from a parameter,
helix), the gathered state. Validation between steps (the freed parameters gathered for lock-step
evaluation) is `test_pipeline_lightning.py`'s metrics test, checkpoints `test_checkpoints.py`'s."""

from __future__ import annotations

from lightning_parallel import HelixParallelStrategy, PipelineParallelStrategy
from tests.helpers.distributed import run_distributed
from tests.helpers.parity import assert_parity, build
from tests.helpers.trainers import quick_fit


def _pp(pp: int = 2, **kwargs):
    return lambda: PipelineParallelStrategy(pipeline_parallel_size=pp, num_microbatches=4, **kwargs)


def _placement(rank, world_size, model, strategy, validate):
    module, data = build(model, 8, "adamw")
    kwargs = dict(limit_val_batches=1, val_check_interval=1) if validate else {}
    trainer = quick_fit(module, data, strategy(), world_size, steps=2, **kwargs)
    held = {n for n, p in module.named_parameters(remove_duplicate=False) if not p.is_meta}
    in_optimizer = {id(p) for g in trainer.optimizers[0].param_groups for p in g["params"]}
    dropped = [n for n, p in module.named_parameters() if not p.is_meta and id(p) not in in_optimizer]
    return trainer.strategy.stage, held, dropped


def _outer(held: set[str]) -> set[str]:
    return {n for n in held if not n.startswith(("layers.", "transformer.h."))}


def test_the_llamas_embedding_is_on_the_first_stage_and_its_head_on_the_loss_stage():
    ranks = run_distributed(_placement, 2, "llama", _pp(), True, init_process_group=False)
    by_stage = {stage: _outer(held) for stage, held, _ in ranks}
    assert by_stage[0] == {"embed_tokens.weight"}
    assert by_stage[1] == {"norm.weight", "lm_head.weight"}
    assert all(not dropped for _, _, dropped in ranks)  # what a stage holds, its optimizer steps


def test_a_tied_embedding_is_held_by_the_first_and_the_loss_stage_only():
    ranks = run_distributed(_placement, 4, "gpt", _pp(4), False, init_process_group=False)
    by_stage = {stage: _outer(held) for stage, held, _ in ranks}
    assert by_stage[0] == {"transformer.wte.weight", "transformer.wpe.weight", "lm_head.weight"}
    assert by_stage[3] >= {"transformer.wte.weight", "lm_head.weight", "transformer.ln_f.weight"}
    assert "transformer.wpe.weight" not in by_stage[3]
    assert by_stage[1] == by_stage[2] == set()


def test_helix_keeps_the_embedding_and_head_on_its_stage_zero():
    ranks = run_distributed(
        _placement, 2, "llama", lambda: HelixParallelStrategy(pipeline_parallel_size=2), False,
        init_process_group=False,
    )  # fmt: skip
    by_stage = {stage: _outer(held) for stage, held, _ in ranks}
    assert by_stage[0] == {"embed_tokens.weight", "norm.weight", "lm_head.weight"}
    assert by_stage[1] == set()


def test_a_tied_embedding_over_four_stages_trains_with_parity():
    assert_parity("gpt", _pp(4), 4, data_parallel_size=1, gradient_clip_val=0.05)


def test_a_skip_from_the_embedding_to_the_head_keeps_the_embedding_on_the_loss_stage():
    ranks = run_distributed(_placement, 2, "llama-skip", _pp(), False, init_process_group=False)
    assert "embed_tokens.weight" in _outer(dict((s, h) for s, h, _ in ranks)[1])
    assert_parity("llama-skip", _pp(), 2, data_parallel_size=1, gradient_clip_val=0.05)


def test_a_block_argument_computed_from_a_parameter_keeps_everything_everywhere():
    ranks = run_distributed(_placement, 2, "llama-learned-rope", _pp(), False, init_process_group=False)
    for _, held, _ in ranks:
        assert {"embed_tokens.weight", "rope_scale", "lm_head.weight"} <= _outer(held)
    assert_parity("llama-learned-rope", _pp(), 2, data_parallel_size=1)


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
