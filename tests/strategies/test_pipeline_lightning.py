"""Lightning semantics under pipeline parallelism: logging, metrics, monitors, checkpoints, predict,
evaluation, failures and bad input (docs/design.md, "Pipeline parallelism")."""

import os
import re
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

from examples.models import EncoderClassifier
from lightning_parallel import HelixParallelStrategy, PipelineParallelStrategy
from tests.helpers.distributed import RankFailed, run_distributed
from tests.helpers.parity import _OneReplicaSampler, build

ROOT = Path(__file__).resolve().parents[2]


def _trainer(devices, strategy, root, **kwargs):
    defaults = dict(
        accelerator="cpu", devices=devices, strategy=strategy, precision="64-true", logger=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=root, num_sanity_val_steps=0,
    )  # fmt: skip
    return L.Trainer(**{**defaults, **kwargs})


def _metrics(trainer):
    return {k: v.item() for k, v in sorted(trainer.callback_metrics.items())}


def _fit_and_validate(rank, world_size, pipelined):
    module, data = build("encoder", 8, "adamw")
    with tempfile.TemporaryDirectory() as root:
        if pipelined:
            strategy = (
                HelixParallelStrategy(pipeline_parallel_size=2)
                if pipelined == "helix"
                else PipelineParallelStrategy(pipeline_parallel_size=2, num_microbatches=4)
            )
            trainer = _trainer(
                2, strategy, root, max_epochs=2, limit_train_batches=3, limit_val_batches=2, enable_checkpointing=False
            )
        else:
            trainer = _trainer(1, "auto", root, max_epochs=2, limit_train_batches=3, limit_val_batches=2,
                               enable_checkpointing=False, callbacks=[_OneReplicaSampler()])  # fmt: skip
        trainer.fit(module, datamodule=data)
        after_fit = _metrics(trainer)
        trainer.validate(module, datamodule=data, verbose=False)
        return after_fit, _metrics(trainer)


@pytest.mark.parametrize("strategy", ["pipeline", "helix"])
def test_callback_metrics_and_torchmetrics_equal_single_device_on_every_rank(strategy):
    ranks = run_distributed(_fit_and_validate, 2, strategy, init_process_group=False)
    single = _fit_and_validate(0, 1, False)
    assert ranks[0] == ranks[1], "callback_metrics differ between pipeline ranks"
    fit_metrics, val_metrics = ranks[0]
    assert {"train_loss", "train_acc_step", "train_acc_epoch", "val_loss", "val_acc"} <= fit_metrics.keys()
    for got, want in ((fit_metrics, single[0]), (val_metrics, single[1])):
        assert got.keys() == want.keys()
        for k in want:
            assert got[k] == pytest.approx(want[k], rel=1e-9, abs=1e-12), k


def _checkpoint_and_early_stop(rank, world_size, root):
    module, data = build("encoder", 8, "adamw")
    ckpt = ModelCheckpoint(dirpath=root, monitor="val_loss", save_top_k=2, save_last=True)
    stop = EarlyStopping(monitor="val_loss", strict=True, patience=1, min_delta=10.0)  # stops after 2 epochs
    strategy = PipelineParallelStrategy(pipeline_parallel_size=2, num_microbatches=2)
    trainer = _trainer(
        2, strategy, root, max_epochs=5, limit_train_batches=2, limit_val_batches=2, callbacks=[ckpt, stop]
    )
    trainer.fit(module, datamodule=data)
    return trainer.current_epoch, sorted(os.listdir(root)), ckpt.best_model_path


def test_model_checkpoint_top_k_and_early_stopping_under_pp2(tmp_path):
    results = run_distributed(_checkpoint_and_early_stop, 2, str(tmp_path), init_process_group=False)
    epoch, files, best = results[0]
    assert results[1][0] == epoch == 2, "EarlyStopping must stop every rank at the same epoch"
    saved = [f for f in files if f.endswith(".ckpt")]
    assert len(saved) == 3 and "last.ckpt" in saved, files  # top-2 + last
    # each checkpoint is a DCP directory holding every parameter of the full model under its original name
    names = {
        f"state_dict.{n}"
        for n in EncoderClassifier(num_layers=8, d_model=32, nhead=4, dim_feedforward=64, max_len=16).state_dict()
    }
    stored = set(dcp.FileSystemReader(best).read_metadata().state_dict_metadata)
    assert names <= stored, sorted(names - stored)[:5]
    assert (Path(best) / "lightning.pt").exists()


