#!/usr/bin/env bash
# Sets up a fresh machine: a virtual environment in .venv with every runtime,
# export, benchmark and test dependency. Idempotent; safe to rerun.
#   torch: `torch==2.13.0` is pinned first because on this kind of machine that
#   exact version is a local CPU wheel; any other spec would pull a multi-GB
#   CUDA build. On a GPU machine, install the torch build you want first.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "[setup] installing torch==2.13.0 (CPU)"
  .venv/bin/python -m pip install -q "torch==${SPECDEC_TORCH_VERSION:-2.13.0}"
fi
echo "[setup] installing specdec and its dependencies"
.venv/bin/python -m pip install -q -e ".[export,bench,dev]"
echo "[setup] done: $(.venv/bin/python -c 'import torch, transformers, onnxruntime, grpc; print(f"torch {torch.__version__}, transformers {transformers.__version__}, onnxruntime {onnxruntime.__version__}, grpcio {grpc.__version__}")')"
