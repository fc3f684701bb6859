"""HelixPipe composed with tensor and sequence parallelism inside each stage, and with data parallelism around it,
against single-process training (the parity contract: loss and every parameter after every step)."""

import pytest

from lightning_parallel import HelixParallelStrategy
from tests.helpers.parity import assert_parity

MODELS = ["gpt", "llama", "encoder"]
HF = ["hf-llama", "hf-gpt2"]


def helix(**kw):
    return lambda: HelixParallelStrategy(pipeline_parallel_size=2, **kw)


# --------------------------------------------------------------------------------- helix x tensor parallelism
@pytest.mark.parametrize("model", ["llama", "hf-gpt2"])
def test_p2_x_tp2(model):
    per_rank = assert_parity(model, helix(tensor_parallel_size=2), 4, data_parallel_size=1)
    assert len(per_rank[0].anatomy) == 8  # every layer was split (and sharded)


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS + HF)
@pytest.mark.parametrize("recompute", ["no_attention", "none"])
def test_p2_x_tp2_matrix(model, recompute):
    assert_parity(model, helix(tensor_parallel_size=2, recompute=recompute), 4, data_parallel_size=1,
                  gradient_clip_val=0.05)  # fmt: skip


# -------------------------------------------------------------------------------- helix x sequence parallelism
@pytest.mark.parametrize("model,mode", [("gpt", "ulysses"), ("llama", "ring")])
def test_p2_x_sp2(model, mode):
    assert_parity(model, helix(sequence_parallel_size=2, sequence_parallel_mode=mode), 4, data_parallel_size=1)


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS + HF)
@pytest.mark.parametrize("mode", ["ulysses", "ring"])
@pytest.mark.parametrize("recompute", ["no_attention", "none"])
def test_p2_x_sp2_matrix(model, mode, recompute):
    assert_parity(
        model, helix(sequence_parallel_size=2, sequence_parallel_mode=mode, recompute=recompute), 4,
        data_parallel_size=1,
    )  # fmt: skip
