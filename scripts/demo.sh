#!/usr/bin/env bash
# The main job: the example GPT on Shakespeare, HelixPipe over 2 CPU processes, through LightningCLI.
# Extra arguments go to LightningCLI, e.g. `bash scripts/demo.sh --trainer.max_steps=50`.
source "$(dirname "$0")/env.sh"
exec "$VENV/bin/python" -m examples.train fit --config examples/configs/helix.yaml "$@"