class _PredictEncoder(EncoderClassifier):
    def predict_step(self, batch, batch_idx):
        tokens, _ = batch
        return self(tokens)

    def test_step(self, batch, batch_idx):
        tokens, labels = batch
        logits = self(tokens)
        self.val_acc(logits, labels)
        self.log("test_loss", torch.nn.functional.cross_entropy(logits, labels), sync_dist=True)
        self.log("test_acc", self.val_acc)


def _predict(rank, world_size, pipelined):
    torch.manual_seed(0)
    from tests.helpers.parity import MODEL_KWARGS

    module = _PredictEncoder(**MODEL_KWARGS["encoder"])
    _, data = build("encoder", 8, "adamw")
    loader = data.val_dataloader()
    with tempfile.TemporaryDirectory() as root:
        strategy = PipelineParallelStrategy(pipeline_parallel_size=2, num_microbatches=2) if pipelined else "auto"
        trainer = _trainer(world_size, strategy, root)
        predictions = torch.cat(trainer.predict(module, dataloaders=loader))
        (tested,) = trainer.test(module, dataloaders=loader, verbose=False)
        return predictions, tested


def test_predict_and_test_under_pp2_equal_single_device_on_every_rank():
    got = run_distributed(_predict, 2, True, init_process_group=False)
    want, want_test = _predict(0, 1, False)
    for predictions, tested in got:
        torch.testing.assert_close(predictions, want, rtol=1e-9, atol=1e-12)
        assert tested.keys() == want_test.keys() == {"test_loss", "test_acc"}
        for k in want_test:
            assert tested[k] == pytest.approx(want_test[k], rel=1e-9), k


def _hf_use_cache(rank, world_size):
    module, data = build("hf", 4, "adamw")
    with tempfile.TemporaryDirectory() as root:
        strategy = PipelineParallelStrategy(pipeline_parallel_size=2, num_microbatches=2)
        trainer = _trainer(2, strategy, root, max_steps=1, enable_checkpointing=False, limit_val_batches=0)
        trainer.fit(module, datamodule=data)
        return module.config.use_cache, trainer.strategy.stage_parameter_bytes


def test_hf_use_cache_forced_off_and_parameter_bytes_per_stage():
    (cache0, bytes0), (cache1, _) = run_distributed(_hf_use_cache, 2, init_process_group=False)
    assert cache0 is False and cache1 is False
    full, _ = build("hf", 4, "adamw")
    total = sum(p.numel() * p.element_size() for p in full.double().parameters())
    block = sum(p.numel() * p.element_size() for p in full.model.layers.parameters())
    # each stage holds half the blocks and its shard of the embedding, head and norm: every byte once, halved
    # (to a row of each tensor outside the trunk: odd sizes shard unevenly)
    assert bytes0[0] + bytes0[1] == total
    assert abs(bytes0[0] - bytes0[1]) <= 0.01 * total, (bytes0, total)
    assert bytes0[0] < total - block // 2  # less than the blocks' half plus the whole outer part


def _bf16(rank, world_size, pipelined):
    module, data = build("gpt", 8, "sgd")
    with tempfile.TemporaryDirectory() as root:
        strategy = PipelineParallelStrategy(pipeline_parallel_size=2, num_microbatches=2) if pipelined else "auto"
        callbacks = [] if pipelined else [_OneReplicaSampler()]
        trainer = _trainer(world_size, strategy, root, precision="bf16-mixed", max_steps=3, enable_checkpointing=False,
                           limit_val_batches=0, callbacks=callbacks)  # fmt: skip
        trainer.fit(module, datamodule=data)
        return trainer.callback_metrics["train_loss"].item()


def test_bf16_mixed_trains_like_single_device():
    got = run_distributed(_bf16, 2, True, init_process_group=False)
    want = _bf16(0, 1, False)
    assert got[0] == got[1] == pytest.approx(want, rel=2e-2)


# ----------------------------------------------------------------------------------- failures
FAILING_SCRIPT = textwrap.dedent(
    """
    import lightning as L
    from examples.data import CharDataModule
    from examples.models import GPT
    from lightning_parallel import HelixParallelStrategy, PipelineParallelStrategy

    class Failing(GPT):
        def training_step(self, batch, batch_idx):
            if batch_idx == 1 and self.global_rank == 1:
                raise ValueError("injected failure on rank 1")
            return super().training_step(batch, batch_idx)

    if __name__ == "__main__":
        data = CharDataModule(block_size=16, batch_size=4)
        trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=5, logger=False, enable_checkpointing=False,
                            strategy=PipelineParallelStrategy(pipeline_parallel_size=2, num_microbatches=2))
        trainer.fit(Failing(vocab_size=data.vocab_size, block_size=16, n_layer=2, n_embd=32), datamodule=data)
    """
)


