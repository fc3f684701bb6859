"""Deferred initialisation: a model built on the meta device (``configure_model()`` or
``Trainer.init_module(empty_init=True)``) is materialised at set-up, each rank only what it holds,
initialised module by module from the run's seed (``lightning_parallel.materialize``), so that every
layout reproduces one process that initialises the whole model by the same rule (parity, docs/design.md "Parity tests").
A model that cannot be initialised that way is refused with the tensors it lacks, on every rank."""

from __future__ import annotations

import math
import re

import lightning as L
import pytest
import torch
from torch import nn

from lightning_parallel import HelixParallelStrategy, HybridParallelStrategy, PipelineParallelStrategy
from lightning_parallel.errors import ConfigurationError
from lightning_parallel.materialize import check_set, initialize_, materialize_
from tests.helpers.distributed import RankFailed, run_distributed
from tests.helpers.parity import assert_parity

LAYOUTS = {
    "pipeline pp=2": (lambda: PipelineParallelStrategy(pipeline_parallel_size=2, num_microbatches=4), 2, 1),
    "helix p=2": (lambda: HelixParallelStrategy(pipeline_parallel_size=2, num_microbatches=4), 2, 1),
    "tensor_parallel tp=2": (lambda: HybridParallelStrategy(tensor_parallel_size=2, data_parallel_size=1), 2, 1),
    "hybrid dp=2": (lambda: HybridParallelStrategy(data_parallel_size=2), 2, 2),
    "hybrid dp=2 full": (lambda: HybridParallelStrategy(data_parallel_size=2, data_parallel_sharding="full"), 2, 2),
    "hybrid dp=2 optimizer": (
        lambda: HybridParallelStrategy(data_parallel_size=2, data_parallel_sharding="optimizer"),
        2,
        2,
    ),
    "sequence_parallel sp=2": (lambda: HybridParallelStrategy(sequence_parallel_size=2, data_parallel_size=1), 2, 1),
    "pipeline pp=2 x tp=2": (
        lambda: PipelineParallelStrategy(pipeline_parallel_size=2, tensor_parallel_size=2, num_microbatches=4),
        4,
        1,
    ),
    "helix p=2 x tp=2": (lambda: HelixParallelStrategy(pipeline_parallel_size=2, tensor_parallel_size=2), 4, 1),
    "helix p=2 x sp=2": (lambda: HelixParallelStrategy(pipeline_parallel_size=2, sequence_parallel_size=2), 4, 1),
}


@pytest.mark.parametrize(
    "layout",
    [pytest.param(k, marks=pytest.mark.slow) if k in ("hybrid dp=2 optimizer", "helix p=2 x tp=2", "helix p=2 x sp=2")
     else k for k in LAYOUTS],  # (time; helix x tp and x sp materialise as helix and tp=2 do, both fast)
)  # fmt: skip
def test_configure_model_on_meta_trains_with_parity(layout):
    strategy, world, dp = LAYOUTS[layout]
    assert_parity("gpt-deferred", strategy, world, data_parallel_size=dp)


@pytest.mark.parametrize("layout", ["pipeline pp=2", "tensor_parallel tp=2"])
def test_init_module_empty_init_is_materialised_with_parity(layout):
    strategy, world, dp = LAYOUTS[layout]
    assert_parity("gpt-empty-init", strategy, world, data_parallel_size=dp)


@pytest.mark.parametrize(
    "layout",
    [
        "pipeline pp=2",
        "helix p=2",
        "tensor_parallel tp=2",
        pytest.param("sequence_parallel sp=2", marks=pytest.mark.slow),  # (time) the broadcast is tp's and dp's
        pytest.param("hybrid dp=2", marks=pytest.mark.slow),
        pytest.param("helix p=2 x tp=2", marks=pytest.mark.slow),
    ],
)
def test_ranks_initialised_differently_start_from_rank_0(layout):
    """Processes without a common seed build different weights (each rank here seeds with its rank): every
    rank starts from rank 0's values for what it shares with rank 0, so training equals one process that
    built rank 0's model (seed 0), in every layout, not only along dp."""
    strategy, world, dp = LAYOUTS[layout]
    assert_parity("gpt-rank-seeded", strategy, world, data_parallel_size=dp)


