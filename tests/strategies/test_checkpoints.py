"""Checkpoints like Lightning's: exact resume, resume under another layout, plain export,
atomic saves, and clear errors for checkpoints that do not fit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_parallel import HelixParallelStrategy, HybridParallelStrategy, PipelineParallelStrategy, _collectives
from lightning_parallel.checkpoint import load_sharded
from lightning_parallel.errors import CheckpointError
from tests.helpers.distributed import RankFailed, run_distributed
from tests.helpers.parity import TOLERANCES, Recorder, _OneReplicaSampler, build

ROOT = Path(__file__).resolve().parents[2]
TOL = TOLERANCES["float64"]

#: name -> (strategy factory, devices, data-parallel size)
LAYOUTS = {
    "one": (lambda: HybridParallelStrategy(data_parallel_size=1), 1, 1),
    "dp2": (lambda: HybridParallelStrategy(data_parallel_size=2), 2, 2),
    "dp2zero": (lambda: HybridParallelStrategy(data_parallel_size=2, data_parallel_sharding="optimizer"), 2, 2),
    "dp2ep2": (lambda: HybridParallelStrategy(data_parallel_size=2, expert_parallel_size=2), 2, 2),
    "dp2zeroep2": (
        lambda: HybridParallelStrategy(
            data_parallel_size=2, expert_parallel_size=2, data_parallel_sharding="optimizer"
        ),
        2,
        2,
    ),
    "dp4zeroep2": (
        lambda: HybridParallelStrategy(
            data_parallel_size=4, expert_parallel_size=2, data_parallel_sharding="optimizer"
        ),
        4,
        4,
    ),
    "dp4fullep2": (
        lambda: HybridParallelStrategy(data_parallel_size=4, expert_parallel_size=2, data_parallel_sharding="full"),
        4,
        4,
    ),
    "sp2dp2fullep2": (
        lambda: HybridParallelStrategy(
            sequence_parallel_size=2, data_parallel_size=2, expert_parallel_size=2, data_parallel_sharding="full"
        ),
        4,
        2,
    ),
    "dp4sp2fullep4": (
        lambda: HybridParallelStrategy(
            sequence_parallel_size=2, data_parallel_size=4, expert_parallel_size=4, data_parallel_sharding="full"
        ),
        8,
        4,
    ),
    "dp2fullep2": (
        lambda: HybridParallelStrategy(data_parallel_size=2, expert_parallel_size=2, data_parallel_sharding="full"),
        2,
        2,
    ),
    "sp2ep2": (
        lambda: HybridParallelStrategy(sequence_parallel_size=2, data_parallel_size=1, expert_parallel_size=2),
        2,
        1,
    ),
    "pp2dp2ep2": (
        lambda: PipelineParallelStrategy(pipeline_parallel_size=2, data_parallel_size=2, expert_parallel_size=2),
        4,
        2,
    ),
    "tp2dp2ep2": (
        lambda: HybridParallelStrategy(tensor_parallel_size=2, data_parallel_size=2, expert_parallel_size=2),
        4,
        2,
    ),
    "dp2tp2zero": (
        lambda: HybridParallelStrategy(
            data_parallel_size=2, tensor_parallel_size=2, data_parallel_sharding="optimizer"
        ),
        4,
        2,
    ),
    "dp2full": (lambda: HybridParallelStrategy(data_parallel_size=2, data_parallel_sharding="full"), 2, 2),
    "pp2dp2full": (
        lambda: PipelineParallelStrategy(
            pipeline_parallel_size=2, data_parallel_size=2, num_microbatches=2, data_parallel_sharding="full"
        ),
        4,
        2,
    ),
    "pp2": (lambda: PipelineParallelStrategy(pipeline_parallel_size=2, num_microbatches=4), 2, 1),
    "pp4": (lambda: PipelineParallelStrategy(pipeline_parallel_size=4, num_microbatches=4), 4, 1),
    "helix2": (lambda: HelixParallelStrategy(pipeline_parallel_size=2), 2, 1),
    "helix2tp2": (lambda: HelixParallelStrategy(pipeline_parallel_size=2, tensor_parallel_size=2), 4, 1),
    "dp2tp2full": (
        lambda: HybridParallelStrategy(data_parallel_size=2, tensor_parallel_size=2, data_parallel_sharding="full"),
        4,
        2,
    ),
    "auto": (lambda: "auto", 1, 1),  # Lightning's own single-device strategy and checkpoint format
    "tp2": (lambda: HybridParallelStrategy(data_parallel_size=1, tensor_parallel_size=2), 2, 1),
    "pp2tp2": (
        lambda: PipelineParallelStrategy(pipeline_parallel_size=2, tensor_parallel_size=2, num_microbatches=4),
        4,
        1,
    ),
}


class StateAtStart(L.Callback):
    """The whole model's parameters and optimizer state (by name, tensor-parallel shards gathered into the
    original layout) once the checkpoint is restored."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        gather = getattr(strategy, "gather_named_parameters", None)
        layout = getattr(strategy, "_tp_layout", None)
        whole = (lambda n, v: layout.to_full(n, v)) if layout is not None else _full_tensor  # noqa: E731
        named = {id(p): n for n, p in pl_module.named_parameters()}
        state = {
            named[id(p)]: {
                k: whole(named[id(p)], v).detach().clone() if torch.is_tensor(v) else v for k, v in s.items()
            }
            for p, s in _whole_state(strategy, trainer.optimizers[0]).items()
            if id(p) in named
        }
        parts = _collectives.all_gather_object(state) if _collectives.world_size() > 1 else [state]
        self.optimizer = {k: v for part in parts for k, v in part.items()}
        if gather is not None:
            self.params = {k: v.cpu() for k, v in gather().items()}
        else:
            self.params = {k: v.detach().cpu().clone() for k, v in pl_module.named_parameters()}


