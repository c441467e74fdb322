#!/usr/bin/env bash
# Downloads the wheels the GPU device image lacks (Python 3.12, x86-64) into
# .gpu-wheels/ for scripts/gpu_check.sh; they travel with `carry`.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .gpu-wheels && mkdir -p .gpu-wheels
python3 -m pip download -q --no-deps --only-binary :all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d .gpu-wheels \
  grpcio-health-checking==1.85.* grpcio-reflection==1.85.* gguf onnxruntime-genai
du -sh .gpu-wheels && ls .gpu-wheels