class _KeepsOnHost:
    """Eager blocks kept in host memory until their first call, as on a GPU (here the host is the device):
    the set-up broadcast runs block by block, each block moves at its first call."""

    def keeps_on_host(self):
        return True

    def setup(self, trainer):
        super().setup(trainer)
        kept = self._deferred.on_host()
        assert kept and len(kept) == len(self._deferred.blocks), (len(kept), len(self._deferred.blocks))

    def on_train_end(self):
        assert not self._deferred.blocks  # every block moved at its first call
        super().on_train_end()


_ON_HOST = {
    "helix p=2": lambda: type("Helix", (_KeepsOnHost, HelixParallelStrategy), {})(pipeline_parallel_size=2),
    "tensor_parallel tp=2": lambda: type("TP", (_KeepsOnHost, HybridParallelStrategy), {})(
        tensor_parallel_size=2, data_parallel_size=1
    ),
}


@pytest.mark.parametrize("layout", list(_ON_HOST))
def test_eager_blocks_kept_on_the_host_until_their_first_call_train_with_parity(layout):
    """Ranks initialised differently (each seeds with its rank) start from rank 0's values: the blocks kept on
    the host are broadcast one at a time at set-up, then moved at their first call, with parity."""
    assert_parity("gpt-rank-seeded", _ON_HOST[layout], 2, data_parallel_size=1)


def test_pipeline_materialises_only_its_stage():
    """Each pipeline rank materialises its own blocks: the other stage's stay on meta from the start."""

    def rank(r: int, world: int) -> tuple[list[int], float]:
        from tests.helpers.parity import build

        module, data = build("gpt-deferred", 4, "sgd")
        seen: dict = {}

        class Probe(L.Callback):
            def on_fit_start(self, trainer, pl_module):
                blocks = pl_module.transformer.h
                seen["held"] = [j for j, b in enumerate(blocks) if not b.attn.c_attn.weight.is_meta]

        trainer = L.Trainer(
            accelerator="cpu", devices=2, strategy=PipelineParallelStrategy(pipeline_parallel_size=2),
            max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, callbacks=[Probe()],
        )  # fmt: skip
        trainer.fit(module, datamodule=data)
        return seen["held"], trainer.strategy.stage

    results = run_distributed(rank, 2, init_process_group=False)
    by_stage = {stage: held for held, stage in results}
    assert by_stage == {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}


class _RawParameter(nn.Module):
    """Owns a parameter and a non-persistent buffer but has no ``reset_parameters()``."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.register_buffer("table", torch.arange(4.0), persistent=False)


def test_materialize_refuses_tensors_nothing_initialises():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), _RawParameter())
        model[1].register_buffer("index", torch.arange(4))  # an integer buffer: no NaN to see, its version tells
    message = check_set(materialize_(model, torch.device("cpu"), seed=0))
    assert re.search(r"1 \(_RawParameter\): scale, table, index.*reset_parameters", message), message


def test_a_restored_checkpoint_initialises_the_persistent_tensors():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), _RawParameter())
    record = materialize_(model, torch.device("cpu"), seed=0)
    model.load_state_dict({**model.state_dict(), "1.scale": torch.ones(4)})  # what Lightning's restore does
    # the parameter came from the checkpoint; the non-persistent buffer never does
    assert re.search(r"_RawParameter\): table\.", check_set(record))
    model[1].table.copy_(torch.arange(4.0))
    assert check_set(record) is None


def test_materialize_equals_initialize_and_keeps_ties():
    with torch.device("meta"):
        meta = nn.ModuleDict(dict(emb=nn.Embedding(10, 4), head=nn.Linear(4, 10, bias=False)))
    meta.emb.weight = meta.head.weight
    eager = nn.ModuleDict(dict(emb=nn.Embedding(10, 4), head=nn.Linear(4, 10, bias=False)))
    eager.emb.weight = eager.head.weight
    materialize_(meta, torch.device("cpu"), seed=7)
    initialize_(eager, seed=7)
    assert meta.emb.weight is meta.head.weight
    for (n, a), (_, b) in zip(meta.state_dict().items(), eager.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=n)
    other = nn.Linear(4, 10, bias=False)
    initialize_(other, seed=8)
    assert not torch.equal(other.weight, eager.head.weight)


def _deferred_llama(r: int, world: int, strategy: str) -> str:
    from examples.data import CharDataModule
    from examples.models.llama import Llama

    data = CharDataModule(block_size=16, batch_size=4, shuffle=False)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=LAYOUTS[strategy][0](), max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with trainer.init_module(empty_init=True):
        module = Llama(vocab_size=data.vocab_size, block_size=16, n_layer=4, n_head=4, dim=32, mlp_hidden=64)
    try:
        trainer.fit(module, datamodule=data)
    except ConfigurationError as err:
        return str(err)
    return "trained"


def test_deferred_llama_refused_on_every_rank_naming_the_rope_tables():
    """The example Llama keeps its RoPE tables as non-persistent buffers of the LightningModule, which
    nothing recomputes: refused with the same error on both ranks, before the first step."""
    messages = run_distributed(_deferred_llama, 2, "tensor_parallel tp=2", init_process_group=False)
    assert messages[0] == messages[1]
    assert "<root> (Llama): rope_cos, rope_sin" in messages[0] and "reset_parameters()" in messages[0]


class _Gain(nn.Module):
    """A parameter allocated and never written (uninitialised memory on one process), with no
    ``reset_parameters()``: deferred, nothing initialises it."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def _deferred_gain(r: int, world: int, strategy: str, in_block: bool = False) -> str:
    from tests.helpers.parity import build

    module, data = build("gpt-deferred", 4, "adamw")
    build_model = module._build

    def with_gain() -> None:
        build_model()
        gain = _Gain(module.hparams.n_embd)  # on meta too: configure_model builds under torch.device("meta")
        if in_block:
            module.transformer.h[1].gain = gain
        else:
            module.gain = gain

    module._build = with_gain
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=LAYOUTS[strategy][0](), max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    try:
        trainer.fit(module, datamodule=data)
    except ConfigurationError as err:
        return str(err)
    return "trained"


