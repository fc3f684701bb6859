"""With the hand-written adapters switched off, the example models train exactly under every strategy
through the derived anatomy alone (the traced graph), and the anatomy that served is the traced one."""

from __future__ import annotations

import pytest

from tests.helpers.coverage import COLUMNS
from tests.helpers.parity import assert_parity


def _without_adapters(make):
    def factory():
        from lightning_parallel.anatomy import resolve

        resolve.SOURCES = tuple(s for s in resolve.SOURCES if s != "adapters")  # this rank only (forked)
        return make()

    return factory


@pytest.mark.parametrize("column", list(COLUMNS))
@pytest.mark.parametrize(
    "model", ["gpt", pytest.param("llama", marks=pytest.mark.slow), pytest.param("encoder", marks=pytest.mark.slow)]
)
def test_example_models_through_the_traced_graph_alone(model, column):
    make, dp = COLUMNS[column]
    for records in assert_parity(model, _without_adapters(make), 2, data_parallel_size=dp):
        # plain pipelining needs no anatomy; every other column composes its blocks from the traced graph
        assert set(records.anatomy) == (set() if column == "pipeline" else {"the traced graph"}), records.anatomy
