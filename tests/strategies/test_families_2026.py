"""Families of 2026 outside the coverage matrix (tests/strategies/test_coverage.py has Qwen3-MoE and Falcon-H1):
what trains and what is refused, by name, on every rank (docs/guide.md, "Limitations").

- GPT-OSS: learned attention sinks (a logit per head in the softmax's denominator). Ulysses gives each rank its
  head group's sinks (the attention function reads them per head) and trains; tensor parallelism (its config has no
  plan for the layers: the plan derived from the traced graph, the attention call one op) cuts the sinks with the
  heads and trains, FSDP2 over it too; ring attention and HelixPipe refuse them.
- DeepSeek-V3: multi-head latent attention; Ulysses trains it, tensor parallelism refuses it.
- Qwen3-Next: gated DeltaNet layers (no attention) between full-attention layers. HelixPipe and sequence
  parallelism refuse a block that computes no attention, at once (tracing a DeltaNet layer took tens of seconds
  per rank, and 4 ranks on 2 cores ran past the harness's timeout); pipeline and tensor parallelism train it.
"""

from __future__ import annotations

import pytest

from tests.helpers.coverage import run_cell


def test_attention_sinks_train_under_ulysses():
    cell = run_cell("hf:gpt_oss", "ulysses")
    assert cell.status == "parity" and cell.anatomy == "hugging_face", cell


@pytest.mark.parametrize("column", ["tensor_parallel", pytest.param("full_tp", marks=pytest.mark.slow)])
def test_attention_sinks_are_cut_with_their_heads_under_tensor_parallelism(column):
    cell = run_cell("hf:gpt_oss", column)
    assert cell.status == "parity" and cell.anatomy == "hugging_face", cell


@pytest.mark.slow  # (time)
def test_without_its_heads_sinks_the_tensor_parallel_block_is_not_verified(monkeypatch):
    """The cut is what makes it exact: sinks left whole (every tp rank given all heads' sinks) fail verification."""
    from lightning_parallel.anatomy.traced import tensor

    monkeypatch.setattr(tensor, "_head_parameters", lambda attentions: [])
    cell = run_cell("hf:gpt_oss", "tensor_parallel")
    assert cell.status == "error" and "no anatomy of GptOssDecoderLayer serves tensor parallelism" in cell.message, cell


@pytest.mark.slow  # (time)
@pytest.mark.parametrize("column", ["helix", "helix_tp"])
def test_attention_sinks_are_refused_by_helix_naming_them(column):
    cell = run_cell("hf:gpt_oss", column)
    assert cell.status == "error" and "takes the parameter(s) ['self_attn.sinks']" in cell.message, cell


def test_attention_sinks_are_refused_by_ring_attention_naming_ulysses():
    cell = run_cell("hf:gpt_oss", "ring")
    assert cell.status == "error", cell
    assert "sequence_parallel_mode='ring' does not run attention sinks" in cell.message
    assert "use sequence_parallel_mode='ulysses'" in cell.message


@pytest.mark.parametrize("column", ["helix", pytest.param("ulysses", marks=pytest.mark.slow),
                                    pytest.param("helix_tp", marks=pytest.mark.slow)])  # fmt: skip
def test_a_block_without_attention_is_refused_by_helix_and_sequence_parallelism(column):
    cell = run_cell("hf:qwen3_next", column)
    assert cell.status == "error", cell
    assert "no anatomy of Qwen3NextDecoderLayer serves" in cell.message
    assert "the block computes no attention" in cell.message and "train it under pipeline" in cell.message


@pytest.mark.slow
@pytest.mark.parametrize("column", ["pipeline", "tensor_parallel"])
def test_a_linear_attention_hybrid_trains_where_blocks_stay_whole(column):
    assert run_cell("hf:qwen3_next", column).status == "parity"


def test_latent_attention_trains_under_ulysses():
    """DeepSeek-V3's multi-head latent attention (low-rank q and kv, rope and non-rope head parts, v head size
    apart from q/k's) with a shared-expert MoE: Ulysses trains it (the model's own attention on whole sequences)."""
    cell = run_cell("hf:deepseek_v3", "ulysses")
    assert cell.status == "parity" and cell.anatomy == "hugging_face", cell


@pytest.mark.slow
def test_latent_attention_under_tensor_parallelism_is_refused_naming_the_plan_style():
    """transformers' plan for DeepSeek-V3 shards the latent kv projection in a style ('mla_kv_a_proj') this
    package does not apply, and the traced graph finds no projection to shard: refused, naming it."""
    cell = run_cell("hf:deepseek_v3", "tensor_parallel")
    assert cell.status == "error" and "'mla_kv_a_proj' is not one of" in cell.message, cell
