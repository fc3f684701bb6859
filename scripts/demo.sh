#!/usr/bin/env bash
# The main job: the example GPT on Shakespeare through LightningCLI on 2 CPU processes.
# Extra arguments go to LightningCLI, e.g. `bash scripts/demo.sh --trainer.max_steps=50`.
source "$(dirname "$0")/env.sh"
exec "$VENV/bin/python" -m examples.train fit --config examples/configs/demo.yaml "$@"
