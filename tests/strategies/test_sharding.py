"""Sharded data parallelism (``data_parallel_sharding="optimizer"``): the optimizer state and the
reduced gradients split over the dp ranks, parity with one process (docs/design.md, "Parity tests") in every layout it composes
with, and each rank holding about 1/dp of the optimizer state."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn

from lightning_parallel import HelixParallelStrategy, HybridParallelStrategy, PipelineParallelStrategy
from tests.helpers.distributed import run_distributed
from tests.helpers.parity import assert_parity, build


def _dp2() -> HybridParallelStrategy:
    return HybridParallelStrategy(data_parallel_size=2, data_parallel_sharding="optimizer")


@pytest.mark.parametrize("model", ["gpt", "llama", "encoder"])
def test_dp2_sharded_parity_with_accumulation_and_clipping(model):
    assert_parity(model, _dp2, 2, data_parallel_size=2, steps=2, accumulate_grad_batches=2, gradient_clip_val=0.05)


def test_dp2_sharded_float32_sgd_momentum_parity():
    assert_parity("gpt", _dp2, 2, data_parallel_size=2, dtype="float32")


def test_dp2_x_pp2_sharded_parity():
    def strategy():
        return PipelineParallelStrategy(
            pipeline_parallel_size=2, data_parallel_size=2, num_microbatches=2, data_parallel_sharding="optimizer"
        )

    assert_parity("gpt", strategy, 4, data_parallel_size=2, gradient_clip_val=0.05)


def test_dp2_x_tp2_sharded_parity():
    def strategy():
        return HybridParallelStrategy(data_parallel_size=2, tensor_parallel_size=2, data_parallel_sharding="optimizer")

    assert_parity("llama", strategy, 4, data_parallel_size=2, gradient_clip_val=0.05)


@pytest.mark.slow
def test_dp2_x_helix2_sharded_parity():
    def strategy():
        return HelixParallelStrategy(
            pipeline_parallel_size=2, data_parallel_size=2, num_microbatches=4, data_parallel_sharding="optimizer"
        )

    assert_parity("gpt", strategy, 4, data_parallel_size=2)


def _state_bytes(rank: int, world: int, sharding: str) -> tuple[int, int]:
    module, data = build("gpt", 4, "adamw")
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_steps=1, logger=False, enable_checkpointing=False,
        strategy=HybridParallelStrategy(data_parallel_size=2, data_parallel_sharding=sharding),
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, datamodule=data)
    state = trainer.optimizers[0].state
    per_element = [v for s in state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]  # not "step"
    nbytes = sum(v.numel() * v.element_size() for v in per_element)
    return nbytes, sum(p.numel() * p.element_size() for p in module.parameters())


def test_each_rank_holds_about_half_the_optimizer_state():
    full = run_distributed(_state_bytes, 2, "none", init_process_group=False)
    sharded = run_distributed(_state_bytes, 2, "optimizer", init_process_group=False)
    replica = full[0][0]
    assert full[1][0] == replica
    assert sum(b for b, _ in sharded) == replica  # every element's state on exactly one rank
    for nbytes, _ in sharded:
        assert nbytes <= 0.501 * replica, (nbytes, replica)


def _chunks_written(rank: int, world: int, model: str, tp: int, path: str) -> list[tuple]:
    """Fit, save a checkpoint; what this rank's optimizer_state handed to DCP for each per-element state tensor."""
    from torch.distributed.tensor import DTensor

    from lightning_parallel.flat_chunks import FlatChunk
    from tests.helpers.trainers import quick_fit

    module, data = build(model.removesuffix("+empty"), 4, "adamw")
    if model.endswith("+empty"):  # a parameter without elements, with a gradient: its state has none either
        module.empty = nn.Parameter(torch.zeros(0, 8))
        step = module.training_step
        module.training_step = lambda *args, **kwargs: step(*args, **kwargs) + module.empty.sum()
    strategy = HybridParallelStrategy(data_parallel_size=2, tensor_parallel_size=tp, data_parallel_sharding="optimizer")
    trainer = quick_fit(module, data, strategy, world, steps=2)
    trainer.save_checkpoint(path)
    out = []
    for name, state in strategy.optimizer_state(trainer.optimizers[0])["state"].items():
        for key, value in state.items():
            if isinstance(value, FlatChunk):
                out.append((name, key, value.start, value.block, value.offset, value.data.clone()))
            elif torch.is_tensor(value) and value.numel() and value.dim():  # gathered: only a permuted fused projection
                assert isinstance(value, DTensor) and name in strategy._tp_layout.permuted, (name, key)
                out.append((name, key, None, None, None, None))
    return out