def test_an_uninitialised_parameter_is_refused_after_full_sharding():
    """Full sharding replaces the materialised parameters by FSDP's DTensor shards; their NaN fill is still
    found, on every rank."""
    messages = run_distributed(_deferred_gain, 2, "hybrid dp=2 full", init_process_group=False)
    assert messages[0] == messages[1]
    assert "gain (_Gain): weight" in messages[0], messages[0]


def test_an_uninitialised_block_parameter_is_refused_at_the_blocks_first_call_under_tensor_parallelism():
    """Tensor parallelism materialises a deferred block at its first call (set-up holds no block whole):
    a tensor nothing initialised is refused there, with the same message on both tensor-parallel ranks."""
    messages = run_distributed(_deferred_gain, 2, "tensor_parallel tp=2", True, init_process_group=False)
    assert messages[0] == messages[1]
    assert "transformer.h.1.gain (_Gain): weight" in messages[0], messages[0]


def test_deferred_llama_refused_under_pipeline_never_a_hang():
    """Under pipeline (which exited a failing rank at once, and hung in the first step on a meta model
    before deferred initialisation existed) the rank prints the refusal and the job ends."""
    with pytest.raises(RankFailed, match=r"(?s)ConfigurationError: deferred initialisation.*rope_cos, rope_sin"):
        run_distributed(_deferred_llama, 2, "pipeline pp=2", init_process_group=False, timeout=60)