def _full_tensor(name, value):
    """A full-sharding (FSDP) DTensor gathered whole; any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value


def _whole_state(strategy, optimizer) -> dict:
    """The optimizer's state with whole tensors (sharded data parallelism keeps a chunk per rank: gather)."""
    if getattr(strategy, "_sharded", False):
        return strategy._shards_of(optimizer).checkpoint_state(gather=lambda p: True)
    return optimizer.state


def _train(
    rank, world_size, layout, steps, ckpt_in=None, ckpt_out=None, model="gpt", batches=4, root=None, epoch_end=False
):
    """Train ``steps`` steps (epochs of ``batches``); save to ``ckpt_out`` after fit, or with ``epoch_end``
    through ``ModelCheckpoint`` at the end of the last epoch (Lightning then marks the epoch complete)."""
    make, devices, dp = LAYOUTS[layout]
    f32 = model.endswith("+f32")  # float32 with SGD (a mixture of experts: its grouped GEMM takes no float64)
    model = model.removesuffix("+f32")
    module, data = build(model.removesuffix("+sched"), 8 // dp, "sgd" if f32 else "adamw")
    if not f32:
        module.double()  # Lightning restores "auto" checkpoints into the module as built: build it in float64
    if model.endswith("+sched"):  # an LR scheduler whose state must survive the checkpoint
        configure = module.configure_optimizers

        def with_scheduler():
            opt = configure()
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}

        module.configure_optimizers = with_scheduler
    recorder, at_start = Recorder(), StateAtStart()
    callbacks = [recorder, at_start] + ([_OneReplicaSampler()] if layout == "auto" else [])
    if epoch_end:
        path = Path(ckpt_out)
        callbacks.append(ModelCheckpoint(dirpath=path.parent, filename=path.stem, every_n_epochs=1, save_top_k=1,
                                         enable_version_counter=False))  # fmt: skip
        ckpt_out = None
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=make(), precision="32-true" if f32 else "64-true",
        max_steps=-1 if epoch_end else steps, max_epochs=steps // batches if epoch_end else None,
        limit_train_batches=batches, limit_val_batches=0, num_sanity_val_steps=0, logger=False,
        enable_checkpointing=epoch_end, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=root or os.getcwd(), callbacks=callbacks,
    )  # fmt: skip
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_in)
    if ckpt_out is not None:
        trainer.save_checkpoint(ckpt_out)
    return [float(x) for x in recorder.records.losses], recorder.records.params[-1], at_start.params, at_start.optimizer


def _run(layout, *args, **kwargs):
    devices = LAYOUTS[layout][1]
    if layout == "auto":
        return _train(0, 1, layout, *args, **kwargs)
    return run_distributed(_train, devices, layout, *args, init_process_group=False, timeout=150, **kwargs)[0]