def test_exception_on_one_stage_ends_the_whole_job_with_its_traceback(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(FAILING_SCRIPT)
    start = time.monotonic()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert "[rank 1]" in proc.stderr and "ValueError: injected failure on rank 1" in proc.stderr, proc.stderr[-3000:]
    assert elapsed < 60, f"the job took {elapsed:.0f} s to end"


KILLED_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    import lightning as L
    from examples.data import CharDataModule
    from examples.models import GPT
    from lightning_parallel import HybridParallelStrategy, PipelineParallelStrategy

    class Killed(GPT):
        def training_step(self, batch, batch_idx):
            if batch_idx == 1 and self.global_rank == 1 and sys.argv[2] == "step":
                os.kill(os.getpid(), signal.SIGKILL)
            return super().training_step(batch, batch_idx)

        def on_save_checkpoint(self, checkpoint):
            if self.global_rank == 1 and sys.argv[2] == "save":
                os.kill(os.getpid(), signal.SIGKILL)

    if __name__ == "__main__":
        data = CharDataModule(block_size=16, batch_size=4)
        strategy = {
            "pipeline": lambda: PipelineParallelStrategy(pipeline_parallel_size=2, num_microbatches=2),
            "tensor_parallel": lambda: HybridParallelStrategy(data_parallel_size=1, tensor_parallel_size=2),
        }[sys.argv[1]]()
        checkpoint = L.pytorch.callbacks.ModelCheckpoint(dirpath="ckpt", every_n_train_steps=2)
        trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=5, logger=False, callbacks=[checkpoint],
                            enable_progress_bar=False, strategy=strategy)
        trainer.fit(Killed(vocab_size=data.vocab_size, block_size=16, n_layer=2, n_embd=32), datamodule=data)
    """
)


@pytest.mark.parametrize(
    "strategy,when",
    [
        # slow tier (time): a rank killed in a pipeline's step is tests/strategies/test_killed_ranks.py's fast case
        pytest.param("pipeline", "step", marks=pytest.mark.slow),
        # slow tier (time): HybridParallelStrategy's failure path is the pipeline's
        pytest.param("tensor_parallel", "step", marks=pytest.mark.slow),
        pytest.param("pipeline", "save", marks=pytest.mark.slow),  # (time: 13 s) killed in a step: fast there
    ],
)
def test_a_killed_rank_is_named_by_its_peers(strategy, when, tmp_path):
    script = tmp_path / "killed.py"
    script.write_text(KILLED_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(script), strategy, when], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode != 0
    assert re.search(r"\[rank 0\] rank 1 \(pid \d+ on .*\) died: its process is no longer running", proc.stderr), (
        proc.stderr[-3000:]
    )
    first = proc.stderr.index("died: its process")
    assert "Traceback" not in proc.stderr[:first]  # the first thing the user reads
    assert time.monotonic() - start < 60


@pytest.mark.slow  # (time: 13 s) test_killed_ranks names the killed rank alone fast; this, a rank that raised
def test_a_rank_that_raised_is_not_called_dead(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(FAILING_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert "ValueError: injected failure on rank 1" in proc.stderr and "died:" not in proc.stderr, proc.stderr[-3000:]


SIGTERM_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    import lightning as L
    from examples.data import CharDataModule
    from examples.models import GPT
    from lightning_parallel import HelixParallelStrategy, HybridParallelStrategy, PipelineParallelStrategy

    class Signalled(GPT):
        def training_step(self, batch, batch_idx):
            if batch_idx == 2 and self.global_rank == 0:  # mid-step, as a scheduler's SIGTERM arrives
                os.kill(os.getpid(), signal.SIGTERM)
            return super().training_step(batch, batch_idx)

    if __name__ == "__main__":
        data = CharDataModule(block_size=16, batch_size=4)
        strategy = {
            "pipeline": lambda: PipelineParallelStrategy(pipeline_parallel_size=2, num_microbatches=2),
            "helix": lambda: HelixParallelStrategy(pipeline_parallel_size=2, num_microbatches=4),
            "tensor_parallel": lambda: HybridParallelStrategy(data_parallel_size=1, tensor_parallel_size=2),
            "hybrid": lambda: HybridParallelStrategy(data_parallel_size=2),
        }[sys.argv[1]]()
        trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=50, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, strategy=strategy)
        trainer.fit(Signalled(vocab_size=data.vocab_size, block_size=16, n_layer=2, n_embd=32), datamodule=data)
        print("FINISHED", flush=True)
    """
)