@pytest.mark.parametrize(("model", "tp"), [("gpt", 1), ("gpt+empty", 1), ("llama", 2)])
def test_a_sharded_optimizer_state_is_saved_without_a_gather(model, tp, tmp_path):
    """Each rank hands DCP only its chunk (at most ceil(numel / dp) elements of its block) and the file holds
    the whole tensors those chunks make up."""
    from lightning_parallel.checkpoint import load_sharded

    path = str(tmp_path / "ckpt")
    ranks = run_distributed(_chunks_written, 2 * tp, model, tp, path, init_process_group=False, timeout=180)
    saved = load_sharded(path)["optimizer_states"][0]["state"]
    chunks = [c for r in ranks for c in r if c[2] is not None]
    assert len(chunks) >= 0.9 * sum(len(r) for r in ranks) and chunks
    covered: dict[tuple[str, str], int] = {}
    for name, key, start, block, offset, data in chunks:
        assert data.numel() <= -(-torch.Size(block).numel() // 2), (name, key, data.numel(), block)
        whole = saved[name][key]
        part = whole[tuple(slice(o, o + b) for o, b in zip(offset, block))].reshape(-1)
        torch.testing.assert_close(part[start : start + data.numel()], data, rtol=0, atol=0)
        covered[(name, key)] = covered.get((name, key), 0) + data.numel()
    for (name, key), n in covered.items():  # the dp chunks of every block together: every element once per replica
        assert n % saved[name][key].numel() == 0, (name, key, n)
    if model.endswith("+empty"):
        assert saved["empty"]["exp_avg"].shape == (0, 8) and saved["empty"]["exp_avg_sq"].shape == (0, 8)


def test_unknown_sharding_is_refused():
    with pytest.raises(ValueError, match=r"data_parallel_sharding='zero3'.*\('none', 'optimizer', 'full'\)"):
        HybridParallelStrategy(data_parallel_sharding="zero3")


# ------------------------------------------------------------------------------ full sharding (FSDP2)


def _full(**kwargs):
    return lambda: HybridParallelStrategy(data_parallel_size=2, data_parallel_sharding="full", **kwargs)


def _full_pp(**kwargs):
    def make():
        return PipelineParallelStrategy(
            data_parallel_size=2, pipeline_parallel_size=2, num_microbatches=4, data_parallel_sharding="full", **kwargs
        )

    return make


@pytest.mark.parametrize("model", ["gpt", "llama", "encoder"])
def test_dp2_fully_sharded_parity_with_accumulation_and_clipping(model):
    assert_parity(model, _full(), 2, data_parallel_size=2, steps=2, accumulate_grad_batches=2, gradient_clip_val=0.05)


def test_dp2_fully_sharded_float32_sgd_parity():
    assert_parity("gpt", _full(), 2, data_parallel_size=2, dtype="float32")


@pytest.mark.parametrize("model", ["gpt", pytest.param("llama", marks=pytest.mark.slow)])  # (time)
def test_dp2_x_pp2_fully_sharded_parity(model):
    """The tied embedding and head of the GPT are one unit, held by both stages; the Llama's are separate."""
    assert_parity(model, _full_pp(), 4, data_parallel_size=2, gradient_clip_val=0.05)


@pytest.mark.slow
def test_fully_sharded_with_recomputation_interleaving_and_deferred_init():
    assert_parity("gpt", _full(recompute="selective"), 2, data_parallel_size=2)
    assert_parity("llama", _full_pp(recompute="full"), 4, data_parallel_size=2)
    assert_parity("gpt", _full_pp(schedule="interleaved_1f1b"), 4, data_parallel_size=2, gradient_clip_val=0.05)
    assert_parity("gpt-empty-init", _full_pp(), 4, data_parallel_size=2)


def test_a_deferred_model_is_fully_sharded_with_parity():
    assert_parity("gpt-deferred", _full(), 2, data_parallel_size=2)


def _held_bytes(rank: int, world: int, sharding: str) -> tuple[int, int, int, int]:
    from torch.distributed.tensor import DTensor

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    module, data = build("gpt", 4, "adamw")
    sizes = {}

    class Measure(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            params = list({id(p): p for p in pl_module.parameters()}.values())
            sizes["params"] = sum(local(p).numel() for p in params)
            sizes["grads"] = sum(local(p.grad).numel() for p in params if p.grad is not None)

    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_steps=1, logger=False, enable_checkpointing=False, callbacks=[Measure()],
        strategy=HybridParallelStrategy(data_parallel_size=2, data_parallel_sharding=sharding),
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, datamodule=data)
    state = [v for s in trainer.optimizers[0].state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
    total = sum(p.numel() for p in build("gpt", 4, "adamw")[0].parameters())
    return sizes["params"], sizes["grads"], sum(local(v).numel() for v in state), total


def test_full_sharding_halves_parameters_gradients_and_optimizer_state():
    ranks = run_distributed(_held_bytes, 2, "full", init_process_group=False)
    total = ranks[0][3]
    assert sum(params for params, _, _, _ in ranks) == total  # every element on exactly one rank
    for params, grads, state, _ in ranks:
        assert params <= 0.51 * total, (params, total)  # dim-0 shards of every tensor (uneven where odd)
        assert grads == params and state == 2 * params  # AdamW: exp_avg and exp_avg_sq


def test_full_sharding_refuses_helix_naming_optimizer_sharding():
    make = lambda: HelixParallelStrategy(pipeline_parallel_size=2, data_parallel_size=2, data_parallel_sharding="full")  # noqa: E731
    with pytest.raises(ValueError, match=r"'helix' is not supported: helix runs each block cut.*'optimizer'"):
        L.Trainer(accelerator="cpu", devices=4, strategy=make(), logger=False)


def _fit_with(rank: int, world: int, make_optimizer) -> None:
    module, data = build("gpt", 4, "sgd")
    module.configure_optimizers = lambda: make_optimizer(module.parameters())
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_steps=1, logger=False, enable_checkpointing=False,
        strategy=HybridParallelStrategy(data_parallel_size=2, data_parallel_sharding="optimizer"),
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, datamodule=data)


def test_a_non_elementwise_optimizer_is_refused():
    from tests.helpers.distributed import RankFailed

    with pytest.raises(RankFailed, match=r"only for element-wise optimizers .*LBFGS is not one of them"):
        run_distributed(_fit_with, 2, lambda params: torch.optim.LBFGS(params), init_process_group=False, timeout=60)


class _WithScalar(L.LightningModule):
    """A linear model with a learnable 0-dim temperature (which stays whole under sharding)."""

    def __init__(self, optimizer: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer, self.temperature, self.kind = (
            torch.nn.Linear(8, 5),
            torch.nn.Parameter(torch.tensor(1.5)),
            optimizer,
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.layer(x) / self.temperature, y)

    def configure_optimizers(self):
        return {"adagrad": torch.optim.Adagrad, "adamw": torch.optim.AdamW}[self.kind](self.parameters(), lr=0.1)


def _fit_dp2(module: L.LightningModule, data: torch.utils.data.Dataset, sharding: str) -> L.Trainer:
    """Three float64 steps at dp=2 with the given sharding, batch 4, clipping at 0.5."""
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_steps=3, logger=False, enable_checkpointing=False, precision="64-true",
        strategy=HybridParallelStrategy(data_parallel_size=2, data_parallel_sharding=sharding),
        enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=0.5,
    )  # fmt: skip
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=4))
    return trainer