def _setup_peak(rank: int, world: int, layout: str, mode: str, ckpt: str) -> tuple[int, int, int, int, int, int]:
    """``mode``: ``"fit"``; ``"resume"`` (fit from a checkpoint of one step: restored after set-up); ``"sanity"``
    (Lightning's sanity check, validation before the first step). Returns the set-up peak, this rank's share,
    one block, the model, the most block bytes held beyond the share at a block's first call (or while one
    was lent to evaluation), and the block bytes held when training starts (after any restore)."""
    from torch.distributed.tensor import DTensor

    from lightning_parallel.memory import LiveTensorTracker
    from tests.helpers.models import DeferredGPT

    base = {"pp=2": PipelineParallelStrategy, "helix": HelixParallelStrategy}.get(layout, HybridParallelStrategy)

    def nbytes(p):
        t = p.to_local() if isinstance(p, DTensor) else p
        return t.numel() * t.element_size()

    class Tracked(base):
        first_call_peak = 0
        at_train_start = -1

        def setup(self, trainer):
            with LiveTensorTracker() as tracker:
                super().setup(trainer)
            self.setup_peak = tracker.peak

        def held(self):
            return sum(nbytes(p) for p in self.lightning_module.transformer.h.parameters() if not p.is_meta)

        def _materialize_at_first_call(self, block):
            super()._materialize_at_first_call(block)  # this block whole, the ones called before it sharded
            self.first_call_peak = max(self.first_call_peak, self.held())

        def on_train_start(self):
            self.at_train_start = self.held()  # after Lightning's restore
            super().on_train_start()

    torch.manual_seed(0)
    tokens = torch.randint(0, 65, (4, 17))  # 4 samples: helix's 4 micro-batches
    data = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
    loader = torch.utils.data.DataLoader(data, batch_size=4)

    def run(steps, ckpt=None, val=None):
        module = DeferredGPT(vocab_size=65, block_size=16, n_layer=8, n_head=8, n_embd=512, optimizer="adamw")
        if val is not None:
            module.validation_step = lambda batch, batch_idx: module.training_step(batch, batch_idx)
        if layout == "pp=2":
            strategy = Tracked(pipeline_parallel_size=2, num_microbatches=2)
        elif layout == "tp=2":
            strategy = Tracked(data_parallel_size=1, tensor_parallel_size=2)
        elif layout == "helix":
            strategy = Tracked(pipeline_parallel_size=2, num_microbatches=4)
        else:
            strategy = Tracked(data_parallel_size=2, data_parallel_sharding="full")
        trainer = L.Trainer(
            accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=1 if val is not None else 0, limit_val_batches=1,
        )  # fmt: skip
        trainer.fit(module, train_dataloaders=loader, val_dataloaders=val, ckpt_path=ckpt)
        return module, strategy, trainer

    if mode == "resume":
        run(1)[2].save_checkpoint(ckpt)
    resume = ckpt if mode == "resume" else None
    module, strategy, _ = run(2 if mode == "resume" else 1, resume, loader if mode == "sanity" else None)
    block = sum(p.numel() * p.element_size() for p in module.transformer.h[0].parameters())  # whole (global)
    share = sum(nbytes(p) for p in module.parameters() if not p.is_meta)
    total = sum(p.numel() * p.element_size() for p in module.parameters())
    blocks_share = sum(nbytes(p) for p in module.transformer.h.parameters() if not p.is_meta)
    return (strategy.setup_peak, share, block, total, strategy.first_call_peak - blocks_share, strategy.at_train_start)


