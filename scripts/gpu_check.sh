#!/usr/bin/env bash
# GPU check: on a machine with CUDA, install what is needed, run the default
# pair (target on CUDA in bf16, draft on the CUDA execution provider) through
# the services and print the benchmark. Never used by CI.
#
#   bash scripts/gpu_check.sh [OUT_DIR]
#
# Needs network access to PyPI (for the CUDA builds of torch and
# onnxruntime-gpu and the model packages), or a pre-filled pip cache/wheelhouse
# (PIP_FIND_LINKS) and a pre-filled $SPECDEC_CACHE_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench-out/gpu}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
PY=${PYTHON:-python3}
[ -x .venv-gpu/bin/python ] || "$PY" -m venv .venv-gpu
.venv-gpu/bin/python -m pip install -q --upgrade pip
.venv-gpu/bin/python -c "import torch; assert torch.cuda.is_available()" 2>/dev/null \
  || .venv-gpu/bin/python -m pip install -q torch
.venv-gpu/bin/python -m pip install -q -e ".[export,bench,dev]"
# onnxruntime-gpu replaces the CPU build (same module name)
.venv-gpu/bin/python -m pip uninstall -q -y onnxruntime || true
.venv-gpu/bin/python -m pip install -q onnxruntime-gpu
.venv-gpu/bin/python - <<'PY'
import onnxruntime as ort, torch
print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0))
print("onnxruntime", ort.__version__, ort.get_available_providers())
assert "CUDAExecutionProvider" in ort.get_available_providers(), "onnxruntime-gpu has no CUDA provider"
PY
.venv-gpu/bin/specdec models prepare
.venv-gpu/bin/python -m specdec.cli bench --launch --target-dtype bfloat16 --gammas 2,4,8 \
  --max-new-tokens 128 --out "$OUT" \
  --up-args="--target-device cuda --draft-execution cuda --draft-precision fp16"
