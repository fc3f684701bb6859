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
@pytest.mark.parametrize("model", ["llama", pytest.param("hf-gpt2", marks=pytest.mark.slow)])
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
@pytest.mark.parametrize("model,mode", [pytest.param("gpt", "ulysses", marks=pytest.mark.slow), ("llama", "ring")])
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


# ----------------------------------------------------------------- helix x dp x tp, and its optimizer sharding
@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["none", "optimizer"])
def test_dp2_x_p2_x_tp2_on_8_ranks(sharding):
    strategy = helix(data_parallel_size=2, tensor_parallel_size=2, data_parallel_sharding=sharding)
    assert_parity("llama", strategy, 8, data_parallel_size=2, global_batch=16, gradient_clip_val=0.05)


@pytest.mark.slow
def test_dp2_x_p2_x_tp2_optimizer_sharding_fp32():
    """The whole mesh at once (dp x pp x tp) in float32 with SGD, optimizer state sharded over dp."""
    strategy = helix(data_parallel_size=2, tensor_parallel_size=2, data_parallel_sharding="optimizer")
    assert_parity("gpt", strategy, 8, data_parallel_size=2, global_batch=16, dtype="float32", steps=2)


@pytest.mark.slow
def test_p2_x_tp2_x_sp2_on_8_ranks():
    strategy = helix(tensor_parallel_size=2, sequence_parallel_size=2, sequence_parallel_mode="ring")
    assert_parity("llama", strategy, 8, data_parallel_size=1)


# --------------------------------------------------------------------------------------- evaluation (lock-step)
def _validated(rank, world_size, kwargs):
    from tests.helpers.parity import build
    from tests.helpers.trainers import quick_fit

    module, data = build("llama", 8, "sgd")
    trainer = quick_fit(module, data, HelixParallelStrategy(pipeline_parallel_size=2, **kwargs), world_size, steps=2,
                        limit_val_batches=2, val_check_interval=2, num_sanity_val_steps=1)  # fmt: skip
    return float(trainer.callback_metrics["val_loss"])


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param(dict(tensor_parallel_size=2), marks=pytest.mark.slow),
        pytest.param(dict(sequence_parallel_size=2, sequence_parallel_mode="ring"), marks=pytest.mark.slow),
    ],
)
def test_validation_before_and_after_the_split_equals_one_device(kwargs):
    """The sanity check runs before the first step has split the blocks (every stage the whole model), the
    validation after it runs the helix lock-step through each stage's tensor- or sequence-parallel parts."""
    from tests.helpers.distributed import run_distributed
    from tests.helpers.parity import _OneReplicaSampler, build
    from tests.helpers.trainers import quick_fit

    module, data = build("llama", 8, "sgd")
    trainer = quick_fit(module, data, "auto", 1, steps=2, limit_val_batches=2, val_check_interval=2,
                        callbacks=[_OneReplicaSampler()])  # fmt: skip
    want = float(trainer.callback_metrics["val_loss"])
    for got in run_distributed(_validated, 4, kwargs, init_process_group=False):
        assert got == pytest.approx(want, rel=1e-5), (got, want)


# ------------------------------------------------------------------------------------------------- bad input
def _fit_helix(rank, world_size, seq_len, model_kwargs, strategy_kwargs):
    from examples.data import CharDataModule
    from examples.models import Llama
    from tests.helpers.trainers import quick_fit

    data = CharDataModule(block_size=seq_len, batch_size=4, shuffle=False)
    module = Llama(vocab_size=data.vocab_size, block_size=seq_len, **model_kwargs)
    quick_fit(module, data, HelixParallelStrategy(pipeline_parallel_size=2, **strategy_kwargs), world_size)


LLAMA = dict(n_layer=2, n_head=4, n_kv_head=2, dim=32, mlp_hidden=64)


@pytest.mark.parametrize(
    "seq_len,model_kwargs,strategy_kwargs,message",
    [
        (18, LLAMA, dict(sequence_parallel_size=2, sequence_parallel_mode="ring"),
         r"sequence length \(18\) to be divisible by 2 x sequence_parallel_size \(4\)"),
        (16, dict(LLAMA, n_kv_head=1), dict(sequence_parallel_size=2),
         r"sequence_parallel_mode='ulysses' needs sequence_parallel_size=2 to divide the number of key/value heads \(1\)"),
        (16, dict(LLAMA, n_kv_head=1), dict(tensor_parallel_size=2),
         r"tensor_parallel_size=2 must divide the number of key/value heads \(1\)"),
    ],
)  # fmt: skip
def test_bad_input_is_named_on_every_rank(seq_len, model_kwargs, strategy_kwargs, message):
    from tests.helpers.distributed import RankFailed, run_distributed

    with pytest.raises(RankFailed, match=message):
        run_distributed(_fit_helix, 4, seq_len, model_kwargs, strategy_kwargs, init_process_group=False, timeout=90)


