"""Sequence (context) parallelism, Ulysses and ring: parity with one device, composition with
the pipeline and data parallelism, activation memory per rank, and bad input."""

from __future__ import annotations

import pytest
import torch

from lightning_parallel import HybridParallelStrategy, PipelineParallelStrategy
from tests.helpers.distributed import RankFailed, run_distributed
from tests.helpers.parity import assert_parity
from tests.helpers.trainers import quick_fit


def _sp(**kwargs):
    return lambda: HybridParallelStrategy(data_parallel_size=1, sequence_parallel_size=2, **kwargs)


@pytest.mark.parametrize("mode", ["ulysses", "ring"])
@pytest.mark.parametrize(  # the encoder under sp: slow tier (time); sp2 x tp2 runs it fast
    "model", ["gpt", "llama", pytest.param("encoder", marks=pytest.mark.slow)]
)
def test_sp2_matches_one_device(model, mode):
    assert_parity(model, _sp(sequence_parallel_mode=mode), 2, data_parallel_size=1, gradient_clip_val=0.05)


@pytest.mark.parametrize("mode", ["ulysses", pytest.param("ring", marks=pytest.mark.slow)])  # ring x tp is fast
def test_pp2_x_sp2_on_four_ranks(mode):
    def make():
        return PipelineParallelStrategy(
            pipeline_parallel_size=2, sequence_parallel_size=2, sequence_parallel_mode=mode, num_microbatches=4
        )

    assert_parity("llama", make, 4, data_parallel_size=1, gradient_clip_val=0.05)


def test_dp2_x_sp2_on_four_ranks():
    make = lambda: HybridParallelStrategy(data_parallel_size=2, sequence_parallel_size=2)  # noqa: E731
    assert_parity("gpt", make, 4, data_parallel_size=2)


@pytest.mark.parametrize("mode", ["ulysses", pytest.param("ring", marks=pytest.mark.slow)])  # (time) ring: slow tier
@pytest.mark.parametrize("policy", ["full", "selective", "no_attention"])
def test_recomputation_of_sequence_parallel_blocks(policy, mode):
    assert_parity("llama", _sp(recompute=policy, sequence_parallel_mode=mode), 2, data_parallel_size=1)


def _norm_lengths(rank, world_size, model):

    from lightning_parallel.trunk import discover_trunk
    from tests.helpers.parity import build

    module, data = build(model, 8, "sgd")
    block = discover_trunk(module).blocks[1]  # not the verified block: no copies call its hooks
    norm = next(m for n, m in block.named_modules() if "norm" in type(m).__name__.lower())
    seen = []
    norm.register_forward_hook(lambda mod, args, out: seen.append(args[0].shape[1]))
    quick_fit(module, data, _sp()(), 2, steps=1)
    return seen


