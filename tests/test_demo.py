"""The README's demo, launched for real: LightningCLI + YAML + Lightning's own subprocess launcher, 2 ranks."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # (time: 23 s) the README's demo command, tested fast below, trains the same way
def test_demo_config_trains_on_two_processes_and_the_loss_falls(tmp_path):
    cmd = [
        sys.executable, "-m", "examples.train", "fit", "--config", str(ROOT / "examples/configs/demo.yaml"),
        "--trainer.max_steps=60", f"--trainer.default_root_dir={tmp_path}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Starting with 2 processes" in proc.stderr + proc.stdout
    losses = [float(x) for x in re.findall(r"^step\s+\d+\s+loss ([\d.]+)$", proc.stdout, flags=re.M)]
    assert len(losses) == 3, proc.stdout
    assert losses[-1] < losses[0], losses


def test_readme_demo_helix_config_writes_the_profilers_files(tmp_path):
    cmd = [
        sys.executable, "-m", "examples.train", "fit", "--config", str(ROOT / "examples/configs/helix.yaml"),
        "--trainer.max_steps=20", "--trainer.val_check_interval=20", f"--trainer.default_root_dir={tmp_path}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"^step\s+20\s+loss [\d.]+$", proc.stdout, flags=re.M), proc.stdout
    (log_dir,) = (tmp_path / "lightning_logs").iterdir()
    for name in ("bubble_trace.json", "bubble_timeline.png", "memory.png"):
        assert (log_dir / name).stat().st_size > 1000, name
    header = (log_dir / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"bubble/stage_0", "bubble/theory_mean", "memory/peak_live_mib/stage_1", "memory/stage_ratio"} <= set(header)


@pytest.mark.slow  # (time: 6 s, a LightningCLI process; the README demo runs a YAML config fast)
def test_helix_x_tensor_parallel_config_builds_the_strategy():
    """examples/configs/helix_tp.yaml parses through LightningCLI into helix x tp (the fast tier's check; the
    4-process run below is slow)."""
    cmd = [sys.executable, "-m", "examples.train", "fit", "--config", str(ROOT / "examples/configs/helix_tp.yaml"),
           "--print_config"]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "class_path: lightning_parallel.HelixParallelStrategy" in out.stdout
    assert "tensor_parallel_size: 2" in out.stdout and "devices: 4" in out.stdout


@pytest.mark.slow
def test_helix_x_tensor_parallel_config_trains_on_four_processes(tmp_path):
    """examples/configs/helix_tp.yaml through LightningCLI and Lightning's own launcher: 2 stages x 2
    tensor-parallel ranks, the loss falls."""
    cmd = [
        sys.executable, "-m", "examples.train", "fit", "--config", str(ROOT / "examples/configs/helix_tp.yaml"),
        "--trainer.max_steps=40", f"--trainer.default_root_dir={tmp_path}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Starting with 4 processes" in proc.stderr + proc.stdout
    losses = [float(x) for x in re.findall(r"^step\s+\d+\s+loss ([\d.]+)$", proc.stdout, flags=re.M)]
    assert len(losses) == 2 and losses[-1] < losses[0], proc.stdout


@pytest.mark.slow  # (time: 35 s, 2 LightningCLI processes)
def test_mixture_of_experts_config_trains_with_expert_parallelism(tmp_path):
    """examples/configs/moe_ep.yaml through LightningCLI and Lightning's own launcher: Mixtral's experts split
    over 2 processes (expert_parallel_size=2), the loss falls."""
    cmd = [
        sys.executable, "-m", "examples.train", "fit", "--config", str(ROOT / "examples/configs/moe_ep.yaml"),
        "--trainer.max_steps=40", "--trainer.val_check_interval=40", f"--trainer.default_root_dir={tmp_path}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Starting with 2 processes" in proc.stderr + proc.stdout
    losses = [float(x) for x in re.findall(r"^step\s+\d+\s+loss ([\d.]+)$", proc.stdout, flags=re.M)]
    assert len(losses) == 2 and losses[-1] < losses[0], proc.stdout
