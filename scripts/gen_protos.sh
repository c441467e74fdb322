#!/usr/bin/env bash
# Regenerates the Python gRPC code in specdec/v1 from protos/. CI runs this and
# fails when the checked-in code differs.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
rm -f specdec/v1/*_pb2*.py specdec/v1/*_pb2*.pyi
mkdir -p specdec/v1
"$PY" -m grpc_tools.protoc -Iprotos \
  --python_out=. --pyi_out=. --grpc_python_out=. \
  protos/specdec/v1/common.proto protos/specdec/v1/target.proto \
  protos/specdec/v1/draft.proto protos/specdec/v1/orchestrator.proto
printf "\"\"\"Generated gRPC code (scripts/gen_protos.sh). Do not edit.\"\"\"\n" > specdec/v1/__init__.py
