# Sourced by scripts/demo.sh and scripts/test.sh: create or reuse the local virtual environment.
# torch==2.13.0 is installed first and on its own, so that nothing later (lightning asks for "torch>=...")
# can pull a multi-gigabyte CUDA build; on this kind of machine pip finds the CPU wheel of 2.13.0 locally. The
# constraints file keeps it there while the dev extra's packages resolve.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV="${VENV:-.venv}"
PY="${PYTHON:-python3}"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
stamp="$VENV/.lightning-parallel-installed"
want="$(cat pyproject.toml scripts/env.sh scripts/constraints.txt | sha256sum | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check "torch==2.13.0"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -c scripts/constraints.txt -e ".[dev]"
    # timm for the coverage matrix, without torchvision (see pyproject.toml); its other requirements are in place
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps "timm==1.0.31"
    echo "$want" > "$stamp"
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
