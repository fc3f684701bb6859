"""Dropout under tensor and sequence parallelism as on one device, in distribution (``lightning_parallel.rng``):
sharded activations (attention heads, the MLP's hidden layer, token shards) get each rank's own masks,
replicated ones (the hidden state after a row-parallel reduction) the same masks on every rank, and a resume
from a checkpoint continues with the masks of the uninterrupted run.

The masks are read from the real kernels: every dropout (SDPA's math path on CPU, ``nn.Dropout``) draws its keep
mask with ``aten.bernoulli_``, which :class:`Masks` records in call order. Two independent masks at rate p agree
on a fraction ``(1-p)^2 + p^2`` of their elements; masks drawn from one stream state agree on all of them."""

from __future__ import annotations

import os
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_parallel import HybridParallelStrategy
from tests.helpers.distributed import run_distributed

P = 0.1
INDEPENDENT = (1 - P) ** 2 + P**2  # 0.82: the agreement of two independent masks
TOL = 0.03  # about 5 standard errors at the >= 4096 elements compared below


class Masks(TorchDispatchMode):
    """The keep mask of every dropout drawn while active, in call order."""

    def __init__(self) -> None:
        super().__init__()
        self.masks: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.bernoulli_.float:
            self.masks.append(args[0].detach().clone().bool())
        return out


def agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a == b).float().mean().item()


def _gpt_blocks(n: int = 2, n_head: int = 4, n_embd: int = 32) -> nn.Module:
    from examples.models.gpt import Block

    holder = nn.Module()
    holder.h = nn.ModuleList([Block(n_embd, n_head, P, bias=True) for _ in range(n)])
    return holder


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _blocks_rank(rank, world_size, layout, model="gpt", sources=None, T=16):
    """The example blocks (dropout P everywhere) under ``layout`` on this rank, one training forward: the masks
    of each block call, each block's output (replicated: the whole hidden state on every rank) and a number
    the default generator draws afterwards."""
    from lightning_parallel.blocks import BlockConfig, parallelize

    torch.manual_seed(0)
    if model == "gpt":
        holder = _gpt_blocks()
        x = torch.randn(8, T, 32)
    else:  # the encoder: its MLP's hidden layer has a dropout between the column- and row-parallel projections
        holder = nn.Module()
        holder.layers = nn.ModuleList([nn.TransformerEncoderLayer(32, 4, 64, P, batch_first=True) for _ in range(2)])
        x = torch.randn(8, T, 32)
    if layout == "tp2":
        config = BlockConfig(tp_mesh=_mesh((2,), ("tp",)), sources=sources)
    elif layout == "tp2sp":  # Megatron sequence parallelism inside tensor parallelism
        config = BlockConfig(tp_mesh=_mesh((2,), ("tp",)), tp_sequence_parallel=True)
    elif layout == "sp2":
        config = BlockConfig(sp_mesh=_mesh((2,), ("sp",)))
    else:  # sp2tp2
        mesh = _mesh((2, 2), ("sp", "tp"))
        config = BlockConfig(sp_mesh=mesh["sp"], tp_mesh=mesh["tp"])
    parallelize(holder, config)
    blocks = holder.h if model == "gpt" else holder.layers
    with torch.no_grad():  # the first call resolves and verifies the anatomy (in eval mode: masks cannot match)
        blocks.eval()
        for block in blocks:
            block(x)
        blocks.train()
    if sources is not None:
        assert blocks[0].forward.anatomy_name == "the traced graph"
    outputs, per_block = [], []
    h = x
    for block in blocks:
        with Masks() as rec:
            h = block(h)
        per_block.append(rec.masks)
        outputs.append(h.detach().clone())
    h.sum().backward()  # the masks are usable by autograd (and nothing is drawn in backward)
    return per_block, outputs, torch.rand(4)


def _in_step_and_replicated(ranks):
    """Every rank's block outputs bitwise equal, and the default generators in the same state afterwards."""
    (_, outputs0, after0), *others = ranks
    for _, outputs, after in others:
        assert all(torch.equal(a, b) for a, b in zip(outputs0, outputs)), "replicated activations differ"
        assert torch.equal(after0, after), "the default generators left the ranks in different states"


