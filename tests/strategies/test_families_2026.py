"""Families of 2026, beside the coverage matrix (tests/strategies/test_coverage.py has their rows but Qwen3-Next's):
what makes each train, with the mutations that break it, and what is refused, by name, on every rank
(docs/guide.md, "Limitations").

- GPT-OSS: learned attention sinks (a logit per head in the softmax's denominator). Ulysses gives each rank its
  head group's sinks (the attention function reads them per head) and trains; tensor parallelism (its config has no
  plan for the layers: the plan derived from the traced graph, the attention call one op) cuts the sinks with the
  heads and trains, FSDP2 over it too; ring attention adds them to its merged log-sum-exp; HelixPipe carries them
  with q, k, v to the attention stage (helix x sp refuses them).
- DeepSeek-V3: multi-head latent attention; Ulysses, ring attention, HelixPipe and tensor parallelism
  (transformers' plan, its latent kv projection kept whole) train it; helix x tp refuses it.
- Qwen3-Next: gated DeltaNet layers (no attention) between full-attention layers. HelixPipe refuses a block that
  computes no attention, at once (tracing a DeltaNet layer took tens of seconds per rank, and 4 ranks on 2 cores
  ran past the harness's timeout); sequence parallelism chains the mixer's state (LASP); pipeline and tensor
  parallelism train it.
- Falcon-H1 under sequence parallelism: its Mamba-2 mixer's state chained between ranks (LASP).
- Mixtures of experts under tensor parallelism (Llama 4, Qwen3-MoE, Mixtral, DeepSeek-V3): every expert's hidden
  size sharded.
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


@pytest.mark.slow  # (time: 14 s and 30 s; tests/unit/test_helix_carried.py carries a sink per head, fast)
@pytest.mark.parametrize("column", ["helix", "helix_tp"])
def test_attention_sinks_travel_with_q_k_v_under_helix(column):
    """The sinks are read on the pre-attention stage and carried to the attention stage with q, k, v (which holds
    no parameters); their gradient comes back with q's. Under helix x tp each rank carries its heads' sinks."""
    cell = run_cell("hf:gpt_oss", column)
    assert cell.status == "parity", cell


@pytest.mark.slow  # (time)
def test_attention_sinks_under_helix_x_sequence_parallelism_are_refused_naming_them():
    from lightning_parallel import HelixParallelStrategy

    cell = run_cell("hf:gpt_oss", "helix_tp", lambda: HelixParallelStrategy(pipeline_parallel_size=2,
                                                                            sequence_parallel_size=2))  # fmt: skip
    assert cell.status == "error", cell
    assert "takes 1 parameter(s) besides q, k, v (learned sinks)" in cell.message, cell


def test_attention_sinks_enter_the_ring_once_per_head():
    """Ring attention adds each head's sink to the merged log-sum-exp after the ring (tests/unit/test_ring_sinks.py
    checks the op against the eager softmax); GPT-OSS's sliding layers pass their window as a mask."""
    cell = run_cell("hf:gpt_oss", "ring")
    assert cell.status == "parity" and cell.anatomy == "hugging_face", cell


@pytest.mark.parametrize("column", ["helix", pytest.param("helix_tp", marks=pytest.mark.slow)])
def test_a_block_without_attention_is_refused_by_helix(column):
    cell = run_cell("hf:qwen3_next", column)
    assert cell.status == "error", cell
    assert "no anatomy of Qwen3NextDecoderLayer serves" in cell.message
    assert "the block computes no attention" in cell.message and "train it under pipeline" in cell.message


@pytest.mark.parametrize("column", ["ulysses", pytest.param("ring", marks=pytest.mark.slow)])
def test_a_mamba_mixer_beside_attention_passes_its_state_between_sequence_parallel_ranks(column):
    """Falcon-H1: attention (Ulysses / ring) and a Mamba-2 mixer side by side in every layer; the mixer runs on
    each rank's tokens from the state and convolution inputs of the tokens before them (LASP,
    lightning_parallel/lasp.py; tests/unit/test_lasp.py checks the chain against one process)."""
    cell = run_cell("hf:falcon_h1", column)
    assert cell.status == "parity" and cell.anatomy == "hugging_face", cell


@pytest.mark.slow  # (time)
def test_without_the_state_from_the_rank_before_the_mixer_is_not_verified(monkeypatch):
    from lightning_parallel import lasp

    receive = lasp._Receive.apply
    monkeypatch.setattr(lasp._Receive, "apply", lambda *a: tuple(t * 0 for t in receive(*a)))
    cell = run_cell("hf:falcon_h1", "ulysses")
    assert cell.status == "error" and "hugging_face does not reproduce FalconH1DecoderLayer" in cell.message, cell


@pytest.mark.parametrize("column", ["ulysses", pytest.param("ring", marks=pytest.mark.slow)])
def test_gated_deltanet_layers_pass_their_state_between_sequence_parallel_ranks(column):
    """Qwen3-Next: DeltaNet layers (no attention: no traced graph is tried) chained between the ranks, full-attention
    layers through Ulysses / ring. The delta rule casts to float32 itself and the MoE's grouped GEMM takes no
    float64: the chained blocks are verified in float64 through both (lightning_parallel/anatomy/wide.py)."""
    cell = run_cell("hf:qwen3_next", column)
    assert cell.status == "parity" and cell.anatomy == "hugging_face", cell