@pytest.mark.parametrize(
    "strategy",
    [
        # (time) the pipeline's failure path is test_exception_on_one_stage's; SIGTERM's is tensor_parallel's below
        pytest.param("pipeline", marks=pytest.mark.slow),
        pytest.param("helix", marks=pytest.mark.slow),  # helix's path is the pipeline's (its on_exception)
        pytest.param("tensor_parallel", marks=pytest.mark.slow),  # (time: 12 s)
        pytest.param("hybrid", marks=pytest.mark.slow),  # hybrid's is tensor_parallel's (HybridParallelStrategy's)
    ],
)
def test_sigterm_ends_every_strategy_the_same_way(strategy, tmp_path):
    """SIGTERM mid-step: no hang (no collective inside the signal handler), every strategy exits 143 (128 +
    SIGTERM) so that schedulers requeueing on the exit code see it, and no teardown error hides the cause."""
    script = tmp_path / "sigterm.py"
    script.write_text(SIGTERM_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(script), strategy], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 143, (proc.returncode, proc.stderr[-3000:])
    assert "FINISHED" not in proc.stdout
    assert "Couldn't swap" not in proc.stderr, proc.stderr[-3000:]
    assert time.monotonic() - start < 60


# ---------------------------------------------------------------------------------- bad input
def _fit_bad(rank, world_size, model_name, strategy_kwargs, trainer_kwargs, batch):
    module, data = build("gpt" if model_name == "manual" else model_name, batch, "adamw")
    if model_name == "manual":
        module.automatic_optimization = False
    with tempfile.TemporaryDirectory() as root:
        strategy = PipelineParallelStrategy(**strategy_kwargs)
        trainer = _trainer(
            world_size, strategy, root, max_steps=1, enable_checkpointing=False, limit_val_batches=0, **trainer_kwargs
        )
        trainer.fit(module, datamodule=data)


BAD_INPUT = [
        (4, dict(pipeline_parallel_size=4, layers_per_stage=[1, 1, 1, 4]), {}, 8, "gpt", r"layers_per_stage=\[1, 1, 1, 4\] sums to 7, but the trunk has 8"),
        (2, dict(pipeline_parallel_size=2, schedule="interleaved_1f1b", virtual_stages=3, num_microbatches=2), {}, 8, "gpt",
         "needs the 8 blocks of 'transformer.h' to divide into 6 equal chunks"),
        (2, dict(pipeline_parallel_size=2, num_microbatches=2), {}, 8, "twice", "called trunk 'transformer.h' more than once"),
        (2, dict(pipeline_parallel_size=2, trunk="transformer.ln_f"), {}, 8, "gpt", "trunk='transformer.ln_f' is a LayerNorm"),
    ]  # fmt: skip


@pytest.mark.parametrize("world,strategy_kwargs,trainer_kwargs,batch,model,message", BAD_INPUT)
def test_bad_input_raises_a_clear_error(world, strategy_kwargs, trainer_kwargs, batch, model, message):
    with pytest.raises(RankFailed, match=message):
        run_distributed(_fit_bad, world, model, strategy_kwargs, trainer_kwargs, batch, init_process_group=False)


def test_pipeline_larger_than_the_trunk():
    with pytest.raises(
        RankFailed,
        match=r"pipeline_parallel_size=4 x virtual_stages=2 = 8 stages need at least 8 blocks, but trunk 'model.layers' has 4",
    ):
        run_distributed(
            _fit_bad,
            4,
            "hf4",
            dict(pipeline_parallel_size=4, schedule="interleaved_1f1b", num_microbatches=4),
            {},
            8,
            init_process_group=False,
        )


def test_manual_optimization_is_rejected():
    with pytest.raises(RankFailed, match="manual optimization is not supported under pipeline parallelism"):
        run_distributed(_fit_bad, 2, "manual", dict(pipeline_parallel_size=2), {}, 8, init_process_group=False)


def test_errors_before_any_process_starts():
    with pytest.raises(
        ValueError, match=r"num_microbatches \(3\) to be a multiple of the number of pipeline stages \(2\)"
    ):
        L.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=PipelineParallelStrategy(schedule="interleaved_1f1b", num_microbatches=3),
        )
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 does not divide world size 4"):
        L.Trainer(accelerator="cpu", devices=4, strategy=PipelineParallelStrategy(pipeline_parallel_size=3))
    # on CPU Lightning itself turns precision="16-mixed" into bf16; a real fp16 plugin (with a loss scaler) is refused
    from lightning.pytorch.plugins import MixedPrecision

    fp16 = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="precision='16-mixed' is not supported under pipeline parallelism"):
        L.Trainer(
            accelerator="cpu", devices=2, plugins=[fp16], strategy=PipelineParallelStrategy(pipeline_parallel_size=2)
        )
    with pytest.raises(ValueError, match="virtual_stages=2 needs schedule='interleaved_1f1b'"):
        PipelineParallelStrategy(virtual_stages=2)
    with pytest.raises(ValueError, match="schedule='zb'"):
        PipelineParallelStrategy(schedule="zb")
    with pytest.raises(ValueError, match="num_microbatches must be a positive int"):
        PipelineParallelStrategy(num_microbatches=0)