# ------------------------------------------------------------------------------------- tensor parallelism
def _fit_tp2_rank(rank, world_size):
    """The example GPT (4 heads, dropout P) one step under HybridParallelStrategy(tp=2): the masks of each
    block's call and each block's output (after the row-parallel reduction) in the training step."""
    from examples.data import CharDataModule
    from examples.models import GPT
    from tests.helpers.trainers import quick_fit

    torch.manual_seed(0)
    data = CharDataModule(block_size=16, batch_size=8, shuffle=False)
    module = GPT(vocab_size=data.vocab_size, block_size=16, n_layer=2, n_head=4, n_embd=32, dropout=P,
                 optimizer="sgd", lr=0.05)  # fmt: skip
    per_block: list[list[torch.Tensor]] = []
    outputs: list[torch.Tensor] = []

    active: dict[int, Masks] = {}

    def before(block, args):
        if block.training:
            active[id(block)] = Masks().__enter__()

    def after(block, args, out):
        rec = active.pop(id(block), None)
        if rec is not None:
            rec.__exit__(None, None, None)
            if len(per_block) < 2:  # the first training call of each block
                per_block.append(rec.masks)
                outputs.append(out.detach().clone())

    for block in module.transformer.h:
        block.register_forward_pre_hook(before)
        block.register_forward_hook(after)
    quick_fit(module, data, HybridParallelStrategy(data_parallel_size=1, tensor_parallel_size=2), world_size,
              steps=1, precision="32-true")  # fmt: skip
    return per_block, outputs, torch.rand(4)


@pytest.fixture(scope="module")
def tp2_fit():
    return run_distributed(_fit_tp2_rank, 2, init_process_group=False, timeout=150)


def test_tp2_attention_masks_of_heads_h_and_h_plus_half_are_independent(tp2_fit):
    """Rank 0 holds heads 0-1, rank 1 heads 2-3: global heads h and h+2 must not share their masks (before
    lightning_parallel.rng they agreed on 100%; gpu-audit S4)."""
    (masks0, _, _), (masks1, _, _) = tp2_fit
    for block in range(2):
        attention0, attention1 = masks0[block][0], masks1[block][0]  # the block's first dropout: attention
        assert attention0.shape == attention1.shape == (8, 2, 16, 16)
        agree = agreement(attention0, attention1)
        print(f"tp2 block {block}: global heads h~h+2 agree {agree:.4f} (independent: {INDEPENDENT:.2f})")
        assert abs(agree - INDEPENDENT) < TOL, agree
        # residual dropout after the row-parallel reduction, MLP output dropout: replicated, the same masks
        for replicated0, replicated1 in zip(masks0[block][1:], masks1[block][1:]):
            assert torch.equal(replicated0, replicated1)


def test_tp2_replicated_activations_stay_bitwise_identical_with_dropout(tp2_fit):
    (masks0, _, _), _ = tp2_fit
    assert [len(m) for m in masks0] == [3, 3]  # attention, residual and MLP dropout drew in each block
    _in_step_and_replicated(tp2_fit)


@pytest.mark.parametrize(  # traced: slow tier (time); the traced plan's f/g enter rng.enter_sharded as the adapter's
    "sources", [pytest.param(None, id="adapter"), pytest.param(("traced",), id="traced", marks=pytest.mark.slow)]
)
def test_tp2_masks_per_rank_for_each_anatomy(sources):
    """The same rule whether the block runs a hand-written adapter (module hooks on the projections) or its
    traced graph (Megatron's f and g in the graph)."""
    ranks = run_distributed(_blocks_rank, 2, "tp2", "gpt", sources, timeout=120)
    (masks0, _, _), (masks1, _, _) = ranks
    for block in range(2):
        assert len(masks0[block]) == 3
        agree = agreement(masks0[block][0], masks1[block][0])
        print(f"tp2 {sources or 'adapter'} block {block}: heads h~h+2 agree {agree:.4f}")
        assert abs(agree - INDEPENDENT) < TOL, agree
        assert all(torch.equal(a, b) for a, b in zip(masks0[block][1:], masks1[block][1:]))
    _in_step_and_replicated(ranks)


