#!/usr/bin/env bash
# The test suite from nothing: set-up, generated-code check, then pytest
# (unit, tiny-model gRPC end-to-end, and the real-model end-to-end test).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/check_protos.sh
.venv/bin/python -m pytest -q -rs "$@"
