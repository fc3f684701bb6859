"""Expert parallelism (``expert_parallel_size=``) under real Lightning Trainers: parity with one process for
transformers' mixtures, the experts each rank holds, and the refusals (lightning_parallel/expert_parallel.py,
strategies/_experts.py). float64: the experts run by transformers' ``batched_mm`` (``grouped_mm`` takes no float64 on
CPU), as in one process."""

from __future__ import annotations

import re

import lightning as L
import pytest
import torch
from torch.distributed.tensor import DTensor

from lightning_parallel import HelixParallelStrategy, HybridParallelStrategy, PipelineParallelStrategy
from tests.helpers.parity import assert_parity

pytest.importorskip("transformers")


def _ep2(dp: int = 2) -> object:
    return lambda: HybridParallelStrategy(data_parallel_size=dp, expert_parallel_size=2)


class _HoldsItsExperts(L.Callback):
    """Each rank holds num_experts / ep of every experts module it runs, as DTensors sharded by expert (and under
    FSDP2, over the ranks holding the same experts); of a home-written mixture, num_experts / ep experts (the others
    on meta). Checked after the first step."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx:
            return
        sharded = [p for n, p in pl_module.named_parameters() if ".experts." in n and isinstance(p, DTensor)]
        listed: dict[str, dict[str, bool]] = {}  # mixture -> expert -> on meta (another rank's)
        for n, p in pl_module.named_parameters():
            if found := re.search(r"^(.*)\.experts\.(\d+)\.", n):
                listed.setdefault(found[1], {})[found[2]] = p.is_meta
        listed = {m: experts for m, experts in listed.items() if not all(experts.values())}  # (another stage's)
        assert sharded or listed, "no expert was sharded"
        for p in sharded:  # (by expert over ep; under FSDP2 with several replicas, over them too)
            cut = 2 * (p.device_mesh.size(0) if p.device_mesh.ndim == 2 else 1)
            assert p.to_local().shape[0] * cut == p.shape[0], (tuple(p.to_local().shape), tuple(p.shape))
        for experts in listed.values():
            assert sum(experts.values()) * 2 == len(experts), experts


@pytest.mark.parametrize(
    ("row", "dtype"),
    [("hf:mixtral@batched_mm", "float64"), ("hf:qwen3_moe@batched_mm", "float64"),
     pytest.param("hf:gpt_oss@eager", "float64", marks=pytest.mark.slow),
     # dense experts: every token to each expert, scaled by its score
     pytest.param("hf:llama4", "float64", marks=pytest.mark.slow),
     # DeepSeek-V3's router computes its logits in float32 whatever the model's dtype (F.linear on .float()
     # copies), so no layout that splits its batch matches one process at float64's 1e-9, plain dp included:
     # the contract's float32 tier (SGD, 1e-5), with transformers' default grouped_mm experts
     ("hf:deepseek_v3", "float32")],
)  # fmt: skip
def test_ep2_trains_as_one_process(row, dtype):
    assert_parity(row, _ep2(), 2, data_parallel_size=2, dtype=dtype, callbacks=lambda: [_HoldsItsExperts()])


@pytest.mark.slow
def test_deepseek_v3_in_float64_at_ep2_is_plain_data_parallelism_exactly():
    """DeepSeek-V3's router sums its weight's gradient over the tokens in float32 (``F.linear`` on ``.float()``
    copies), so no layout that splits the batch matches one process at float64's 1e-9 (plain dp=2 misses by 2e-8
    on the router's weight after one AdamW step, then everywhere): its one-process parity is the float32 tier
    above. In float64, ep=2 reproduces plain dp=2 (the same split of the batch) at 1e-9: losses and every
    parameter after each of 3 AdamW steps."""
    from tests.helpers.parity import _compare, _run_parallel

    args = ("hf:deepseek_v3@batched_mm", "float64", "adamw", 3, 4)
    dp = _run_parallel(lambda: HybridParallelStrategy(data_parallel_size=2), 2, args, {}, None, True)
    _compare(_run_parallel(_ep2(), 2, args, {}, None, True), dp[0], "float64", args[0], 3)


def test_a_home_written_mixture_trains_as_one_process():
    """An ``nn.ModuleList`` of experts beside a top-2 softmax router, its own loop skipping the experts no token
    chose (tests/helpers/zoo.py, ``MoE``): each rank keeps two of the four experts; parity in float64 (AdamW)."""
    assert_parity("home:moe", _ep2(), 2, data_parallel_size=2, callbacks=lambda: [_HoldsItsExperts()])


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["pp2dp2", "dp4"])
def test_a_home_written_mixture_composes(layout):
    """The home-written mixture under pp=2 x dp=2 (AdamW) and over two replicas of an ep group, with clipping
    (SGD: a wrong norm would show)."""
    if layout == "dp4":
        assert_parity("home:moe", _ep2(4), 4, data_parallel_size=4, optimizer="sgd", gradient_clip_val=0.05)
        return
    strategy = lambda: PipelineParallelStrategy(  # noqa: E731
        pipeline_parallel_size=2, data_parallel_size=2, expert_parallel_size=2
    )
    assert_parity("home:moe", strategy, 4, data_parallel_size=2, callbacks=lambda: [_HoldsItsExperts()])


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2dp2", "helix2dp2"])
def test_a_home_written_mixture_under_tensor_parallelism_or_helix(layout):
    """While its block is traced (tensor parallelism's plan, HelixPipe's cut) the mixture is one op, run by the
    mixture at its place in the traced program; under helix with its MLP whole (mlp_chunks=1: a chunked MLP
    needs the MLP's projections in the graph, which the op hides)."""
    if layout == "tp2dp2":
        make = lambda: HybridParallelStrategy(  # noqa: E731
            tensor_parallel_size=2, data_parallel_size=2, expert_parallel_size=2
        )
    else:
        make = lambda: HelixParallelStrategy(  # noqa: E731
            pipeline_parallel_size=2, data_parallel_size=2, expert_parallel_size=2, mlp_chunks=1
        )
    assert_parity("home:moe", make, 4, data_parallel_size=2, callbacks=lambda: [_HoldsItsExperts()])


def _fit_and_gather(rank, world_size, model, make):
    from tests.helpers.parity import build
    from tests.helpers.trainers import quick_fit

    module, data = build(model, 4, "adamw")
    trainer = quick_fit(module, data, make(), world_size)
    if model == "home:moe":
        with pytest.raises(RuntimeError, match=r"holds only its expert-parallel rank's experts"):
            module.state_dict()
    whole, gathered = trainer.strategy.full_state_dict(), trainer.strategy.gather_named_parameters()
    assert not any(isinstance(v, DTensor) for v in [*whole.values(), *gathered.values()])
    return {k: v.cpu() for k, v in whole.items()}, {k: v.cpu() for k, v in gathered.items()}


@pytest.mark.parametrize(
    ("model", "world", "make"),
    [("home:moe", 2, _ep2()),
     pytest.param(MOE_ROW := "hf:qwen3_moe@batched_mm", 4, lambda: HybridParallelStrategy(
         tensor_parallel_size=2, data_parallel_size=2, expert_parallel_size=2), marks=pytest.mark.slow)],
)  # fmt: skip
def test_after_a_fit_the_whole_model_comes_through_the_strategy(model, world, make):
    """After the fit, full_state_dict() gives rank 0 every parameter whole (experts gathered over ep, tp shards
    gathered), equal to what gather_named_parameters() gives every rank. A home-written mixture keeps half its
    experts per rank: the module's own state_dict() refuses (it would be partial)."""
    from tests.helpers.distributed import run_distributed
    from tests.helpers.parity import build

    results = run_distributed(_fit_and_gather, world, model, make, init_process_group=False)
    names = dict(build(model, 4, "adamw")[0].named_parameters()).keys()
    whole, gathered = results[0]
    assert gathered.keys() == names and all(r[0] == {} for r in results[1:])
    for name in names:
        torch.testing.assert_close(whole[name], gathered[name], rtol=0, atol=0)
        for _, again in results[1:]:
            torch.testing.assert_close(again[name], gathered[name], rtol=0, atol=0)


def _fit_twice(rank, world_size, make):
    from tests.helpers.parity import build
    from tests.helpers.trainers import quick_fit

    module, data = build("home:moe", 4, "adamw")
    trainer = quick_fit(module, data, make(), world_size, steps=2)
    before = trainer.strategy.gather_named_parameters()
    trainer.fit(module, datamodule=data)  # set up again (max_steps reached: no step)
    return before, trainer.strategy.gather_named_parameters()


@pytest.mark.parametrize("layout", ["dp2", pytest.param("sp2", marks=pytest.mark.slow)])
def test_a_second_set_up_keeps_each_ranks_own_experts(layout):
    """A home-written mixture's experts are plain tensors, other ones on each rank of an ep group: the set-up's
    broadcast of rank 0's values along dp and sp (a second fit or a validate with the same trainer) leaves them."""
    from tests.helpers.distributed import run_distributed

    make = _ep2() if layout == "dp2" else _sp()
    for before, after in run_distributed(_fit_twice, 2, make, init_process_group=False):
        assert before.keys() == after.keys()
        for name in before:
            torch.testing.assert_close(after[name], before[name], rtol=0, atol=0, msg=name)


@pytest.mark.slow
def test_ep2_over_four_replicas_with_clipping_trains_as_one_process():
    """dp=4 = 2 replicas of an ep group of 2: an expert's gradient is its group's, averaged over the replicas;
    clipping counts every expert once."""
    assert_parity("hf:mixtral@batched_mm", _ep2(4), 4, data_parallel_size=4, optimizer="sgd", gradient_clip_val=0.05)


def test_ep_must_divide_the_data_and_sequence_parallel_ranks():
    with pytest.raises(ValueError, match=r"expert_parallel_size=2 must divide data_parallel_size=3 x sequence_"
                       r"parallel_size=1 = 3"):  # fmt: skip
        L.Trainer(accelerator="cpu", devices=3, strategy=HybridParallelStrategy(expert_parallel_size=2))
    strategy = HybridParallelStrategy(data_parallel_size=1, sequence_parallel_size=2, expert_parallel_size=4)
    with pytest.raises(ValueError, match=r"data_parallel_size=1 x sequence_parallel_size=2 = 2: .* multiple of 4"):
        L.Trainer(accelerator="cpu", devices=2, strategy=strategy)


# ------------------------------------------------------------------------------ over sequence-parallel ranks
def _sp(sp: int = 2, dp: int = 1, ep: int = 2, make: object = HybridParallelStrategy, **kw: object) -> object:
    return lambda: make(sequence_parallel_size=sp, data_parallel_size=dp, expert_parallel_size=ep, **kw)


@pytest.mark.parametrize(
    ("model", "mode"),
    [("hf:mixtral@batched_mm", "ring"), pytest.param("hf:mixtral@batched_mm", "ulysses", marks=pytest.mark.slow),
     pytest.param("hf:qwen3_moe@batched_mm", "ring", marks=pytest.mark.slow),
     # the mixture one op of the traced block (its two-run forward runs there)
     pytest.param("home:moe", "ulysses", marks=pytest.mark.slow)],
)  # fmt: skip
def test_ep2_over_the_sequence_parallel_ranks_trains_as_one_process(model, mode):
    """sp=2 (ring attention or Ulysses), ep=2 over the two sequence shards of one replica: each shard's tokens are
    routed where they are, to either rank's experts; an expert's gradient sums both shards' tokens (not summed
    over sp again: the sp ranks hold other experts)."""
    make = _sp(sequence_parallel_mode=mode)
    assert_parity(model, make, 2, data_parallel_size=1, callbacks=lambda: [_HoldsItsExperts()])


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dp2sp2ep2", "dp2sp2ep4", "pp2sp2ep2", "helix2sp2ep2"])
def test_ep_over_sequence_and_data_parallel_ranks_trains_as_one_process(layout):
    """ep inside each replica's sp ranks (dp=2 x sp=2, ep=2), ep across replicas and sequence shards (ep=4, with
    clipping: SGD, a wrong norm would show), and with the pipeline and HelixPipe (each stage's sp ranks)."""
    model, holds = "hf:mixtral@batched_mm", lambda: [_HoldsItsExperts()]
    if layout == "dp2sp2ep2":
        assert_parity(model, _sp(dp=2), 4, data_parallel_size=2, callbacks=holds)
    elif layout == "dp2sp2ep4":
        make = _sp(dp=2, ep=4)
        assert_parity(model, make, 4, data_parallel_size=2, optimizer="sgd", gradient_clip_val=0.05)
    else:
        make = _sp(make=PipelineParallelStrategy if layout == "pp2sp2ep2" else HelixParallelStrategy,
                   pipeline_parallel_size=2)  # fmt: skip
        assert_parity(model, make, 4, data_parallel_size=1, callbacks=holds)


# ------------------------------------------------------------------------------ composed with the other axes
# (4 ranks each: the slow tier)
@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv"])
def test_ep2_under_a_pipeline_trains_as_one_process(schedule):
    """pp=2 x dp=2, ep=2 over each stage's two dp ranks (four layers: the interleaved and V schedules' virtual
    stages): every dp rank of a stage runs the same schedule, so their all-to-alls pair up in every action,
    the zero-bubble schedules' split backward included."""
    strategy = lambda: PipelineParallelStrategy(  # noqa: E731
        pipeline_parallel_size=2, data_parallel_size=2, expert_parallel_size=2, schedule=schedule
    )
    assert_parity("hf:mixtral@batched_mm#4", strategy, 4, data_parallel_size=2, callbacks=lambda: [_HoldsItsExperts()])


@pytest.mark.slow
def test_ep2_under_a_pipeline_with_clipping_trains_as_one_process():
    """Clipping under pp=2 x ep=2 (SGD, so that a wrong norm shows): each stage's experts count once, their
    squares summed over the ep group and over the stages."""
    strategy = lambda: PipelineParallelStrategy(  # noqa: E731
        pipeline_parallel_size=2, data_parallel_size=2, expert_parallel_size=2
    )
    assert_parity("hf:mixtral@batched_mm#4", strategy, 4, data_parallel_size=2, optimizer="sgd", gradient_clip_val=0.05)


@pytest.mark.slow
@pytest.mark.parametrize("row", ["hf:mixtral@batched_mm", "hf:qwen3_moe@batched_mm", "hf:gpt_oss@eager"])
def test_ep2_under_helix_trains_as_one_process(row):
    """HelixPipe p=2 x dp=2, ep=2: its attention-parallel schedule with the experts of the post-attention parts
    sharded over each stage's dp ranks (the MLP chunked over the sequence: an all-to-all pair per chunk).
    Mixtral's block is cut by the hand-written llama adapter, Qwen3-MoE's and GPT-OSS's by tracing it."""
    strategy = lambda: HelixParallelStrategy(  # noqa: E731
        pipeline_parallel_size=2, data_parallel_size=2, expert_parallel_size=2
    )
    assert_parity(row, strategy, 4, data_parallel_size=2, callbacks=lambda: [_HoldsItsExperts()])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("row", "dtype"),
    [("hf:mixtral@batched_mm", "float64"), ("hf:qwen3_moe@batched_mm", "float64"), ("hf:deepseek_v3", "float32")],
)
def test_ep2_with_tensor_parallel_attention_trains_as_one_process(row, dtype):
    """tp=2 x dp=2, ep=2: attention (and DeepSeek-V3's latent attention, its shared expert) sharded by tp, the
    routed experts by ep over the dp ranks of each tp rank, whole over tp (the anatomy's experts plan is left
    out)."""
    strategy = lambda: HybridParallelStrategy(  # noqa: E731
        tensor_parallel_size=2, data_parallel_size=2, expert_parallel_size=2
    )
    assert_parity(row, strategy, 4, data_parallel_size=2, dtype=dtype, callbacks=lambda: [_HoldsItsExperts()])


