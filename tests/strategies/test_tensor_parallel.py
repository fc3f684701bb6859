"""Tensor parallelism: parity with one device for the example models and Hugging Face models,
composition with the pipeline and data parallelism, sharded bytes, checkpoints, and bad input."""

from __future__ import annotations

import pytest
import torch

from lightning_parallel import HybridParallelStrategy, PipelineParallelStrategy
from tests.helpers.distributed import RankFailed, run_distributed
from tests.helpers.parity import assert_parity, build
from tests.helpers.trainers import quick_fit


def _tp(**kwargs):
    return lambda: HybridParallelStrategy(data_parallel_size=1, tensor_parallel_size=2, **kwargs)


@pytest.mark.parametrize("model", ["gpt", "llama", "encoder"])
def test_tp2_matches_one_device_with_clipping(model):
    assert_parity(model, _tp(), 2, data_parallel_size=1, gradient_clip_val=0.05)


def _block_bytes(rank, world_size, model, tp, pp=1):
    from torch.distributed.tensor import DTensor

    from lightning_parallel.trunk import discover_trunk

    module, data = build(model, 8, "sgd")
    full = {n: p.numel() * p.element_size() for n, p in module.named_parameters()}
    strategy = (
        PipelineParallelStrategy(pipeline_parallel_size=pp, tensor_parallel_size=tp, num_microbatches=2)
        if pp > 1
        else HybridParallelStrategy(data_parallel_size=1, tensor_parallel_size=tp)
    )
    quick_fit(module, data, strategy, world_size, steps=1)
    trunk = discover_trunk(module)
    local, whole, sharded, norms = 0, 0, 0, 0
    for i, block in enumerate(trunk.blocks):
        for n, p in block.named_parameters():
            if p.is_meta:
                continue
            t = p.to_local() if isinstance(p.data, DTensor) else p
            local += t.numel() * t.element_size()
            whole += full[f"{trunk.path}.{i}.{n}"]
            sharded += isinstance(p.data, DTensor)
            norms += 0 if isinstance(p.data, DTensor) else t.numel() * t.element_size()
    return local, whole, sharded, norms


@pytest.mark.parametrize("model", ["gpt", "llama", "encoder", "hf-gpt2"])
def test_block_parameter_bytes_shrink_to_one_over_tp(model):
    for local, whole, sharded, unsharded in run_distributed(_block_bytes, 2, model, 2, init_process_group=False):
        assert sharded > 0
        # every projection is halved; what stays whole is the norms (and row-parallel biases)
        assert local == pytest.approx(whole / 2 + unsharded / 2, rel=0.10), (local, whole, unsharded)
        assert unsharded < 0.1 * whole