def _mismatched_data(rank, world_size):
    module, data = build("gpt", 4, "adamw")
    base = data.train_dataloader

    def train_dataloader():  # shards by global rank: the two stages of one replica see different samples
        loader = base()
        loader.dataset.starts = loader.dataset.starts[module.trainer.global_rank :]
        return loader

    data.train_dataloader = train_dataloader
    with tempfile.TemporaryDirectory() as root:
        trainer = _trainer(2, PipelineParallelStrategy(pipeline_parallel_size=2, num_microbatches=2), root, max_steps=1,
                           enable_checkpointing=False, limit_val_batches=0, use_distributed_sampler=False)  # fmt: skip
        trainer.fit(module, datamodule=data)


def test_ranks_of_one_replica_with_different_batches_are_caught():
    with pytest.raises(RankFailed, match="the pipeline ranks of one replica received different batches"):
        run_distributed(_mismatched_data, 2, init_process_group=False)


def _throughput(rank, world_size, dp, root):
    from lightning.pytorch.callbacks import ThroughputMonitor
    from lightning.pytorch.loggers import CSVLogger

    module, data = build("gpt", 4, "sgd")
    strategy = PipelineParallelStrategy(pipeline_parallel_size=2, data_parallel_size=dp, num_microbatches=2)
    monitor = ThroughputMonitor(batch_size_fn=lambda batch: batch[0].size(0), window_size=2)
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_steps=4, log_every_n_steps=1,
        logger=CSVLogger(root), enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[monitor], limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(module, datamodule=data)
    return trainer.logger.log_dir if rank == 0 else None


@pytest.mark.parametrize("dp", [1, 2])
def test_throughput_monitor_counts_each_replica_once(dp, tmp_path):
    """Under pp=2 every rank of a replica sees the same batch: ThroughputMonitor's global samples/s is the
    replicas' (dp x one device's), and with one replica only the device values are logged, as on one device."""
    import csv

    log_dir = run_distributed(_throughput, 2 * dp, dp, str(tmp_path), init_process_group=False, timeout=120)[0]
    rows = list(csv.DictReader(open(os.path.join(log_dir, "metrics.csv"))))
    device = [float(r["train/device/samples_per_sec"]) for r in rows if r.get("train/device/samples_per_sec")]
    assert device
    if dp == 1:
        assert "train/samples_per_sec" not in rows[0]
    else:
        total = [float(r["train/samples_per_sec"]) for r in rows if r.get("train/samples_per_sec")]
        assert total and all(t == pytest.approx(2 * d, rel=1e-9) for t, d in zip(total, device))


def test_the_launchers_watcher_names_a_child_a_signal_ended_once_and_not_one_that_raised(capsys):
    """The launching process's watcher ends the job a second after a child dies, often before rank 0's own
    collective fails: it names the killed child itself, once, and leaves a child that raised to its traceback."""
    from lightning_parallel.strategies import _failures

    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    main = subprocess.Popen(sleeper)  # stands in for the launching process, which the watcher kills last
    raised = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    killed = subprocess.Popen(sleeper)
    try:
        raised.wait(timeout=30)
        watcher = _failures._NamingObserver(main.pid, [raised], first_rank=4)
        assert watcher._run() is True  # a non-zero child ends the job ...
        assert "died:" not in capsys.readouterr().err  # ... but one that raised is not called dead
        main.wait(timeout=30)
        main = subprocess.Popen(sleeper)
        killed.kill()
        killed.wait(timeout=30)
        watcher = _failures._NamingObserver(main.pid, [killed], first_rank=4)
        assert watcher._run() is True
        err = capsys.readouterr().err
        assert re.search(
            rf"\[rank 4\] rank 5 \(pid {killed.pid} on .*\) died: .*Ended by signal \(rank 5: SIGKILL\)", err
        )
        assert main.wait(timeout=30) == -9
        assert _failures.dead_peers_line([("h", 1)] * 4 + [(socket.gethostname(), killed.pid)] * 2, 4) == ""
    finally:
        for p in (main, raised, killed):
            p.kill()
        _failures._named.clear()
        _failures._remove_job_markers([], wait=0, key=(socket.gethostname(), killed.pid))  # rank 4's own