@pytest.mark.slow
def test_experts_of_a_model_built_in_configure_model_are_sharded_as_their_blocks_materialise():
    """Mixtral built in ``configure_model`` (on meta) under tp=2 x dp=2, ep=2: each block waits for its first
    call to materialise (tensor parallelism shards it then), and its experts are sharded by ep as it does, before
    tensor parallelism's plan sees them; training matches one process."""
    strategy = lambda: HybridParallelStrategy(  # noqa: E731
        tensor_parallel_size=2, data_parallel_size=2, expert_parallel_size=2
    )
    assert_parity("hf-mixtral-deferred", strategy, 4, data_parallel_size=2, callbacks=lambda: [_HoldsItsExperts()])


@pytest.mark.slow
@pytest.mark.parametrize("row", ["hf:mixtral@batched_mm", "hf:qwen3_moe@batched_mm"])
def test_ep2_under_helix_with_tensor_parallelism_trains_as_one_process(row):
    """HelixPipe p=2 x tp=2 x dp=2, ep=2 on 8 ranks: the block cut by tracing it, the expert-parallel call one op
    of the trace (its all-to-all sizes are the data's), run by the module at its place in the split's parts."""
    strategy = lambda: HelixParallelStrategy(  # noqa: E731
        pipeline_parallel_size=2, tensor_parallel_size=2, data_parallel_size=2, expert_parallel_size=2
    )
    assert_parity(row, strategy, 8, data_parallel_size=2, callbacks=lambda: [_HoldsItsExperts()])


