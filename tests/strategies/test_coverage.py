"""The coverage matrix: the models users have, as plain LightningModules (tests/helpers/zoo.py),
under every strategy; each cell reproduces single-process training (float32 with SGD, docs/design.md "Parity tests", the
first loss within 2e-6 relative, tests/helpers/coverage.py FIRST_LOSS_RTOL: the loss
of every step and every parameter) or ends in one of the library's clear errors, never a silent wrong
result, an internal traceback or a hang. The packed rows train the same strategies on rows of several
documents (tests/helpers/packed.py), so a lost document mask cannot come back unseen. One Hugging Face family
(all but helix, which Qwen3-MoE's cell runs) and one home-written block run every 2-rank column in the fast tier,
the home-written block helix x tp too; the whole matrix, the packed rows included, is slow. The expert-parallel
column applies to the mixtures of experts only.

``bash scripts/test.sh -m "" tests/strategies/test_coverage.py --coverage-table docs/coverage.md`` writes the
table the README links."""

from __future__ import annotations

import re

import pytest

from tests.helpers import zoo
from tests.helpers.coverage import COLUMNS, PACKED_ROWS, applies, run_cell

pytest.importorskip("transformers")

# cells whose answer is a clear error: what the block cannot be, said in the error
EXPECTED = {
    ("lightning:demo", "helix"): r"calls attention 2 times \(e\.g\. self- and cross-attention\)",
    ("lightning:demo", "ulysses"): r"calls attention 2 times \(e\.g\. self- and cross-attention\)",
    ("lightning:demo", "ring"): r"calls attention 2 times \(e\.g\. self- and cross-attention\)",
    ("lightning:demo", "helix_tp"): r"calls attention 2 times \(e\.g\. self- and cross-attention\)",
    # latent attention under helix x tp: the derived plan does not follow its low-rank projections (docs/guide.md)
    ("hf:deepseek_v3", "helix_tp"): r"no projection of the block can be sharded",
    # helix x tp shards by the plan derived from the graph, which keeps Llama 4's MoE block replicated: refused
    ("hf:llama4", "helix_tp"): r"by the plan derived from its traced graph, which\s+differs from the config's",
}
FAST = {"hf:qwen3", "home:fused"}  # packed rows: tests/strategies/test_packed.py is fast
FAST_CELLS = {("hf:qwen3_moe", "helix"),  # a mixture of experts chunked by tokens under helix
              ("home:alibi", "ulysses")}  # attention by hand, its per-head bias on the whole sequence  # fmt: skip
SLOW_CELLS = {("hf:qwen3", "helix")}  # (time) helix over Hugging Face metadata: Qwen3-MoE's cell is fast
FOUR_RANKS_FAST = {("home:fused", "helix_tp")}  # of the 4-rank columns: helix x tp through the traced graph


def test_at_least_nine_in_ten_cells_are_parity():
    assert len(EXPECTED) <= 0.1 * len(zoo.ROWS) * len(COLUMNS)


def _fast(row: str, column: str) -> bool:
    if (row, column) in SLOW_CELLS:
        return False
    return (row, column) in FOUR_RANKS_FAST if COLUMNS[column][2] > 2 else row in FAST or (row, column) in FAST_CELLS


@pytest.mark.parametrize(
    "row,column",
    [
        pytest.param(r, c, marks=() if _fast(r, c) else pytest.mark.slow)
        for r in (*zoo.ROWS, *PACKED_ROWS)
        for c in COLUMNS
        if applies(r, c)
    ],
)
def test_cell(row, column, coverage_table):
    cell = run_cell(row, column)
    coverage_table[(row, column)] = cell
    expected = EXPECTED.get((row, column))
    if expected is None:
        assert cell.status == "parity", cell.message
    else:
        assert cell.status == "error" and re.search(expected, cell.message), cell
