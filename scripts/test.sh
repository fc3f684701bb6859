#!/usr/bin/env bash
# The test suite. Default: the fast tier CI runs. `bash scripts/test.sh -m slow` runs the full matrices,
# `bash scripts/test.sh -m ""` everything; other arguments go to pytest.
source "$(dirname "$0")/env.sh"
exec "$VENV/bin/python" -m pytest -m "not slow and not gpu" "$@"
