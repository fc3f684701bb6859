"""With the hand-written adapters switched off, the example models train exactly under every strategy
through the derived anatomy alone (the traced graph), and the anatomy that served is the traced one."""

from __future__ import annotations

import pytest

from tests.helpers.coverage import COLUMNS, ONLY
from tests.helpers.distributed import run_distributed
from tests.helpers.parity import assert_parity, build


def _without_adapters(make):
    def factory():
        from lightning_parallel.anatomy import resolve

        resolve.SOURCES = tuple(s for s in resolve.SOURCES if s != "adapters")  # this rank only (forked)
        return make()

    return factory


@pytest.mark.parametrize(
    "column",
    [
        pytest.param(c, marks=pytest.mark.slow)
        if c in ("helix_tp", "full_tp", "ulysses", "ring", "hybrid", "helix")
        else c
        for c in COLUMNS
        if c not in ONLY  # (the expert-parallel column: the mixtures of experts only)
    ],
)  # the 4-rank columns, sequence parallelism and the hybrid: the coverage matrix's home-written fused block runs them
# through the traced graph fast (time: 6-7 s each)
@pytest.mark.parametrize(
    "model", ["gpt", pytest.param("llama", marks=pytest.mark.slow), pytest.param("encoder", marks=pytest.mark.slow)]
)
def test_example_models_through_the_traced_graph_alone(model, column):
    make, dp, world = COLUMNS[column]
    for records in assert_parity(model, _without_adapters(make), world, data_parallel_size=dp):
        # plain pipelining needs no anatomy; every other column composes its blocks from the traced graph
        assert set(records.anatomy) == (set() if column == "pipeline" else {"the traced graph"}), records.anatomy


def _fit_with_validation(rank, world_size, column):
    from tests.helpers.trainers import quick_fit

    make, _, _ = COLUMNS[column]
    module, data = build("gpt", 8, "sgd")
    trainer = quick_fit(module, data, _without_adapters(make)(), world_size, steps=2, limit_val_batches=2,
                        val_check_interval=2)  # fmt: skip
    return float(trainer.callback_metrics["val_loss"])


@pytest.mark.parametrize(  # slow tier (time: 13 s): helix's traced blocks, tensor-parallel ones, run again fast
    "column", [pytest.param(c, marks=pytest.mark.slow) for c in ("tensor_parallel", "ulysses")] + ["helix"]
)
def test_traced_blocks_run_again_in_eval_mode_for_validation(column):
    from tests.helpers.parity import _OneReplicaSampler
    from tests.helpers.trainers import quick_fit

    module, data = build("gpt", 8, "sgd")  # the batches a one-replica DistributedSampler gives, as the ranks get
    trainer = quick_fit(module, data, "auto", 1, steps=2, limit_val_batches=2, val_check_interval=2,
                        callbacks=[_OneReplicaSampler()])  # fmt: skip
    want = float(trainer.callback_metrics["val_loss"])
    for got in run_distributed(_fit_with_validation, 2, column, init_process_group=False):
        assert got == pytest.approx(want, rel=1e-5), (got, want)