def _outer_parameters(rank, world_size, model, padding_idx):
    from torch.distributed.tensor import DTensor

    module, data = build(model, 8, "sgd")
    if padding_idx is not None:
        module.embed_tokens.padding_idx = padding_idx  # the lookup's row offsets would change its meaning
    quick_fit(module, data, HybridParallelStrategy(data_parallel_size=1, tensor_parallel_size=2), world_size)
    out = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if ".h." in name or ".layers." in name:
            continue
        local = p.to_local() if isinstance(p.data, DTensor) else p
        out[name] = (tuple(p.shape), tuple(local.shape), str(getattr(p, "placements", None)), id(p))
    return out


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_the_embedding_and_the_head_are_vocabulary_parallel(model):
    """The token embedding and the LM head hold half the vocabulary each under tp=2 (uneven halves: the
    character vocabulary is odd), a tied pair stays one parameter; parity is the tests above."""
    ranks = run_distributed(_outer_parameters, 2, model, None, init_process_group=False)
    embedding, head = (
        ("transformer.wte.weight", "lm_head.weight") if model == "gpt" else ("embed_tokens.weight", "lm_head.weight")
    )
    vocab = ranks[0][head][0][0]
    assert sorted(r[head][1][0] for r in ranks) == sorted([(vocab + 1) // 2, vocab // 2])
    for r in ranks:
        assert r[embedding][1][0] == r[head][1][0] < vocab and r[embedding][2] == "(Shard(dim=0),)"
        assert (r[embedding][3] == r[head][3]) == (model == "gpt")  # tied in the GPT, separate in the Llama
        small = [n for n, (full, local, _, _) in r.items() if local == full]
        assert all("wpe" in n or "norm" in n or "ln_f" in n for n in small), small


def test_an_embedding_with_padding_idx_stays_whole():
    ranks = run_distributed(_outer_parameters, 2, "llama", 0, init_process_group=False)
    for r in ranks:
        full, local, _, _ = r["embed_tokens.weight"]
        assert local == full
        assert r["lm_head.weight"][1][0] < full[0]  # the untied head is still vocabulary-parallel


def _direct_head(rank, world_size, **kwargs):
    from lightning_parallel.errors import ConfigurationError

    module, data = build("gpt-direct-head", 8, "sgd")
    try:
        quick_fit(module, data, HybridParallelStrategy(data_parallel_size=1, tensor_parallel_size=2, **kwargs), 2)
    except ConfigurationError as err:
        return str(err)
    return "trained"


def test_a_weight_used_outside_its_module_names_vocabulary_parallel_false():
    """``F.linear(x, wte.weight)`` meets a vocabulary shard: the error names the argument that fixes it,
    and with it the model trains with parity."""
    messages = run_distributed(_direct_head, 2, init_process_group=False)
    assert all("pass vocabulary_parallel=False" in m and "outside its module's forward" in m for m in messages)
    make = lambda: HybridParallelStrategy(data_parallel_size=1, tensor_parallel_size=2, vocabulary_parallel=False)  # noqa: E731
    assert_parity("gpt-direct-head", make, 2, data_parallel_size=1)


# [llama] is back in the fast tier with test_pp2_x_tp2_with_sequence_parallelism below: a rank of each died of
# SIGSEGV once in fresh-clone runs (2026-12-02); 60 consecutive rounds under 3 busy loops then passed, and six
# fresh-clone runs with them in the fast tier (benchmarks/crash_loop.py; docs/benchmarks.md, "The SIGSEGV under
# sequence parallelism"). [encoder] stays in the slow tier for the fast tier's time.
@pytest.mark.parametrize("model", ["gpt", "llama", pytest.param("encoder", marks=pytest.mark.slow)])
def test_tp2_with_sequence_parallelism_matches_one_device(model):
    assert_parity(model, _tp(tp_sequence_parallel=True), 2, data_parallel_size=1, gradient_clip_val=0.05)


@pytest.mark.parametrize("model", ["hf-llama", "hf-gpt2"])
def test_hugging_face_models_train_under_the_registered_name(model):
    pytest.importorskip("transformers")
    assert_parity(model, lambda: "tensor_parallel", 2, data_parallel_size=1, gradient_clip_val=0.05)


@pytest.mark.parametrize(
    "model", ["gpt", pytest.param("llama", marks=pytest.mark.slow), pytest.param("encoder", marks=pytest.mark.slow)]
)
def test_pp2_x_tp2_on_four_ranks_with_clipping(model):
    def make():
        return PipelineParallelStrategy(pipeline_parallel_size=2, tensor_parallel_size=2, num_microbatches=4)

    assert_parity(model, make, 4, data_parallel_size=1, gradient_clip_val=0.05)


@pytest.mark.slow  # (time) tp2 with sequence parallelism and pp2 x tp2 are fast, each on its own
def test_pp2_x_tp2_with_sequence_parallelism():
    def make():
        return PipelineParallelStrategy(
            pipeline_parallel_size=2, tensor_parallel_size=2, tp_sequence_parallel=True, num_microbatches=4
        )

    assert_parity("gpt", make, 4, data_parallel_size=1, gradient_clip_val=0.05)


@pytest.mark.slow
def test_dp2_x_pp2_x_tp2_on_eight_ranks():
    def make():
        return PipelineParallelStrategy(
            data_parallel_size=2, pipeline_parallel_size=2, tensor_parallel_size=2, num_microbatches=2
        )

    assert_parity("gpt", make, 8, data_parallel_size=2, gradient_clip_val=0.05)


def test_dp2_x_tp2_on_four_ranks():
    make = lambda: HybridParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)  # noqa: E731
    assert_parity("llama", make, 4, data_parallel_size=2, gradient_clip_val=0.05)


@pytest.mark.parametrize("policy", ["full", "selective", "no_attention"])
def test_recomputation_wraps_the_tensor_parallel_blocks(policy):
    assert_parity("gpt", _tp(recompute=policy), 2, data_parallel_size=1)


def test_a_user_plan_replaces_the_adapters():
    mlp_only = {"mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise"}
    assert_parity("llama", _tp(tp_plan=mlp_only), 2, data_parallel_size=1)


# ------------------------------------------------------------------------------------ bad input


class _Broken:
    """The llama adapter without the attention residual: verification must refuse it."""

    def __init__(self):
        from lightning_parallel.anatomy.llama import LlamaAdapter

        self._inner = LlamaAdapter()
        self.name = "broken"

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def post(self, block, out, state, args, kwargs, call=None):
        return self._inner.post(block, out, tuple(torch.zeros_like(t) for t in state), args, kwargs)


def _fit(rank, world_size, model_fn, strategy_kwargs):

    from lightning_parallel.anatomy.adapters import ADAPTERS

    ADAPTERS["broken"] = _Broken()
    module, data = model_fn()
    strategy = HybridParallelStrategy(data_parallel_size=1, tensor_parallel_size=2, **strategy_kwargs)
    quick_fit(module, data, strategy, 2, steps=1)


def _gpt(**kwargs):
    def make():
        from examples.data import CharDataModule
        from examples.models import GPT

        data = CharDataModule(block_size=16, batch_size=4, shuffle=False)
        return GPT(vocab_size=data.vocab_size, block_size=16, **kwargs), data

    return make


def _llama(**kwargs):
    def make():
        from examples.data import CharDataModule
        from examples.models import Llama

        data = CharDataModule(block_size=16, batch_size=4, shuffle=False)
        return Llama(vocab_size=data.vocab_size, block_size=16, **kwargs), data

    return make


def _no_attention():
    from examples.data import CharDataModule
    from tests.helpers.models import NoAttentionLM

    data = CharDataModule(block_size=16, batch_size=4, shuffle=False)
    return NoAttentionLM(vocab_size=data.vocab_size), data


def _home_fused():
    from tests.helpers import zoo

    return zoo.build("home:fused", 4, "sgd", 0.05, 16)


_FUSED_PLAN = {"attention.in_proj": "colwise_qkv", "attention.out": "rowwise", "feedforward.fc": "colwise",
               "feedforward.proj": "rowwise"}  # fmt: skip


@pytest.mark.parametrize(
    "model_fn,kwargs,message",
    [
        (_home_fused, {"tp_plan": _FUSED_PLAN}, r"(?s)own forward: .*raised RuntimeError: shape .* is invalid.*tp_plan=\{.*\} shards the projections, but a user plan runs the block's own forward.*drop tp_plan"),
        (_gpt(n_layer=2, n_head=3, n_embd=24), {}, r"tensor_parallel_size=2 must divide the number of attention heads \(3\) of Block"),
        (_llama(n_layer=2, n_head=4, n_kv_head=1, dim=32, mlp_hidden=64), {}, r"must divide the number of key/value heads \(1\) of DecoderLayer"),
        (_llama(n_layer=2, n_head=4, n_kv_head=2, dim=32, mlp_hidden=63), {}, r"must divide the output width \(63\) of mlp.gate_proj in DecoderLayer"),
        (_no_attention, {}, r"(?s)no anatomy of _NormBlock serves tensor parallelism.*no projection of the block can be sharded.*tp_plan="),
        (_gpt(n_layer=2, n_head=2, n_embd=16), {"tp_plan": {"attn.nothing*": "colwise"}}, r"tp_plan pattern 'attn.nothing\*' matches nothing in Block"),
        (_gpt(n_layer=2, n_head=2, n_embd=16), {"tp_plan": {"attn.c_attn": "diagonal"}}, r"tp_plan\['attn.c_attn'\] = 'diagonal'; choose one of"),
        (_llama(n_layer=2, n_head=4, n_kv_head=2, dim=32, mlp_hidden=64), {"adapter": "broken"}, r"adapter 'broken' does not reproduce DecoderLayer"),
    ],
)  # fmt: skip
def test_bad_input_is_named(model_fn, kwargs, message):
    with pytest.raises(RankFailed, match=message):
        run_distributed(_fit, 2, model_fn, kwargs, init_process_group=False, timeout=60)


def test_helix_refuses_megatron_sequence_sharding():
    from lightning_parallel import HelixParallelStrategy

    with pytest.raises(
        ValueError, match="helix with tp_sequence_parallel=True is not supported.*sequence_parallel_size="
    ):
        HelixParallelStrategy(pipeline_parallel_size=2, tensor_parallel_size=2, tp_sequence_parallel=True)


def _norm_input_lengths(rank, world_size, model):

    from lightning_parallel.trunk import discover_trunk

    module, data = build(model, 8, "sgd")
    block = discover_trunk(module).blocks[0]
    norm = next(m for n, m in block.named_modules() if "norm" in type(m).__name__.lower())
    seen = []
    norm.register_forward_hook(lambda mod, args, out: seen.append(args[0].shape[1]))
    strategy = HybridParallelStrategy(data_parallel_size=1, tensor_parallel_size=2, tp_sequence_parallel=True)
    quick_fit(module, data, strategy, 2, steps=1)
    return seen


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_sequence_parallel_norms_see_half_the_sequence(model):
    from tests.helpers.parity import SEQ_LEN

    for seen in run_distributed(_norm_input_lengths, 2, model, init_process_group=False):
        # verification runs the block's own forward on a whole-sequence copy, then the composed stack (on a
        # copy, then for real) sees its half in every call
        assert seen[0] == SEQ_LEN and seen[1:] and set(seen[1:]) == {SEQ_LEN // 2}, seen


def _fit_tp_sp(rank, world_size, mode):
    from lightning_parallel.anatomy.adapters import ADAPTERS

    ADAPTERS["broken"] = _Broken()
    module, data = _llama(n_layer=2, n_head=8, n_kv_head=4, dim=64, mlp_hidden=64)()
    strategy = HybridParallelStrategy(
        data_parallel_size=1, tensor_parallel_size=2, sequence_parallel_size=2, sequence_parallel_mode=mode,
        adapter="broken",
    )  # fmt: skip
    quick_fit(module, data, strategy, 4, steps=1)


@pytest.mark.parametrize("mode", ["ulysses", "ring"])
def test_tp2_x_sp2_refuses_a_broken_adapter(mode):
    # verification runs after the whole stack (tensor, then sequence parallelism) is built, on every rank
    with pytest.raises(RankFailed, match=r"adapter 'broken' does not reproduce DecoderLayer: output"):
        run_distributed(_fit_tp_sp, 4, mode, init_process_group=False, timeout=90)


def _fit_one_kv_head(rank, world_size):
    import transformers

    from tests.helpers.trainers import quick_fit
    from tests.helpers.zoo import CharDataModule, HFCausalLM, hf_config

    torch.manual_seed(0)
    data = CharDataModule(block_size=16, batch_size=4, shuffle=False)
    module = HFCausalLM("llama", data.vocab_size)
    config = hf_config("llama", data.vocab_size, 2)
    config.num_key_value_heads = 1
    module.model = transformers.AutoModelForCausalLM.from_config(config)
    quick_fit(module, data, HybridParallelStrategy(data_parallel_size=1, tensor_parallel_size=2), world_size)


def test_head_counts_the_config_states_are_refused_at_set_up():
    """A Hugging Face config's head counts are checked when set-up finds the trunk, before any block is placed or
    the first step runs, on every rank, naming the sizes that would divide them."""
    with pytest.raises(RankFailed) as failed:
        run_distributed(_fit_one_kv_head, 2, init_process_group=False, timeout=120)
    text = str(failed.value)
    assert "must divide the number of key/value heads (1) of LlamaDecoderLayer" in text, text[-2000:]
    assert "_parallelize" in text and "training_step" not in text