@pytest.mark.slow
def test_a_mixture_of_experts_is_chunked_by_its_module_under_helix_x_tp():
    """Mixtral's experts train under helix x tp with the default mlp_chunks=2: the MLP is the module the Hugging
    Face metadata names, run on slices of the tokens (the router sees whole tokens, each token its experts). It
    was refused ("no MLP in its graph"): the module read the sequence length the trace took from the hidden state
    outside it, now read again from each slice."""
    from tests.helpers.coverage import run_cell

    cell = run_cell("hf:mixtral", "helix_tp")
    assert cell.status == "parity" and cell.anatomy == "hugging_face", cell


def test_the_refusal_names_mlp_chunks_1():
    """Where no MLP can be chunked under helix x tp, the refusal names the way out."""
    from types import SimpleNamespace

    from torch import nn

    from lightning_parallel.anatomy.resolve import explain

    config = SimpleNamespace(mlp_chunks=2, tp=2, sp=1, split=True, tp_plan=None)
    message = explain(nn.Linear(2, 2), config, ["traced: no MLP in its graph"])
    assert "pass mlp_chunks=1 (the MLP unchunked; mlp_chunks=2 found no MLP to chunk)" in message


# ------------------------------------------------------------------- a plan given under helix x tp: applied or refused
def _qwen3(base_plan_override=None):  # type: ignore[no-untyped-def]
    from tests.helpers.zoo import CharDataModule, HFCausalLM

    data = CharDataModule(block_size=16, batch_size=8, shuffle=False)
    module = HFCausalLM("qwen3", data.vocab_size, num_layers=2)
    if base_plan_override:
        module.model.config.base_model_tp_plan = {**module.model.config.base_model_tp_plan, **base_plan_override}
    return module, data


DERIVED = {"self_attn.[qkv]_proj": "colwise", "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise",
           "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise"}  # fmt: skip


def _fit_qwen3(rank, world, tp_plan, base_plan_override):  # type: ignore[no-untyped-def]
    import torch

    from tests.helpers.trainers import quick_fit

    torch.manual_seed(0)
    module, data = _qwen3(base_plan_override)
    strategy = HelixParallelStrategy(pipeline_parallel_size=2, tensor_parallel_size=2, tp_plan=tp_plan)
    quick_fit(module, data, strategy, world, steps=1)


@pytest.mark.parametrize(
    "tp_plan,base_override,named",
    [
        pytest.param(
            {**DERIVED, "self_attn.q_proj": "rowwise"},
            None,
            "self_attn.q_proj: rowwise in tp_plan=, colwise in the",
            marks=pytest.mark.slow,
            id="tp_plan",
        ),
        pytest.param(
            None,
            {"layers.*.mlp.down_proj": "colwise"},
            "mlp.down_proj: colwise in the config's base_model_tp_plan",
            id="base_model_tp_plan",
        ),
    ],  # tp_plan=: slow tier (time; the comparison is the same code)
)
def test_a_plan_the_helix_split_would_not_apply_is_refused(tp_plan, base_override, named):
    from tests.helpers.distributed import RankFailed, run_distributed

    with pytest.raises(RankFailed) as failed:
        run_distributed(_fit_qwen3, 4, tp_plan, base_override, init_process_group=False, timeout=120)
    assert named in str(failed.value), str(failed.value)[-3000:]


@pytest.mark.slow
def test_a_plan_equal_to_the_derived_one_is_applied(monkeypatch):
    from tests.helpers import parity

    def build(model, batch_size, optimizer, seed=0):  # type: ignore[no-untyped-def]
        import torch

        torch.manual_seed(seed)
        return _qwen3()

    monkeypatch.setattr(parity, "build", build)
    per_rank = assert_parity("qwen3-derived-plan", helix(tensor_parallel_size=2, tp_plan=DERIVED), 4,
                             data_parallel_size=1, dtype="float32")  # fmt: skip
    assert len(per_rank[0].anatomy) == 2, per_rank[0].anatomy