@pytest.mark.slow  # (time)
def test_in_float32_the_split_recurrence_is_not_verified(monkeypatch):
    """What float64 through the casts is for: compared in float32, the split recurrence's rounding on the decay
    parameters' smallest gradient elements (3.7e-8 on 2e-7; the tensor's largest 3.7e-4) passes the bound."""
    from contextlib import nullcontext

    from lightning_parallel.anatomy import wide

    monkeypatch.setattr(wide, "float64_through", nullcontext)
    cell = run_cell("hf:qwen3_next", "ulysses")
    assert cell.status == "error" and "gradient of linear_attn.dt_bias" in cell.message, cell


@pytest.mark.slow
@pytest.mark.parametrize("column", ["pipeline", "tensor_parallel"])
def test_a_linear_attention_hybrid_trains_where_blocks_stay_whole(column):
    assert run_cell("hf:qwen3_next", column).status == "parity"


def test_latent_attention_trains_under_ulysses():
    """DeepSeek-V3's multi-head latent attention (low-rank q and kv, rope and non-rope head parts, v head size
    apart from q/k's) with a shared-expert MoE: Ulysses trains it (the model's own attention on whole sequences)."""
    cell = run_cell("hf:deepseek_v3", "ulysses")
    assert cell.status == "parity" and cell.anatomy == "hugging_face", cell


@pytest.mark.parametrize("column", ["tensor_parallel", "ring", pytest.param("full_tp", marks=pytest.mark.slow)])
def test_latent_attention_trains_under_tensor_parallelism_and_ring_attention(column):
    """tp: transformers' plan shards the heads after the low-rank down projections (q_b_proj, kv_b_proj colwise,
    o_proj rowwise) and keeps the kv down projection whole, its rope-key tail's gradient summed over the ranks
    (the 'mla_kv_a_proj' style). Ring: the values' head size (8) is not the queries' (12), so the pairs run the
    math kernel."""
    cell = run_cell("hf:deepseek_v3", column)
    assert cell.status == "parity" and cell.anatomy == "hugging_face", cell


@pytest.mark.slow  # (time: 15 s; tests/unit/test_traced_writes.py cuts a block that writes its keys, fast)
def test_latent_attention_trains_under_helix():
    """DeepSeek-V3 writes its keys into a fresh tensor (``new_empty``, ``copy_`` into the rope and non-rope parts):
    the trace in functional form shows the writes before attention, and the cut holds."""
    cell = run_cell("hf:deepseek_v3", "helix")
    assert cell.status == "parity", cell


@pytest.mark.slow  # (time)
def test_without_the_rope_keys_sum_latent_attention_is_not_verified(monkeypatch):
    """The rope key's gradient is each rank's heads' share: left unsummed, the block fails verification."""
    from lightning_parallel import tensor_parallel

    monkeypatch.setattr(tensor_parallel._TailGrad, "__call__", lambda self, module, args, output: output)
    cell = run_cell("hf:deepseek_v3", "tensor_parallel")
    assert cell.status == "error" and "no anatomy of DeepseekV3DecoderLayer serves tensor parallel" in cell.message


class _ExpertsSharded:
    """A callback (built inside each rank) that fails the rank unless every routed expert weight holds half of its
    elements after the first step (tp=2: each expert's hidden size sharded), and counts them."""

    def __new__(cls, expected: int):
        import lightning as L

        class Check(L.Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # blocks shard at first call
                from torch.distributed.tensor import DTensor

                seen = 0
                for name, p in pl_module.named_parameters():
                    if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                        local = p.to_local() if isinstance(p, DTensor) else p
                        assert local.numel() * 2 == p.numel(), (name, tuple(local.shape), tuple(p.shape))
                        seen += 1
                assert seen == expected, seen

        return Check()


@pytest.mark.parametrize(
    ("row", "expected"),
    [("hf:llama4", 4), pytest.param("hf:qwen3_moe", 4, marks=pytest.mark.slow),  # (time) Llama 4's is fast
     pytest.param("hf:mixtral", 4, marks=pytest.mark.slow),
     pytest.param("hf:deepseek_v3", 2, marks=pytest.mark.slow)],
)  # fmt: skip
def test_mixtures_train_under_tp_with_each_experts_hidden_size_sharded(row, expected):
    """Llama 4's plan shards the routed experts' 3-D weights (transformers' 'packed_rowwise' on (E, H, gate|up),
    'colwise' on (E, I, H), 'moe_tp_experts' summing the partial output); for transformers 5's standard experts
    (``gate_up_proj (E, 2I, H)``, ``down_proj (E, H, I)``), which the configs' plans leave out, the Hugging Face
    anatomy adds the same: each rank holds half of every expert's hidden size, gate and up rank-aligned; parity."""
    from tests.helpers.coverage import COLUMNS
    from tests.helpers.parity import assert_parity

    make, dp, world = COLUMNS["tensor_parallel"]
    records = assert_parity(row, make, world, data_parallel_size=dp, dtype="float32", steps=2,
                            callbacks=lambda: [_ExpertsSharded(expected)])  # fmt: skip
    assert all("hugging_face" in r.anatomy for r in records)