@pytest.mark.parametrize(
    "layout,mode",
    [("pp=2", "fit"), ("dp=2 full", "fit"), pytest.param("tp=2", "fit", marks=pytest.mark.slow),
     pytest.param("helix", "fit", marks=pytest.mark.slow), ("tp=2", "resume"),
     pytest.param("helix", "resume", marks=pytest.mark.slow),  # (time) helix's share: the sanity case below
     ("helix", "sanity")],  # a resumed run's first calls are fit's
)  # fmt: skip
def test_setup_holds_its_share_plus_one_block(layout, mode, tmp_path):
    """Set-up of a deferred model allocates at most this rank's share plus one block (the whole model
    would be twice the share), counted by the live-tensor tracker around the strategy's set-up: a pipeline
    stage materialises its blocks only; full sharding materialises one unit at a time and shards it (its
    shard is made while the unit is whole: half a block more). Tensor parallelism and helix materialise no
    block at set-up, and each block at its first call (helix: when its first step splits it), when the
    blocks before it are sharded or split already: the blocks held then are their share plus at most one
    block (8 blocks whole at once would be 4 blocks more than the share). A resume (``ckpt_path=``) leaves
    them on meta (each reads its keys from the checkpoint at its first call); helix's evaluation before
    its first step (the sanity check) lends each block for its call and takes it back."""
    extra = 1.0 if layout == "pp=2" else 1.5
    late = layout in ("tp=2", "helix")
    for peak, share, block, total, first_call, at_start in run_distributed(
        _setup_peak, 2, layout, mode, str(tmp_path / "step1.ckpt"), init_process_group=False, timeout=120
    ):
        assert 0.45 * total < share < 0.55 * total  # the rank holds about half of the model
        low = 0.0 if late else 0.9 * share  # these set-ups hold the shards outside the blocks alone
        assert low <= peak <= share + extra * block, (peak / 2**20, share / 2**20, block / 2**20)
        if late:  # tp: this block whole and 7 halves = the share + half a block; helix: its parts of the others
            assert 0 < first_call <= (0.5 if layout == "tp=2" else 1.0) * block + 1, (first_call / 2**20, block)
            assert at_start == 0  # no block materialised by the restore or the sanity check


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_deferred_hugging_face_model_is_initialised_by_its_own_init_weights(family):
    """Inside a Hugging Face model every module is initialised by that model's ``_init_weights`` (what
    ``from_config`` runs): its normal(0, initializer_range) weights, and the rotary tables, which no
    ``reset_parameters()`` computes. The values then match the eager model's rules, not torch's defaults."""
    from lightning_parallel.materialize import check_set, materialize_
    from tests.helpers.models import DeferredHFCausalLM

    eager = DeferredHFCausalLM(family)
    eager.model = eager._make()
    deferred = DeferredHFCausalLM(family)
    with torch.device("meta"):
        deferred.model = deferred._make()
    record = materialize_(deferred, torch.device("cpu"), seed=0)
    assert check_set(record) is None
    for (name, got), (_, want) in zip(deferred.named_buffers(), eager.named_buffers()):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")  # rotary
    # HF's scheme, not torch's defaults (kaiming: ~0.1 here): every weight's spread as in the eager model, a
    # parent's rescaling of its children included (GPT-2's attention and MLP: c_proj at 0.02 / sqrt(2 x 8))
    eager_weights = dict(eager.named_parameters())
    for name, p in deferred.named_parameters():
        if p.dim() == 2:
            want = float(eager_weights[name].detach().std())
            assert abs(float(p.detach().std()) - want) < 0.25 * want, (name, float(p.detach().std()), want)


_HF_LAYOUTS = {
    "pp2": (lambda: PipelineParallelStrategy(pipeline_parallel_size=2, num_microbatches=4), 1),
    "dp2full": (lambda: HybridParallelStrategy(data_parallel_size=2, data_parallel_sharding="full"), 2),
    "tp2": (lambda: HybridParallelStrategy(data_parallel_size=1, tensor_parallel_size=2), 1),
}


@pytest.mark.parametrize(  # GPT-2 under dp2full and tp2: slow tier (time); pp2 materialises its blocks fast
    "family,layout",
    [pytest.param(f, k, marks=pytest.mark.slow) if f == "gpt2" and k != "pp2" else (f, k)
     for f in ("llama", "gpt2") for k in _HF_LAYOUTS],
)  # fmt: skip
def test_a_deferred_hugging_face_model_trains_with_parity(family, layout):
    """Each layout materialises its own part (full sharding: one unit at a time) by the same rule."""
    make, dp = _HF_LAYOUTS[layout]
    assert_parity(f"hf-{family}-deferred", make, 2, data_parallel_size=dp)