def test_a_model_without_experts_is_refused_on_every_rank():
    with pytest.raises(Exception, match=r"expert_parallel_size=2 found no experts in GPT"):
        assert_parity("gpt", _ep2(), 2, data_parallel_size=2, steps=1)


def test_a_bad_size_is_refused_when_the_strategy_is_built():
    with pytest.raises(ValueError, match=r"expert_parallel_size must be a positive int, got 0"):
        HybridParallelStrategy(expert_parallel_size=0)


# ------------------------------------------------------------------------------ with ZeRO over the rest
class _ZeroChunksTheRest(L.Callback):
    """After the first step: AdamW's state of every parameter is this rank's 1-D chunk: of dp chunks, an expert's
    of as many as the ranks holding it (its replicas; one with ep = dp)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx:
            return
        state, plan = trainer.optimizers[0].state, trainer.strategy._gradient_plan
        local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
        experts = plan.expert_ids()
        seen = {True: 0, False: 0}
        for p in pl_module.parameters():
            if p not in state or p.dim() == 0:
                continue
            moment, n = local(state[p]["exp_avg"]), local(p).numel()
            if id(p) in experts:
                rank, size = plan.experts.replica, plan.experts.replica_count
            else:
                rank, size = trainer.strategy.coordinate["dp"], trainer.strategy.parallel_dims.dp
            chunk = -(-n // size)  # this rank's of ``size`` chunks of ceil(n / size) elements (the last shorter)
            assert moment.dim() == 1 and moment.numel() == min(chunk, max(0, n - rank * chunk)), moment.shape
            seen[id(p) in experts] += 1
        assert seen[True] and seen[False], seen


@pytest.mark.parametrize(
    "layout",
    ["dp2", pytest.param("dp4", marks=pytest.mark.slow), pytest.param("pp2dp2", marks=pytest.mark.slow),
     pytest.param("tp2dp2", marks=pytest.mark.slow), pytest.param("home", marks=pytest.mark.slow)],
)  # fmt: skip
def test_ep2_with_zero_trains_as_one_process(layout):
    """data_parallel_sharding='optimizer' with ep=2: ZeRO cuts every parameter but the experts over dp (its
    reduce-scatter and all-gather), each rank's experts over the ranks holding the same ones (their gradient reduced
    whole over them first, then cut; dp=4: two replicas); dp=4 with clipping (SGD: the experts' chunks in the norm),
    pipeline and tensor parallelism, the home-written mixture."""
    zero = dict(data_parallel_sharding="optimizer", expert_parallel_size=2)
    checks = lambda: [_HoldsItsExperts(), _ZeroChunksTheRest()]  # noqa: E731
    if layout == "dp4":
        make = lambda: HybridParallelStrategy(data_parallel_size=4, **zero)  # noqa: E731
        assert_parity(MOE_ROW, make, 4, data_parallel_size=4, optimizer="sgd", gradient_clip_val=0.05)
        assert_parity(MOE_ROW, make, 4, data_parallel_size=4, callbacks=checks)  # (AdamW: its state checked)
    elif layout == "pp2dp2":
        make = lambda: PipelineParallelStrategy(pipeline_parallel_size=2, data_parallel_size=2, **zero)  # noqa: E731
        assert_parity(MOE_ROW, make, 4, data_parallel_size=2, callbacks=checks)
    elif layout == "tp2dp2":
        make = lambda: HybridParallelStrategy(tensor_parallel_size=2, data_parallel_size=2, **zero)  # noqa: E731
        assert_parity(MOE_ROW, make, 4, data_parallel_size=2, callbacks=checks)
    else:
        model = "home:moe" if layout == "home" else MOE_ROW
        make = lambda: HybridParallelStrategy(data_parallel_size=2, **zero)  # noqa: E731
        assert_parity(model, make, 2, data_parallel_size=2, callbacks=checks)


# ------------------------------------------------------------------------------ with FSDP2 over the rest
class _FullyShardsTheRest(L.Callback):
    """After the first step: every expert parameter sharded by FSDP2 over the ranks holding the same experts, with
    several of them (a DTensor on their mesh and the ep mesh), left out by FSDP2 otherwise (on the ep mesh alone; a
    home-written mixture's: plain tensors); every other parameter of the blocks one of FSDP2's over dp."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        from lightning_parallel.expert_parallel import EP_AXIS, REPLICA_AXIS

        if batch_idx:
            return
        plan = trainer.strategy._gradient_plan
        experts = plan.expert_ids()
        routed = (REPLICA_AXIS, EP_AXIS) if plan.experts.replica_count > 1 else (EP_AXIS,)
        seen = {True: 0, False: 0}
        for name, p in pl_module.named_parameters():
            if p.is_meta:
                continue
            names = p.device_mesh.mesh_dim_names if isinstance(p, DTensor) else ()
            if id(p) in experts:
                assert names in (routed, ()), (name, names)
            elif ".layers." in name or ".stack." in name:
                assert "dp" in names, (name, names)
            seen[id(p) in experts] += 1
        assert seen[True] and seen[False], seen


@pytest.mark.parametrize(
    "layout",
    ["dp2", pytest.param("dp4", marks=pytest.mark.slow), pytest.param("pp2dp2", marks=pytest.mark.slow),
     pytest.param("tp2dp2", marks=pytest.mark.slow), pytest.param("sp2dp2", marks=pytest.mark.slow),
     pytest.param("home", marks=pytest.mark.slow), pytest.param("deferred", marks=pytest.mark.slow)],
)  # fmt: skip
def test_ep2_with_fsdp2_over_the_other_parameters_trains_as_one_process(layout):
    """data_parallel_sharding='full' with ep=2: FSDP2 shards every parameter but the experts over dp
    (``ignored_params``), the experts stay 1/ep per rank; dp=4 with clipping (SGD), the pipeline, tensor and
    sequence parallelism (FSDP2 after the blocks' commits), the home-written mixture (the other ranks' experts on
    meta left out too) and a model built on meta in configure_model (each unit's experts sharded by ep as it
    materialises, before FSDP2 shards the rest)."""
    full = dict(data_parallel_sharding="full", expert_parallel_size=2)
    checks = lambda: [_HoldsItsExperts(), _FullyShardsTheRest()]  # noqa: E731
    if layout == "dp4":  # two replicas of each ep group: the experts FSDP2's over them
        make = lambda: HybridParallelStrategy(data_parallel_size=4, **full)  # noqa: E731
        assert_parity(MOE_ROW, make, 4, data_parallel_size=4, optimizer="sgd", gradient_clip_val=0.05)
        assert_parity(MOE_ROW, make, 4, data_parallel_size=4, callbacks=checks)
        return
    make = {
        "pp2dp2": lambda: PipelineParallelStrategy(
            pipeline_parallel_size=2, data_parallel_size=2, num_microbatches=2, **full
        ),
        "tp2dp2": lambda: HybridParallelStrategy(tensor_parallel_size=2, data_parallel_size=2, **full),
        "sp2dp2": lambda: HybridParallelStrategy(sequence_parallel_size=2, data_parallel_size=2, **full),
    }.get(layout, lambda: HybridParallelStrategy(data_parallel_size=2, **full))
    model = {"home": "home:moe", "deferred": "hf-mixtral-deferred"}.get(layout, MOE_ROW)
    world = 4 if layout in ("pp2dp2", "tp2dp2", "sp2dp2") else 2
    assert_parity(model, make, world, data_parallel_size=2, callbacks=checks)


# ------------------------------------------------------------------------------------------ checkpoints
MOE = "hf:qwen3_moe@batched_mm"


@pytest.mark.slow
@pytest.mark.parametrize("model", [MOE, "home:moe"])
def test_a_checkpoint_holds_each_expert_whole_and_loads_at_any_ep(tmp_path, model):
    """Saved at ep=2, the checkpoint equals one saved at plain dp=2 (each expert once, whole, in order, with its
    AdamW state); it loads into one process, and dp=2's loads at ep=2."""
    from lightning_parallel.checkpoint import load_sharded
    from tests.strategies.test_checkpoints import _assert_close, _run

    ep2, dp2 = str(tmp_path / "ep2.ckpt"), str(tmp_path / "dp2.ckpt")
    _run("dp2ep2", 2, ckpt_out=ep2, model=model)
    _run("dp2", 2, ckpt_out=dp2, model=model)
    saved, reference = load_sharded(ep2), load_sharded(dp2)
    experts = [k for k in reference["state_dict"] if re.search(r"experts\.(gate_up_proj|3\.up\.weight)$", k)]
    assert experts and all(saved["state_dict"][k].shape == reference["state_dict"][k].shape for k in experts)
    _assert_close(saved["state_dict"], reference["state_dict"], "ep=2 checkpoint vs dp=2")
    _assert_close(saved["optimizer_states"][0]["state"], reference["optimizer_states"][0]["state"], "AdamW state")
    for source, target in ((ep2, "one"), (dp2, "dp2ep2")):
        _, _, params, optimizer = _run(target, 3, ckpt_in=source, model=model)
        _assert_close(params, {k: v for k, v in reference["state_dict"].items() if k in params}, target)
        _assert_close(optimizer, reference["optimizer_states"][0]["state"], f"{target}: AdamW state")


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout", ["pp2dp2ep2", "tp2dp2ep2", "sp2ep2", "dp2zeroep2", "dp4zeroep2", "dp2fullep2", "dp4fullep2"]
)
def test_a_composed_ep_checkpoint_equals_plain_data_parallelism(tmp_path, layout):
    """Saved under pipeline, tensor or sequence parallelism, ZeRO or FSDP2 with ep=2 (dp=4: the experts' state, and
    under FSDP2 the experts, in chunks over their two replicas), the checkpoint equals dp=2's (each expert once,
    whole, with its AdamW state)."""
    from lightning_parallel.checkpoint import load_sharded
    from tests.strategies.test_checkpoints import _assert_close, _run

    got, want = str(tmp_path / "ep.ckpt"), str(tmp_path / "dp2.ckpt")
    _run(layout, 2, ckpt_out=got, model=MOE)
    _run("dp2", 2, ckpt_out=want, model=MOE)
    saved, reference = load_sharded(got), load_sharded(want)
    _assert_close(saved["state_dict"], reference["state_dict"], f"{layout} checkpoint vs dp=2")
    _assert_close(saved["optimizer_states"][0]["state"], reference["optimizer_states"][0]["state"], "AdamW state")


@pytest.mark.parametrize(
    ("layout", "model"),
    [("dp2ep2", MOE), pytest.param("dp2ep2", "home:moe", marks=pytest.mark.slow),
     pytest.param("pp2dp2ep2", MOE, marks=pytest.mark.slow), pytest.param("sp2ep2", MOE, marks=pytest.mark.slow),
     pytest.param("dp2zeroep2", MOE, marks=pytest.mark.slow), pytest.param("dp4zeroep2", MOE, marks=pytest.mark.slow),
     pytest.param("dp2fullep2", MOE, marks=pytest.mark.slow), pytest.param("dp4fullep2", MOE, marks=pytest.mark.slow),
     pytest.param("sp2dp2fullep2", MOE, marks=pytest.mark.slow),  # (FSDP2 after the commits: state cut then)
     pytest.param("dp4sp2fullep4", MOE, marks=pytest.mark.slow)],  # (two replicas of each expert, dp=4)
)  # fmt: skip
def test_resume_under_ep2_continues_the_straight_run_exactly(tmp_path, layout, model):
    from tests.strategies.test_checkpoints import _assert_close, _run

    kw = dict(model=model, epoch_end=True)
    straight, final, _, _ = _run(layout, 8, ckpt_out=str(tmp_path / "straight.ckpt"), **kw)
    ckpt = str(tmp_path / "epoch.ckpt")
    first, _, _, _ = _run(layout, 4, ckpt_out=ckpt, **kw)
    second, resumed, _, _ = _run(layout, 8, ckpt_in=ckpt, ckpt_out=str(tmp_path / "resumed.ckpt"), **kw)
    torch.testing.assert_close(torch.tensor(first + second), torch.tensor(straight), rtol=1e-9, atol=1e-12)
    _assert_close(resumed, final, "parameters after step 8")


# ------------------------------------------------------------------------------------------ grad_norm
def _norms(rank, world, ep, norm_type, sp=1):
    from tests.helpers.parity import PRECISION, _OneReplicaSampler, build
    from tests.strategies.test_grad_norm import Norms

    module, data = build(MOE, 8 // (world // sp), "sgd")
    norms = Norms(norm_type)
    layout = dict(data_parallel_size=world // sp, sequence_parallel_size=sp, expert_parallel_size=ep)
    strategy = HybridParallelStrategy(**layout) if ep else "auto"
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=2, precision=PRECISION["float64"],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[norms] + ([] if ep else [_OneReplicaSampler()]),
    )  # fmt: skip
    trainer.fit(module, datamodule=data)
    return norms.seen


@pytest.mark.parametrize(("norm_type", "sp"), [(2, 1), ("inf", 1), pytest.param(2, 2, marks=pytest.mark.slow)])
def test_grad_norm_counts_every_expert_once(norm_type, sp):
    """``strategy.grad_norm`` at ep=2 (over two replicas, or two sequence shards) is one device's ``grad_norm``:
    each expert module's norm combines its ranks' experts, the total counts each once."""
    from tests.helpers.distributed import run_distributed

    want = _norms(0, 1, 0, norm_type)
    for got in run_distributed(_norms, 2, 2, norm_type, sp, init_process_group=False):
        assert len(got) == len(want) == 2
        for g, w in zip(got, want):
            assert g.keys() == w.keys() and any("experts" in k for k in w)
            for k in w:
                assert g[k] == pytest.approx(w[k], rel=1e-9, abs=1e-12), k
