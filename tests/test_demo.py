"""The README's demo, launched for real: LightningCLI + YAML + Lightning's own subprocess launcher, 2 ranks."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
