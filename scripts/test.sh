#!/usr/bin/env bash
# The test suite from nothing: set-up, generated-code check, the layering
# contract, then pytest
# (unit, tiny-model gRPC end-to-end, and the real-model end-to-end test).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/check_protos.sh
bash scripts/check_docker.sh
bash scripts/check_k8s.sh
.venv/bin/lint-imports --no-cache --no-logo  # one-way layers (pyproject.toml [tool.importlinter])
.venv/bin/python -m pytest -q -rs "$@"
