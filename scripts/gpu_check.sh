#!/usr/bin/env bash
# GPU check, offline, for the lent device machine (no network, at most 64 MiB
# carried). Never used by CI. Runs in under 8 minutes on an H200:
#   1. the exactness and end-to-end tests on tiny models, target on CUDA;
#   2. t(k), k = 1..16, and batches 1..32 of the target and draft architectures
#      (Qwen2.5-Coder 1.5B / 0.5B configs, random weights, bf16), eager and
#      with CUDA graphs (scripts/gpu_costs.py);
#   3. the per-round gRPC + orchestration overhead against a GPU step
#      (scripts/round_overhead.py);
#   4. int4 weight-only matmul (tinygemm, torch.ops.aten._weight_int4pack_mm,
#      group 32) against bf16 F.linear over the 1.5B target's linear layers,
#      M = 1..16 rows, with its packing and row-invariance checks
#      (scripts/gpu_int4.py; skipped with a message where the op is missing).
#
#   bash scripts/gpu_wheels.sh        # here, once: the few wheels the GPU image lacks, into .gpu-wheels/
#   then on the device machine (carry .gpu-wheels):
#   OUT=$OUT bash scripts/gpu_check.sh
#
# The image has torch (CUDA), transformers, grpcio, protobuf, onnxruntime (CPU),
# pytest, scipy and prometheus-client; .gpu-wheels adds grpcio-health-checking,
# grpcio-reflection, gguf and onnxruntime-genai (the tiny drafts' ONNX export).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-${1:-gpu-out}}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/nvidia-smi.txt"
if [ -d .gpu-wheels ]; then
  "$PY" -m pip install -q --no-index --no-deps --find-links .gpu-wheels .gpu-wheels/*.whl 2>&1 | tail -2
fi
"$PY" - <<'PY' | tee "$OUT/versions.txt"
import torch, transformers, grpc
print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0))
print("transformers", transformers.__version__, "grpcio", grpc.__version__)
PY
status=0
echo "== 1. tiny-model exactness and end-to-end tests, target on CUDA"
timeout 300 "$PY" -m pytest -q -x -p no:cacheprovider -m "not real_model" \
  tests/test_target_engine.py tests/test_sampling.py tests/test_backends.py tests/test_e2e_tiny.py \
  tests/test_batching.py -k "not soak" 2>&1 | tee "$OUT/tests.txt" | tail -15 || status=1
echo "== 2. cost curves (random-weight real architectures, bf16)"
timeout 200 "$PY" scripts/gpu_costs.py --out "$OUT" 2>&1 | tail -40 || status=1
echo "== 3. per-round overhead through gRPC"
timeout 120 "$PY" scripts/round_overhead.py --device cuda --out "$OUT" 2>&1 | tail -20 || status=1
echo "== 4. int4 weight-only matmul (tinygemm) against bf16"
timeout 180 "$PY" scripts/gpu_int4.py --out "$OUT" 2>&1 | tail -30 || status=1
exit $status
