#!/usr/bin/env bash
# Fails when specdec/v1 is not what scripts/gen_protos.sh generates from protos/.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
cp -r specdec/v1 "$tmp/v1"
PYTHON=.venv/bin/python bash scripts/gen_protos.sh
if ! diff -r -x __pycache__ "$tmp/v1" specdec/v1 >/dev/null; then
  diff -r -x __pycache__ "$tmp/v1" specdec/v1 | head -20
  rm -rf specdec/v1 && cp -r "$tmp/v1" specdec/v1
  echo "generated code in specdec/v1 is stale: run scripts/gen_protos.sh and commit" >&2
  exit 1
fi
echo "[protos] generated code is current"
