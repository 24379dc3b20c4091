#!/usr/bin/env bash
# The GPU device check: GPU tests (pytest -m gpu on tests/ringcore/test_gpu.py and
# tests/end_to_end/test_gpu_runners.py: NCCL ring, CUDA tensors through Gloo, training steps,
# RingEstimator(use_gpu=True) fit + transform on Spark local[1], RingTrainer and
# RayExecutor with use_gpu on a local Ray), allreduce on CUDA tensors ours vs raw
# torch.distributed (1 MB - 1 GB), training samples/s ours vs DDP, one JSON report
# ($OUT/gpu_check.json when OUT is set, else bench/results/gpu_check.json).
# On a machine without a GPU it passes with CPU-only results and says so.
# Needs torch (a CUDA build on the GPU machine), pyspark and ray in $PYTHON.
# Usage: bench/gpu_check.sh [--quick]   (PYTHON=... picks the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
"$PYTHON" -c "import torch" 2>/dev/null || {
  echo "gpu_check: $PYTHON cannot import torch; set PYTHON to an interpreter with torch" >&2
  exit 2
}
"$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpu', torch.cuda.is_available())"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
# the whole check must end within 5 minutes
exec timeout --signal=TERM 290 "$PYTHON" bench/gpu_check.py "$@"