def test_tp2_mlp_hidden_dropout_is_per_rank_and_the_residual_dropout_replicated():
    """nn.TransformerEncoderLayer: dropout between linear1 (column-parallel) and linear2 (row-parallel) holds
    each rank's half of the hidden units: independent masks; dropout1/dropout2 after the reductions: equal."""
    ranks = run_distributed(_blocks_rank, 2, "tp2", "encoder", timeout=120)
    (masks0, _, _), (masks1, _, _) = ranks
    for block in range(2):
        # attention (B, 2 heads, T, T), dropout1 (B, T, 32), hidden (B, T, 32 of 64), dropout2 (B, T, 32)
        attention, dropout1, hidden, dropout2 = zip(masks0[block], masks1[block])
        assert hidden[0].shape == (8, 16, 32)
        for name, (a, b) in (("attention", attention), ("hidden", hidden)):
            agree = agreement(a, b)
            print(f"tp2 encoder block {block} {name}: ranks agree {agree:.4f}")
            assert abs(agree - INDEPENDENT) < TOL, (name, agree)
        assert torch.equal(*dropout1) and torch.equal(*dropout2)
    _in_step_and_replicated(ranks)


def test_tp2_megatron_sequence_parallel_masks_every_shard_on_its_own():
    """tp_sequence_parallel=True: norms, residuals and their dropout hold 1/tp of the tokens, attention 1/tp of
    the heads: every mask is the rank's own; the gathered block outputs stay identical."""
    ranks = run_distributed(_blocks_rank, 2, "tp2sp", "gpt", timeout=120)
    (masks0, _, _), (masks1, _, _) = ranks
    for block in range(2):
        assert len(masks0[block]) == 3
        for a, b in zip(masks0[block], masks1[block]):
            agree = agreement(a, b)
            print(f"tp2 + tp_sequence_parallel block {block} {tuple(a.shape)}: ranks agree {agree:.4f}")
            assert abs(agree - INDEPENDENT) < TOL, agree
    _in_step_and_replicated(ranks)


# ----------------------------------------------------------------------------------- sequence parallelism
def test_sp2_ulysses_heads_and_token_shards_mask_on_their_own():
    """Ulysses: attention runs on 1/sp of the heads, the rest on 1/sp of the tokens: every mask the rank's own;
    the gathered block outputs (replicated) identical."""
    ranks = run_distributed(_blocks_rank, 2, "sp2", "gpt", timeout=120)
    (masks0, _, _), (masks1, _, _) = ranks
    for block in range(2):
        assert masks0[block][0].shape == (8, 2, 16, 16)  # heads 0-1 / 2-3, the whole sequence
        for a, b in zip(masks0[block], masks1[block]):
            agree = agreement(a, b)
            print(f"sp2 block {block} {tuple(a.shape)}: ranks agree {agree:.4f}")
            assert abs(agree - INDEPENDENT) < TOL, agree
    _in_step_and_replicated(ranks)


def test_sp2_x_tp2_masks_per_head_group_and_replicated_over_tp():
    """sp=2 x tp=2 (4 ranks): the attention heads are split over both (each rank its own mask), the token
    shards' residual and MLP-output dropout over sp only (equal over tp, independent over sp)."""
    ranks = run_distributed(_blocks_rank, 4, "sp2tp2", "gpt", timeout=150)
    masks = [r[0] for r in ranks]  # rank = 2 * sp + tp
    for block in range(2):
        attention = [m[block][0] for m in masks]
        assert attention[0].shape == (8, 1, 16, 16)
        for i in range(4):
            for j in range(i + 1, 4):
                agree = agreement(attention[i], attention[j])
                assert abs(agree - INDEPENDENT) < TOL, (i, j, agree)
        for k in (1, 2):  # residual and MLP-output dropout on a token shard
            assert torch.equal(masks[0][block][k], masks[1][block][k])  # same sp rank, tp ranks 0 and 1
            assert torch.equal(masks[2][block][k], masks[3][block][k])
            agree = agreement(masks[0][block][k], masks[2][block][k])
            print(f"sp2 x tp2 block {block} dropout {k}: sp ranks agree {agree:.4f}")
            assert abs(agree - INDEPENDENT) < TOL, agree
    _in_step_and_replicated(ranks)