def _assert_close(got: dict, want: dict, what: str, tol: dict = TOL) -> None:
    assert got.keys() == want.keys(), f"{what}: keys differ {sorted(got.keys() ^ want.keys())[:5]}"
    for k in want:
        if isinstance(want[k], dict):
            _assert_close(got[k], want[k], f"{what}[{k}]", tol)
        elif torch.is_tensor(want[k]):
            torch.testing.assert_close(got[k], want[k], **tol, msg=lambda m, k=k: f"{what}[{k}]: {m}")
        else:
            assert got[k] == want[k], f"{what}[{k}]"


# -------------------------------------------------------------------------------- exact resume


@pytest.mark.parametrize(
    "layout,model",
    [
        pytest.param("pp2", "gpt", marks=pytest.mark.slow),  # pp2 gpt+sched resumes the pipeline fast
        pytest.param("helix2", "gpt", marks=pytest.mark.slow),  # helix2 resumes fast with the deferred GPT
        ("dp2", "gpt"),
        pytest.param("dp2zero", "gpt", marks=pytest.mark.slow),  # (time) dp2zero -> tp2 and -> pp2dp2full: fast
        pytest.param("dp2tp2zero", "gpt", marks=pytest.mark.slow),  # dp2zero -> tp2 restores ZeRO state fast
        # slow tier (time): full sharding resumes fast in the layout-change test below (dp2zero -> pp2dp2full,
        # tp2 -> dp2tp2full)
        pytest.param("dp2full", "gpt", marks=pytest.mark.slow),
        pytest.param("pp2dp2full", "gpt", marks=pytest.mark.slow),
        ("pp2", "gpt+sched"),
        # blocks still on meta read their keys (and optimizer state) at their first call; slow tier (time: 10 s
        # each): a deferred model resumes fast in test_deferred_init's share test (tp=2, resume)
        pytest.param("tp2", "gpt-deferred", marks=pytest.mark.slow),
        pytest.param("helix2", "gpt-deferred", marks=pytest.mark.slow),
        pytest.param("helix2tp2", "gpt", marks=pytest.mark.slow),  # tp2 -> helix2tp2 places the fused q|k|v fast
        # FSDP2's shards of tensor-parallel shards (the fused q|k|v gathered on save); tp2 -> dp2tp2full restores
        # state into them fast
        pytest.param("dp2tp2full", "gpt", marks=pytest.mark.slow),
    ],
)
def test_resume_at_epoch_boundary_continues_the_straight_run_exactly(layout, model, tmp_path):
    kw = dict(model=model, epoch_end=True)
    straight, final, _, _ = _run(layout, 8, ckpt_out=str(tmp_path / "straight.ckpt"), **kw)
    ckpt = str(tmp_path / "epoch.ckpt")
    first, _, _, _ = _run(layout, 4, ckpt_out=ckpt, **kw)  # one epoch of 4 batches
    assert os.path.isdir(ckpt) and not os.path.exists(ckpt + ".partial")
    if model.endswith("+sched"):
        assert load_sharded(ckpt)["lr_schedulers"][0]["last_epoch"] == 1  # StepLR steps once per epoch
    second, resumed_final, _, _ = _run(layout, 8, ckpt_in=ckpt, ckpt_out=str(tmp_path / "resumed.ckpt"), **kw)
    assert len(first) == 4 and len(second) == 4
    torch.testing.assert_close(torch.tensor(first + second), torch.tensor(straight), **TOL)
    _assert_close(resumed_final, final, "parameters after step 8")


def test_resume_mid_epoch_matches_lightnings_own_resume(tmp_path):
    """Saved after 3 of 4 batches: the pipeline resumes exactly as Lightning resumes one device."""
    results = {}
    for layout in ("auto", "pp2"):
        ckpt = str(tmp_path / f"{layout}.ckpt")
        first, _, _, _ = _run(layout, 3, ckpt_out=ckpt)
        second, final, _, _ = _run(layout, 6, ckpt_in=ckpt)
        results[layout] = (first + second, final)
    torch.testing.assert_close(torch.tensor(results["pp2"][0]), torch.tensor(results["auto"][0]), **TOL)
    _assert_close(results["pp2"][1], results["auto"][1], "parameters after the resumed run")


# ----------------------------------------------------------------------------- another layout


