"""The global view of gradient norms: ``strategy.grad_norm(p)`` is what Lightning's ``grad_norm(module, p)``
gives on one device, for every layout (a pipeline stage's own ``grad_norm`` sees only its layers)."""

from __future__ import annotations

import lightning as L
import pytest
from lightning.pytorch.utilities import grad_norm

from lightning_parallel import HelixParallelStrategy, HybridParallelStrategy, PipelineParallelStrategy
from tests.helpers.distributed import run_distributed
from tests.helpers.parity import PRECISION, _OneReplicaSampler, build

LAYOUTS = {
    "pp2": lambda: PipelineParallelStrategy(pipeline_parallel_size=2, num_microbatches=4),
    "helix2": lambda: HelixParallelStrategy(pipeline_parallel_size=2, num_microbatches=4),
    "tp2": lambda: HybridParallelStrategy(data_parallel_size=1, tensor_parallel_size=2),
    "sp2": lambda: HybridParallelStrategy(data_parallel_size=1, sequence_parallel_size=2),
}


class Norms(L.Callback):
    def __init__(self, norm_type) -> None:
        self.norm_type, self.seen = norm_type, []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        strategy = trainer.strategy
        view = (
            strategy.grad_norm(self.norm_type)
            if hasattr(strategy, "grad_norm")
            else grad_norm(pl_module, self.norm_type)
        )
        self.seen.append({k: float(v) for k, v in view.items()})


def _norms(rank, world, layout, norm_type):
    module, data = build("gpt", 8, "sgd")
    norms = Norms(norm_type)
    callbacks = [norms] + ([_OneReplicaSampler()] if layout is None else [])
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=LAYOUTS[layout]() if layout else "auto", max_steps=2,
        precision=PRECISION["float64"], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=callbacks,
    )  # fmt: skip
    trainer.fit(module, datamodule=data)
    return norms.seen


@pytest.mark.parametrize("norm_type", [2, "inf"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_strategy_grad_norm_is_the_one_device_view(layout, norm_type):
    want = _norms(0, 1, None, norm_type)
    for got in run_distributed(_norms, 2, layout, norm_type, init_process_group=False):
        assert len(got) == len(want) == 2
        for g, w in zip(got, want):
            assert g.keys() == w.keys()
            for k in w:
                assert g[k] == pytest.approx(w[k], rel=1e-9, abs=1e-12), k


def _lightning_grad_norm(rank, world):
    module, data = build("gpt", 8, "sgd")
    module.on_before_optimizer_step = lambda optimizer: module.log_dict(grad_norm(module, 2))
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=LAYOUTS["pp2"](), max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, datamodule=data)


def test_lightnings_grad_norm_refuses_a_partial_view():
    """``grad_norm`` was imported at the top of this file, before lightning_parallel: the refusal reaches it."""
    from tests.helpers.distributed import RankFailed

    with pytest.raises(RankFailed, match=r"grad_norm\(module\) under PipelineParallelStrategy would see only part"):
        run_distributed(_lightning_grad_norm, 2, init_process_group=False, timeout=60)
