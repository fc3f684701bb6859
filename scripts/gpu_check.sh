#!/usr/bin/env bash
# The device check for a lent GPU (one NVIDIA H200 here), from a fresh machine of this workplace's CUDA image:
# it uses the image's python3 (torch, Lightning, transformers, pytest are there) with this repository on the
# path; scripts/gpu_requirements.txt lists what it would need beyond the image (nothing, today). Writes
# gpu_check/ (or $OUT/): env.txt, pytest.txt, gpu_report.jsonl, header_cost.txt. Well under 8 minutes.
#
#   bash scripts/gpu_check.sh
#
# What it checks: tests/gpu and the gpu cases of tests/unit/test_rng.py: the dropout streams' CUDA generators;
# offload, recomputation policies and the chunked loss on CUDA with peak memory; each strategy's set-up and three
# steps on NCCL at world size 1 against a plain Trainer (and on a "cpu:gloo,cuda:nccl" group); ring attention's
# op on CUDA against SDPA; and the device header's cost per message. What needs several GPUs (NCCL between
# ranks: the pipeline's messages, tp / sp collectives) is not checked by it; tests/helpers/comm_check.py checks
# NCCL's rules on gloo instead.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-gpu_check}"
mkdir -p "$OUT_DIR"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 LP_GPU_REPORT="$OUT_DIR/gpu_report.jsonl"
: > "$LP_GPU_REPORT"
if compgen -G ".whl/*.whl" > /dev/null; then  # wheels carried beside the repository, if any
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    "$PY" -c "import torch, lightning, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'lightning', lightning.__version__, 'transformers', transformers.__version__); import torch.distributed as d; print('nccl', torch.cuda.nccl.version())"
    "$PY" -c "import flash_attn; print('flash_attn', flash_attn.__version__)" 2>&1 | tail -1
} 2>&1 | tee "$OUT_DIR/env.txt"
status=0
timeout 420 "$PY" -m pytest tests/gpu tests/unit/test_rng.py -m gpu -q -s -p no:cacheprovider -o addopts="" --timeout 400 -W ignore::DeprecationWarning 2>&1 | tee "$OUT_DIR/pytest.txt" || status=1
timeout 60 "$PY" benchmarks/header_cost.py 2>&1 | tee "$OUT_DIR/header_cost.txt" || status=1
echo "gpu_check: exit $status"
exit $status