def _scalar_run(rank: int, world: int, sharding: str, optimizer: str) -> dict:
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(32, 8, generator=g), torch.randint(0, 5, (32,), generator=g))
    module = _WithScalar(optimizer)
    _fit_dp2(module, data, sharding)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("optimizer", ["adagrad", "adamw"])
def test_optimizers_with_initial_state_and_0_dim_parameters_shard_exactly(optimizer):
    """Adagrad creates whole-shaped state in its constructor (cut at the first step); a 0-dim parameter is
    stepped whole on every rank: both equal plain data parallelism, clipping included."""
    plain = run_distributed(_scalar_run, 2, "none", optimizer, init_process_group=False)[0]
    sharded = run_distributed(_scalar_run, 2, "optimizer", optimizer, init_process_group=False)
    for rank in sharded:
        for k, v in plain.items():
            torch.testing.assert_close(rank[k], v, rtol=1e-12, atol=1e-14, msg=k)
    assert not torch.equal(plain["temperature"], torch.tensor(1.5, dtype=torch.float64))


class _Stem(nn.Module):
    """A module outside the trunk that owns a parameter and has a child that owns one (torchvision's ViT
    encoder holds ``pos_embedding`` next to its layers): FSDP units are made children first."""

    def __init__(self, vocab: int, width: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.scale = nn.Parameter(torch.ones(width))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.embed(idx) * self.scale


class _StemModel(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = _Stem(16, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
        self.head = nn.Linear(8, 16)

    def training_step(self, batch, batch_idx):
        x = self.stem(batch[0])
        for block in self.blocks:
            x = torch.tanh(block(x))
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), batch[1].flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _stem_run(rank: int, world: int, sharding: str) -> dict:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 16, (16, 6), generator=g)
    data = torch.utils.data.TensorDataset(tokens, tokens.roll(1, dims=1))
    return _fit_dp2(_StemModel(), data, sharding).strategy.full_state_dict()


def test_a_module_with_its_own_parameter_and_a_child_s_is_fully_sharded_exactly():
    plain = run_distributed(_stem_run, 2, "none", init_process_group=False)[0]
    full = run_distributed(_stem_run, 2, "full", init_process_group=False)[0]
    assert plain.keys() == full.keys() and "stem.scale" in full
    for name in plain:
        torch.testing.assert_close(full[name], plain[name], rtol=1e-9, atol=1e-12, msg=name)