def test_blocks_run_on_half_the_sequence():
    from tests.helpers.parity import SEQ_LEN

    for seen in run_distributed(_norm_lengths, 2, "llama", init_process_group=False):
        assert seen and set(seen) == {SEQ_LEN // 2}, seen


def _fit(rank, world_size, make_module, strategy_kwargs):

    module, data = make_module()
    strategy = HybridParallelStrategy(data_parallel_size=1, sequence_parallel_size=2, **strategy_kwargs)
    quick_fit(module, data, strategy, 2, steps=1)


def _llama(seq_len=16, **kwargs):
    def make():
        from examples.data import CharDataModule
        from examples.models import Llama

        data = CharDataModule(block_size=seq_len, batch_size=4, shuffle=False)
        return Llama(vocab_size=data.vocab_size, block_size=seq_len, **kwargs), data

    return make


def _no_attention():
    from examples.data import CharDataModule
    from tests.helpers.models import NoAttentionLM

    data = CharDataModule(block_size=16, batch_size=4, shuffle=False)
    return NoAttentionLM(vocab_size=data.vocab_size), data


@pytest.mark.parametrize(
    "make_module,kwargs,message",
    [
        (_llama(seq_len=15, n_layer=2, n_head=4, n_kv_head=2, dim=32, mlp_hidden=64), {},
         r"needs the sequence length \(15\) to be divisible by sequence_parallel_size \(2\)"),
        (_llama(n_layer=2, n_head=4, n_kv_head=1, dim=32, mlp_hidden=64), {},
         r"sequence_parallel_size=2 to divide the number of key/value heads \(1\) of DecoderLayer"),
        (_llama(seq_len=18, n_layer=2, n_head=4, n_kv_head=2, dim=32, mlp_hidden=64), {"sequence_parallel_mode": "ring"},
         r"sequence length \(18\) to be divisible by 2 x sequence_parallel_size \(4\)"),
        (_no_attention, {}, r"(?s)no anatomy of _NormBlock serves sequence parallelism.*the block computes no attention"),
    ],
)  # fmt: skip
def test_bad_input_is_named(make_module, kwargs, message):
    with pytest.raises(RankFailed, match=message):
        run_distributed(_fit, 2, make_module, kwargs, init_process_group=False, timeout=60)


def test_unsupported_combinations_are_refused_at_construction():
    with pytest.raises(ValueError, match="sequence_parallel_mode='zigzag'; choose one of"):
        HybridParallelStrategy(sequence_parallel_size=2, sequence_parallel_mode="zigzag")
    with pytest.raises(ValueError, match="cannot be combined with tp_sequence_parallel=True"):
        HybridParallelStrategy(sequence_parallel_size=2, tensor_parallel_size=2, tp_sequence_parallel=True)


def _trunk_kept_bytes(rank, world_size, mode):
    import copy

    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from examples.models import Llama
    from examples.models.llama import rope_tables
    from lightning_parallel.blocks import BlockConfig, parallelize
    from lightning_parallel.memory import kept_for_backward
    from lightning_parallel.trunk import discover_trunk

    torch.manual_seed(0)
    T, dim, heads = 256, 64, 4
    model = Llama(vocab_size=65, block_size=T, n_layer=4, n_head=heads, n_kv_head=2, dim=dim, mlp_hidden=128)
    x = torch.randn(2, T, dim, generator=torch.Generator().manual_seed(1)).requires_grad_()
    cos, sin = (t.float() for t in rope_tables(dim // heads, T))

    def run(blocks):
        h = x
        for block in blocks:
            h = block(h, cos, sin)
        return h

    single = discover_trunk(copy.deepcopy(model)).blocks
    whole, reference = kept_for_backward(lambda: run(single))
    trunk = discover_trunk(model)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("sp",))
    parallelize(model, BlockConfig(sp_mesh=mesh, sp_mode=mode))
    run(trunk.blocks)  # the first call verifies the stack on unsharded copies
    mine, out = kept_for_backward(lambda: run(trunk.blocks))
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    output = out.numel() * out.element_size()  # the trunk's output is whole on every rank
    return (mine - output) / (whole - output)


@pytest.mark.parametrize("mode", ["ulysses", "ring"])
def test_saved_activation_bytes_inside_the_trunk_are_one_over_sp(mode):
    for ratio in run_distributed(_trunk_kept_bytes, 2, mode):
        assert 0.45 <= ratio <= 0.6, ratio


def test_ring_sp4_matches_one_device():
    assert_parity("gpt", lambda: HybridParallelStrategy(sequence_parallel_size=4, sequence_parallel_mode="ring"), 4,
                  data_parallel_size=1)  # fmt: skip


def _ring_work(rank, world_size):
    from lightning_parallel.ring_attention import WORK
    from tests.helpers.parity import build

    module, data = build("llama", 8, "sgd")
    strategy = HybridParallelStrategy(sequence_parallel_size=4, sequence_parallel_mode="ring")
    WORK.clear()
    quick_fit(module, data, strategy, 4, steps=2)
    return sum(WORK.values())


def test_ring_attention_work_is_balanced_across_ranks_for_a_causal_mask():
    work = run_distributed(_ring_work, 4, init_process_group=False, timeout=120)
    assert min(work) > 0 and max(work) / min(work) <= 1.10, work
    # without the zig-zag, rank r would attend to r + 1/2 chunks' worth: 0.5 .. 3.5, a 7x spread at sp=4


def _collective_calls(rank, world_size, mode, policy):
    import lightning as L

    from lightning_parallel.memory import LiveTensorTracker
    from tests.helpers.parity import build

    class Count(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.tracker = LiveTensorTracker()
            self.tracker.__enter__()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.tracker.__exit__(None, None, None)

    module, data = build("llama", 8, "sgd")
    counter = Count()
    strategy = _sp(sequence_parallel_mode=mode, recompute=policy)()
    quick_fit(module, data, strategy, 2, steps=2, callbacks=[counter])
    counts = counter.tracker.counts  # every op the step dispatched, backward included
    return {str(op): n for op, n in counts.items() if any(k in str(op) for k in ("all_to_all", "alltoall", "ring"))}


# ring: slow tier (time); the keep-communication policy is the same for both modes
@pytest.mark.parametrize("mode", ["ulysses", pytest.param("ring", marks=pytest.mark.slow)])
def test_recomputation_never_runs_the_collectives_again(mode):
    calls = {p: run_distributed(_collective_calls, 2, mode, p, init_process_group=False)[0]
             for p in ("none", "full", "selective", "no_attention")}  # fmt: skip
    assert calls["none"] and all(c == calls["none"] for c in calls.values()), calls


def test_registered_name_trains_the_encoder():
    assert_parity("encoder", lambda: "sequence_parallel", 2, data_parallel_size=1)


@pytest.mark.parametrize(
    "model,mode", [("encoder", "ulysses"), pytest.param("gpt", "ring", marks=pytest.mark.slow), ("llama", "ring")]
)  # llama-ring is ring's fast cell
def test_sp2_x_tp2_on_four_ranks(model, mode):
    def make():
        return HybridParallelStrategy(
            data_parallel_size=1, sequence_parallel_size=2, sequence_parallel_mode=mode, tensor_parallel_size=2
        )

    assert_parity(model, make, 4, data_parallel_size=1, gradient_clip_val=0.05)


def _dropout_masks(rank, world_size):
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_parallel.blocks import BlockConfig, parallelize

    torch.manual_seed(0)
    holder = nn.Module()
    holder.layers = nn.ModuleList(
        [nn.TransformerEncoderLayer(16, 4, 32, dropout=0.5, batch_first=True) for _ in range(2)]
    )
    layer = holder.layers[0]
    layer.self_attn.dropout = 0.0  # token-wise dropout only: with equal tokens, equal masks give equal halves
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("sp",))
    parallelize(holder, BlockConfig(sp_mesh=mesh))  # verified in eval mode: random masks cannot match
    x = torch.ones(1, 8, 16)  # every token the same: equal masks would give equal outputs
    y = layer(x)
    return y[:, :4], y[:, 4:], torch.rand(1)


def test_dropout_masks_differ_across_sequence_shards_and_the_generator_stays_in_step():
    (first, second, after0), (_, _, after1) = run_distributed(_dropout_masks, 2)
    assert not torch.equal(first, second)  # the two halves of the sequence got different masks
    assert torch.equal(after0, after1)  # replicated regions keep drawing the same numbers


@pytest.mark.slow
def test_dp2_x_pp2_x_sp2_on_eight_ranks():
    def make():
        return PipelineParallelStrategy(
            data_parallel_size=2, pipeline_parallel_size=2, sequence_parallel_size=2, num_microbatches=2
        )

    assert_parity("llama", make, 8, data_parallel_size=2, gradient_clip_val=0.05)


def _masked_gpt2_block(rank, world_size, mode):
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    from lightning_parallel.blocks import BlockConfig, parallelize

    torch.manual_seed(0)
    config = GPT2Config(n_embd=32, n_head=4, attn_pdrop=0.0, resid_pdrop=0.0, _attn_implementation="sdpa")
    holder = torch.nn.Module()
    holder.h = torch.nn.ModuleList([GPT2Block(config).double() for _ in range(2)])
    block = holder.h[0]
    T = 16
    x = torch.randn(2, T, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    lowest = torch.finfo(torch.float64).min
    mask = torch.full((T, T), lowest, dtype=torch.float64).triu(1).expand(2, 1, T, T).clone()
    mask[1, ..., T - 3 :] = lowest  # padding: the second sequence's last three keys
    ref_block = copy.deepcopy(block)
    x_ref = x.clone().requires_grad_()
    ref = ref_block(x_ref, attention_mask=mask)
    ref = ref[0] if isinstance(ref, tuple) else ref
    ref.square().sum().backward()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("sp",))
    parallelize(holder, BlockConfig(sp_mesh=mesh, sp_mode=mode))
    xs = x.clone().requires_grad_()
    out = block(xs, attention_mask=mask)
    out = out[0] if isinstance(out, tuple) else out
    out.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in block.named_parameters()}
    for g in grads.values():
        dist.all_reduce(g)  # block parameters saw half the tokens each
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(xs.grad, x_ref.grad, rtol=1e-9, atol=1e-10)
    for n, p in ref_block.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-9, atol=1e-10, msg=n)


@pytest.mark.parametrize("mode", ["ulysses", "ring"])
def test_an_explicit_padding_mask_is_honoured(mode):
    pytest.importorskip("transformers")
    run_distributed(_masked_gpt2_block, 2, mode)


@pytest.mark.parametrize("mode", ["ulysses", "ring"])
@pytest.mark.parametrize("model", ["hf-llama", pytest.param("hf-gpt2", marks=pytest.mark.slow)])  # (time)
def test_hugging_face_models_train_under_sequence_parallelism(model, mode):
    pytest.importorskip("transformers")
    assert_parity(model, _sp(sequence_parallel_mode=mode), 2, data_parallel_size=1)