def _first_calls(rank: int, world: int, optimizer: str) -> tuple[list[bool], list[bool], float]:
    from tests.helpers.parity import build

    module, data = build("gpt-deferred", 4, "sgd")
    if optimizer == "adagrad":  # creates its state ("sum") in its constructor, from the parameters
        module.configure_optimizers = lambda: torch.optim.Adagrad(module.parameters(), lr=0.01)
    if optimizer == "adagrad-subset":  # over some parameters only: it builds state for those alone
        subset = lambda: [p for n, p in module.named_parameters() if ".mlp." not in n]  # noqa: E731
        module.configure_optimizers = lambda: torch.optim.Adagrad(subset(), lr=0.01)

    class InInferenceMode(HybridParallelStrategy):
        def _materialize_at_first_call(self, block):
            with torch.inference_mode():  # where Lightning evaluates under NCCL (under gloo: no_grad)
                super()._materialize_at_first_call(block)

    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=InInferenceMode(data_parallel_size=1, tensor_parallel_size=2),
        max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, datamodule=data)
    opt = trainer.optimizers[0]
    states = [t.is_meta for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    complete = all(p in opt.state for p in module.parameters() if id(p) in held)
    steps = trainer.global_step, trainer.current_epoch
    loss = trainer.callback_metrics["train_loss"].item()
    return [p.is_inference() for p in module.parameters()], states, complete, steps, loss


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adagrad-subset"])
def test_a_pending_block_materialised_in_inference_mode_or_with_state_built_at_construction_trains(optimizer):
    """A first call inside ``torch.inference_mode()`` (evaluation before the first step, on NCCL) makes
    normal parameters; an optimizer that builds its state in its constructor (Adagrad) builds it for each
    parameter it holds when its block materialises (none on meta, none missing), also when it holds some of
    a block's parameters only, and the two steps run in one epoch."""
    for inference, meta_state, complete, steps, loss in run_distributed(
        _first_calls, 2, optimizer, init_process_group=False
    ):
        assert not any(inference) and meta_state and not any(meta_state) and math.isfinite(loss)
        # max_steps=2: the data's one epoch of 2 batches; a first call raising StopIteration (which Lightning's
        # loop takes for the end of the data) would end an epoch at each of the 8 blocks
        assert steps == (2, 1), steps
        assert complete or optimizer == "sgd"


def _validate_a_checkpoint(rank: int, world: int, ckpt: str) -> tuple[float, float, int]:
    from tests.helpers.parity import build

    def trainer(steps):
        return L.Trainer(
            accelerator="cpu", devices=2, strategy=HelixParallelStrategy(pipeline_parallel_size=2), max_steps=steps,
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0, limit_val_batches=2,
        )  # fmt: skip

    module, data = build("gpt-deferred", 4, "adamw")
    first = trainer(2)
    first.fit(module, datamodule=data)
    first.save_checkpoint(ckpt)
    after_fit = first.validate(module, datamodule=data, verbose=False)[0]["val_loss"]  # split blocks
    module, data = build("gpt-deferred", 4, "adamw", seed=1)  # other initial values: the checkpoint's count
    validation_step = module.validation_step

    def uneven(batch, batch_idx):  # rank 0 alone runs the model once more: a lend after the first has no collective
        if batch_idx == 1 and rank == 0:
            module(batch[0])
        return validation_step(batch, batch_idx)

    module.validation_step = uneven
    second = trainer(2)
    restored = second.validate(module, datamodule=data, ckpt_path=ckpt, verbose=False)[0]["val_loss"]
    pending = len(second.strategy._deferred.blocks)  # validation lent each block: none stays materialised
    return after_fit, restored, pending


def test_helix_validates_a_checkpoint_before_any_step_with_its_values_lending_each_block(tmp_path):
    """``trainer.validate(ckpt_path=)`` on a deferred helix model: no step has split the blocks, so every stage
    runs every block, each lent for its call with the checkpoint's values (read from the directory then) and
    taken back; the loss is the one the trained model validates with. Only a block's first lend broadcasts
    (the ranks' own values agreed), so a forward on one rank alone later does not hang."""
    for after_fit, restored, pending in run_distributed(
        _validate_a_checkpoint, 2, str(tmp_path / "helix.ckpt"), init_process_group=False, timeout=120
    ):
        assert pending == 8
        assert math.isclose(restored, after_fit, rel_tol=1e-5), (restored, after_fit)


def _host_sanity(rank: int, world: int, sanity: int) -> tuple[dict, int]:
    from tests.helpers.parity import build

    module, data = build("gpt", 4, "adamw")
    strategy = _ON_HOST["helix p=2"]()
    seen = []

    class Count(L.Callback):
        def on_sanity_check_end(self, trainer, pl_module):
            seen.append(len(strategy._deferred.blocks))  # every block lent to the sanity check, none kept

    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=sanity, limit_val_batches=1,
        callbacks=[Count()],
    )  # fmt: skip
    trainer.fit(module, datamodule=data)
    return strategy.gather_named_parameters(), seen


def test_helix_lends_eager_blocks_kept_on_the_host_to_its_sanity_check():
    """Helix's sanity check before its first step lends each eager block kept on the host (to the device and
    back to its own host memory); the step after it trains exactly as without the sanity check."""
    alone = run_distributed(_host_sanity, 2, 0, init_process_group=False)[0][0]
    after, seen = run_distributed(_host_sanity, 2, 1, init_process_group=False)[0]
    assert seen == [8]
    for k in alone:
        torch.testing.assert_close(after[k], alone[k], rtol=0, atol=0, msg=lambda m, k=k: f"{k}: {m}")