@pytest.mark.parametrize(
    "source,target",
    [
        ("pp2", "one"),
        ("pp2", "helix2"),
        ("dp2", "pp2"),
        pytest.param("helix2", "pp2", marks=pytest.mark.slow),  # (time) pp2 -> helix2 restores helix fast
        pytest.param("pp2", "dp2", marks=pytest.mark.slow),  # dp2 -> pp2 reads dp2's; pp2 is written fast elsewhere
        ("dp2zero", "tp2"),
        pytest.param("pp2", "dp2zero", marks=pytest.mark.slow),  # dp2zero is read from dp2zero -> tp2 fast
        ("dp2full", "pp2"),
        pytest.param("pp2", "dp2full", marks=pytest.mark.slow),  # (time) dp2full -> pp2, dp2zero -> pp2dp2full fast
        ("dp2zero", "pp2dp2full"),
        ("tp2", "pp2"),  # the embedding and head: vocabulary shards -> shards over the stages
        # whole blocks restored, then sharded and placed at helix's first step (slow tier, time: 8 s)
        pytest.param("tp2", "helix2tp2", marks=pytest.mark.slow),
        pytest.param("helix2tp2", "one", marks=pytest.mark.slow),  # helix2tp2's checkpoint is written fast above
        pytest.param("dp2tp2full", "pp2", marks=pytest.mark.slow),  # dp2tp2full's is written by its exact resume
        # restored whole before the first step commits and shards the blocks (slow tier, time: 8 s)
        pytest.param("tp2", "dp2tp2full", marks=pytest.mark.slow),
        pytest.param("dp2tp2full", "helix2tp2", marks=pytest.mark.slow),
        pytest.param("pp2dp2full", "tp2", marks=pytest.mark.slow),  # dp2zero -> pp2dp2full, dp2zero -> tp2 fast
        (
            "pp2",
            "auto",
        ),  # Lightning's own strategy resumes from the directory (lightning_parallel.lightning_patches)
    ],  # fmt: skip
)
def test_resume_under_another_layout_restores_model_and_optimizer_state(source, target, tmp_path):
    ckpt = str(tmp_path / f"{source}.ckpt")
    _run(source, 2, ckpt_out=ckpt)
    saved = load_sharded(ckpt)
    _, _, params, optimizer = _run(target, 3, ckpt_in=ckpt)
    _assert_close(params, {k: v for k, v in saved["state_dict"].items() if k in params}, "parameters")
    assert params.keys() == {n for n, _ in build("gpt", 8, "adamw")[0].named_parameters()}
    _assert_close(optimizer, saved["optimizer_states"][0]["state"], "optimizer state")
    assert all(int(s["step"]) == 2 for s in optimizer.values())


@pytest.mark.slow
def test_resume_from_pp2_under_pp4(tmp_path):
    ckpt = str(tmp_path / "pp2.ckpt")
    _run("pp2", 2, ckpt_out=ckpt)
    saved = load_sharded(ckpt)
    _, _, params, optimizer = _run("pp4", 3, ckpt_in=ckpt)
    _assert_close(params, {k: v for k, v in saved["state_dict"].items() if k in params}, "parameters")
    _assert_close(optimizer, saved["optimizer_states"][0]["state"], "optimizer state")


# ------------------------------------------------------------------------------------- export

_LOAD_PLAIN = """
import sys
sys.modules["lightning_parallel"] = None  # lightning-parallel is not installed where the file is loaded
import torch
from examples.models import GPT
module = GPT.load_from_checkpoint(sys.argv[1], map_location="cpu")
torch.save({k: v.detach() for k, v in module.state_dict().items()}, sys.argv[2])
"""