# ---------------------------------------------------------------------------------------- helix x tp
def _helix_parts_rank(rank, world_size):
    """HelixPipe's parts of the example block (its verified split on tp=2 shards, as HelixParallelStrategy makes
    them), called part by part in training: each part's masks, the post part's (replicated) output."""
    from lightning_parallel.blocks import BlockConfig, BlockLayer, Layouts

    torch.manual_seed(0)
    block = _gpt_blocks(1).h[0]
    x = torch.randn(8, 16, 32)
    config = BlockConfig(tp_mesh=_mesh((2,), ("tp",)), split=True)
    split = BlockLayer(None, config, Layouts.for_config(config)).commit(0, block, x, (), {}).stack
    block.train()
    with Masks() as pre:
        (q, k, v), state = split.pre(block, x, (), {})
    with Masks() as attention:
        out = split.attention(block, q, k, v, (), {})
    with Masks() as post:
        y = split.post(block, out, state, (), {})
    return (pre.masks, attention.masks, post.masks), [y.detach()], torch.rand(4)


def test_helix_x_tp2_attention_stage_masks_per_rank():
    ranks = run_distributed(_helix_parts_rank, 2, timeout=120)
    ((pre0, attention0, post0), _, _), ((_, attention1, post1), _, _) = ranks
    assert pre0 == [] and len(attention0) == 1 and len(post0) == 2
    agree = agreement(attention0[0], attention1[0])
    print(f"helix x tp2 attention part: heads h~h+2 agree {agree:.4f}")
    assert abs(agree - INDEPENDENT) < TOL, agree
    assert all(torch.equal(a, b) for a, b in zip(post0, post1))  # residual and MLP dropout: replicated
    _in_step_and_replicated(ranks)


# --------------------------------------------------------------------------------------------- resume
def _train_rank(rank, world_size, epochs, ckpt_in=None, ckpt_out=None):
    """The example GPT with dropout P everywhere under tp=2, float64, AdamW: ``epochs`` epochs of 2 batches,
    saving at the end of the last one (ModelCheckpoint); the loss of every step and the final parameters."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from examples.data import CharDataModule
    from examples.models import GPT
    from tests.helpers.parity import Recorder

    torch.manual_seed(0)
    data = CharDataModule(block_size=16, batch_size=8, shuffle=False)
    module = GPT(vocab_size=data.vocab_size, block_size=16, n_layer=2, n_head=4, n_embd=32, dropout=P,
                 optimizer="adamw", lr=1e-3).double()  # fmt: skip
    recorder = Recorder()
    callbacks = [recorder]
    if ckpt_out is not None:
        path = Path(ckpt_out)
        callbacks.append(ModelCheckpoint(dirpath=path.parent, filename=path.stem, every_n_epochs=1, save_top_k=1,
                                         enable_version_counter=False))  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=HybridParallelStrategy(data_parallel_size=1,
        tensor_parallel_size=2), precision="64-true", max_epochs=epochs, limit_train_batches=2, limit_val_batches=0,
        num_sanity_val_steps=0, logger=False, enable_checkpointing=ckpt_out is not None, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=os.path.dirname(ckpt_out or ckpt_in), callbacks=callbacks,
    )  # fmt: skip
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_in)
    return [float(x) for x in recorder.records.losses], recorder.records.params[-1]


def test_tp2_resume_with_dropout_continues_the_straight_run_exactly(tmp_path):
    """2 steps, save, resume for 2 more = 4 steps straight, with dropout 0.1 in attention, residual and MLP:
    each rank's generators are in the checkpoint (lp_rng), so the resumed steps draw the same masks."""
    from lightning_parallel.checkpoint import load_sharded
    from tests.helpers.parity import TOLERANCES

    run = lambda *a, **kw: run_distributed(_train_rank, 2, *a, init_process_group=False, timeout=150, **kw)[0]  # noqa: E731
    straight, final = run(2, ckpt_out=str(tmp_path / "straight.ckpt"))
    ckpt = str(tmp_path / "epoch.ckpt")
    first, _ = run(1, ckpt_out=ckpt)
    saved = load_sharded(ckpt)
    assert set(saved["lp_rng"]) == {"0", "1"} and saved["lp_rng_world_size"] == 2
    second, resumed_final = run(2, ckpt_in=ckpt)
    assert len(first) == 2 and len(second) == 2
    torch.testing.assert_close(torch.tensor(first + second), torch.tensor(straight), **TOLERANCES["float64"])
    for name, value in final.items():
        torch.testing.assert_close(resumed_final[name], value, **TOLERANCES["float64"], msg=name)