@pytest.mark.slow  # (time: 15 s) the command line's bad input is tested fast below
def test_export_writes_a_plain_checkpoint_that_loads_and_resumes_without_us(tmp_path):
    ckpt, plain = str(tmp_path / "pp2.ckpt"), str(tmp_path / "plain.ckpt")
    _, _, _, _ = _run("pp2", 2, ckpt_out=ckpt)
    proc = subprocess.run([sys.executable, "-m", "lightning_parallel.export", ckpt, plain], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    saved = load_sharded(ckpt)
    loaded = subprocess.run([sys.executable, "-c", _LOAD_PLAIN, plain, str(tmp_path / "sd.pt")], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    as_built = {k: v.float() for k, v in saved["state_dict"].items()}  # the module is built in float32
    _assert_close(torch.load(tmp_path / "sd.pt"), as_built, "load_from_checkpoint")
    # the plain file resumes in Lightning's own single-device loop and in any of our layouts
    for layout in ("auto", "helix2"):
        _, _, params, optimizer = _run(layout, 3, ckpt_in=plain)
        _assert_close(params, {k: v for k, v in saved["state_dict"].items() if k in params}, f"{layout}: parameters")
        _assert_close(optimizer, saved["optimizer_states"][0]["state"], f"{layout}: optimizer state")


def test_plain_lightning_checkpoint_resumes_under_the_pipeline_like_lightning(tmp_path):
    plain = str(tmp_path / "auto.ckpt")
    first, _, _, _ = _run("auto", 4, ckpt_out=plain)
    auto, _, _, _ = _run("auto", 6, ckpt_in=plain)
    pp2, _, _, _ = _run("pp2", 6, ckpt_in=plain)
    torch.testing.assert_close(torch.tensor(pp2), torch.tensor(auto), **TOL)


def test_export_cli_reports_a_bad_directory(tmp_path):
    (tmp_path / "empty.ckpt").mkdir()
    proc = subprocess.run([sys.executable, "-m", "lightning_parallel.export", str(tmp_path / "empty.ckpt"),
                           str(tmp_path / "out.ckpt")], cwd=ROOT, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2 and "has no lightning.pt" in proc.stderr, proc.stderr


# ---------------------------------------------------------------- interrupted save, bad input


class _FailSecondSave(L.Callback):
    """After the first checkpoint, make rank 1's DCP writer fail."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == 2 and trainer.global_rank == 1:  # the step-1 checkpoint exists by now
            from torch.distributed.checkpoint import FileSystemWriter

            def broken(*args, **kwargs):
                raise OSError("injected writer failure on rank 1")

            FileSystemWriter.write_data = broken


def _interrupted(rank, world_size, root):
    module, data = build("gpt", 8, "adamw")
    ckpt = ModelCheckpoint(
        dirpath=root, filename="model", every_n_train_steps=1, save_top_k=1, enable_version_counter=False
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=PipelineParallelStrategy(pipeline_parallel_size=2, num_microbatches=4),
        precision="64-true", max_steps=4, limit_val_batches=0, num_sanity_val_steps=0, logger=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
        callbacks=[_FailSecondSave(), ckpt],
    )  # fmt: skip
    trainer.fit(module, datamodule=data)


def test_a_failed_save_ends_the_job_and_keeps_the_previous_checkpoint(tmp_path):
    import time

    t0 = time.monotonic()
    with pytest.raises(RankFailed, match="injected writer failure on rank 1"):
        run_distributed(_interrupted, 2, str(tmp_path), init_process_group=False, timeout=120)
    assert time.monotonic() - t0 < 60, "the job must end with the error, not hang"
    assert (tmp_path / "model.ckpt").is_dir(), sorted(os.listdir(tmp_path))
    saved = load_sharded(tmp_path / "model.ckpt")  # the step-1 checkpoint, complete and readable
    assert saved["global_step"] == 1
    names = {n for n, _ in build("gpt", 8, "adamw")[0].named_parameters()}
    assert names <= saved["state_dict"].keys()


def test_checkpoint_of_another_model_names_the_parameters(tmp_path):
    ckpt = str(tmp_path / "gpt.ckpt")
    _run("pp2", 1, ckpt_out=ckpt)
    with pytest.raises(RankFailed, match=r"does not match Llama: \d+ missing parameter\(s\) \['.*'\], \d+ unexpected"):
        _run("pp2", 2, ckpt_in=ckpt, model="llama")


def test_partial_and_corrupt_directories_are_refused(tmp_path):
    ckpt = tmp_path / "gpt.ckpt"
    _run("pp2", 1, ckpt_out=str(ckpt))
    (ckpt / "lightning.pt").rename(tmp_path / "moved.pt")
    with pytest.raises(
        CheckpointError, match="is not a complete lightning-parallel checkpoint: it has no lightning.pt"
    ):
        load_sharded(ckpt)
    (tmp_path / "moved.pt").rename(ckpt / "lightning.pt")
    (ckpt / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(CheckpointError, match="the checkpoint's shards cannot be read"):
        load_sharded(ckpt)
    with pytest.raises(RankFailed, match="the checkpoint's shards cannot be read"):
        _run("pp2", 2, ckpt_in=str(ckpt))


@pytest.mark.parametrize("model", [pytest.param("llama", marks=pytest.mark.slow), "encoder"])  # (time)
def test_other_example_models_resume_under_another_layout(model, tmp_path):
    ckpt = str(tmp_path / f"{model}.ckpt")
    _run("pp2", 2, ckpt_out=ckpt, model=model)
    saved = load_sharded(ckpt)
    _, _, params, optimizer = _run("helix2", 3, ckpt_in=ckpt, model=model)
    _assert_close(params, {k: v for k, v in saved["state_dict"].items() if k in params}, "parameters")
    _assert_close(optimizer, saved["optimizer_states"][0]["state"], "optimizer state")


# ---------------------------------------------------------------------- tensor-parallel layouts


@pytest.mark.parametrize(  # fused q|k|v: nanoGPT's c_attn, MHA's in_proj_weight
    "model", ["gpt", pytest.param("encoder", marks=pytest.mark.slow)]
)
def test_tensor_parallel_checkpoint_holds_the_original_layout_and_round_trips(model, tmp_path):
    tp2, one = str(tmp_path / "tp2.ckpt"), str(tmp_path / "one.ckpt")
    _run("tp2", 2, ckpt_out=tp2, model=model)
    _run("one", 2, ckpt_out=one, model=model)
    saved, reference = load_sharded(tp2), load_sharded(one)
    _assert_close(saved["state_dict"], reference["state_dict"], "tp=2 checkpoint vs one device")
    _assert_close(saved["optimizer_states"][0]["state"], reference["optimizer_states"][0]["state"], "optimizer")
    for source, target in ((tp2, "one"), (one, "tp2")):  # save at tp=2, load at tp=1 and back
        _, _, params, optimizer = _run(target, 3, ckpt_in=source, model=model)
        _assert_close(params, {k: v for k, v in reference["state_dict"].items() if k in params}, target)
        _assert_close(optimizer, reference["optimizer_states"][0]["state"], f"{target}: optimizer state")


@pytest.mark.slow  # (time: 8 s) the fused q|k|v's rank-aligned permutation round-trips fast above
def test_sharded_experts_are_saved_whole_and_round_trip(tmp_path):
    """Qwen3-MoE at tp=2 holds half of every expert's hidden size, its gate and up rows permuted rank-aligned:
    the checkpoint holds each expert whole in the original order, equal to one device's (float32, SGD with
    momentum: 1e-5), and loads at tp=1 and back at tp=2."""
    f32 = dict(rtol=1e-5, atol=1e-5)
    tp2, one = str(tmp_path / "tp2.ckpt"), str(tmp_path / "one.ckpt")
    _run("tp2", 2, ckpt_out=tp2, model="hf:qwen3_moe+f32")
    _run("one", 2, ckpt_out=one, model="hf:qwen3_moe+f32")
    saved, reference = load_sharded(tp2), load_sharded(one)
    experts = [k for k in reference["state_dict"] if k.endswith("experts.gate_up_proj")]
    assert experts and all(saved["state_dict"][k].shape == reference["state_dict"][k].shape for k in experts)
    _assert_close(saved["state_dict"], reference["state_dict"], "tp=2 checkpoint vs one device", f32)
    _assert_close(saved["optimizer_states"][0]["state"], reference["optimizer_states"][0]["state"], "momentum", f32)
    for source, target in ((tp2, "one"), (one, "tp2")):
        _, _, params, optimizer = _run(target, 3, ckpt_in=source, model="hf:qwen3_moe+f32")
        _assert_close(params, {k: v for k, v in reference["state_dict"].items() if k in params}, target, f32)
        _assert_close(optimizer, reference["optimizer_states"][0]["state"], f"{target}: momentum", f32)


def test_a_stage_reads_only_the_keys_it_holds(tmp_path):
    """Loading reads only the tensors a rank holds (DCP's planner with the keys requested), and still knows
    every key the checkpoint has, so strict loading names what is missing."""
    ckpt = str(tmp_path / "pp2.ckpt")
    _run("pp2", 2, ckpt_out=ckpt)
    whole = load_sharded(ckpt)
    held = [k for k in whole["state_dict"] if k.startswith("transformer.h.0.")] + ["transformer.wte.weight"]
    part = load_sharded(ckpt, held)
    assert sorted(part["state_dict"]) == sorted(held)
    assert sorted(part["optimizer_states"][0]["state"]) == sorted(
        k for k in held if k in whole["optimizer_states"][0]["state"]
    )
    for k in held:
        torch.testing.assert_close(part["state_dict"][k], whole["state_dict"][k], rtol=0, atol=0)
    assert part["lp_state_keys"] == sorted(whole["state_dict"])
    assert part["optimizer_states"][0]["param_groups"] == whole["optimizer_states"][0]["param_groups"]


def test_load_from_checkpoint_reads_a_sharded_directory(tmp_path):
    from examples.models import GPT

    ckpt = str(tmp_path / "pp2.ckpt")
    _run("pp2", 2, ckpt_out=ckpt)
    saved = load_sharded(ckpt)
    module = GPT.load_from_checkpoint(ckpt, map_location="cpu")
    got = module.state_dict()
    assert got.keys() == saved["state_dict"].keys()
    for k, v in saved["state_dict"].items():
        torch.testing.assert_close(got[k], v.to(got[k].dtype), rtol=0, atol=0, msg=k)  # the module is float32
    (tmp_path / "not_a_checkpoint").mkdir()
    with pytest.raises(
        CheckpointError, match=r"not a complete lightning-parallel checkpoint.*lightning_parallel.export"
    ):
        GPT.load_from_checkpoint(str(tmp_path / "not_a_checkpoint"))


def _save_consolidated(rank, world_size, path):
    module, data = build("gpt", 8, "adamw")
    strategy = PipelineParallelStrategy(pipeline_parallel_size=2, num_microbatches=4, save_distributed_checkpoint=False)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, datamodule=data)
    trainer.save_checkpoint(path)
    return {k: v.cpu() for k, v in trainer.strategy.gather_named_parameters().items()}


@pytest.mark.slow  # (time: 8 s; the export command writes one plain file in the slow tier too)
def test_save_distributed_checkpoint_false_writes_one_plain_file(tmp_path):
    path = tmp_path / "one.ckpt"
    params = run_distributed(_save_consolidated, 2, str(path), init_process_group=False, timeout=120)[0]
    assert path.is_file() and not (tmp_path / "one.ckpt.shards").exists()
    plain = torch.load(path, map_location="cpu", weights_only=False)
    assert "lp_format" not in plain and len(plain["optimizer_states"]) == 1
    for k, v in params.items():
        torch.testing.assert_close(plain["state_dict"][k], v, rtol=0, atol=0, msg=k)
    proc = subprocess.run([sys.executable, "-c", _LOAD_PLAIN, str(path), str(tmp_path / "sd.pt")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]


def _after_fit(rank, world_size, layout, path):
    make, devices, dp = LAYOUTS[layout]
    module, data = build("gpt", 8, "adamw")
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=make(), max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, datamodule=data)
    try:
        module.state_dict()
        refused = ""
    except RuntimeError as err:
        refused = str(err)
    full = trainer.strategy.full_state_dict()
    if full:
        torch.save(full, path)
    trainer.save_checkpoint(path + ".ckpt")  # the library's own partial reads still work
    return refused, sorted(full), {k: v.cpu() for k, v in trainer.strategy.gather_named_parameters().items()}


@pytest.mark.parametrize("layout", ["pp2", "helix2"])
def test_the_module_after_a_pipelined_fit_is_never_silently_partial(layout, tmp_path):
    path = str(tmp_path / "full.pt")
    results = run_distributed(_after_fit, 2, layout, path, init_process_group=False, timeout=120)
    for refused, _, _ in results:
        assert "state_dict() would be partial" in refused and "trainer.strategy.full_state_dict()" in refused
    keys, params = results[0][1], results[0][2]
    assert results[1][1] == []  # the whole model goes to rank 0 only
    fresh = build("gpt", 8, "adamw")[0]
    assert keys == sorted(fresh.state_dict())
    fresh.load_state_dict(torch.load(path, weights_only=True))  # strict: every tensor, none on meta
    for k, v in params.items():
        torch.testing.assert_close(fresh.state_dict()[k], v.to(fresh.state_dict()[k].dtype), rtol=0, atol=0, msg=k)
