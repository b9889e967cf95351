#!/usr/bin/env bash
# The test command: sets everything up from scratch (scripts/setup.sh), then runs the CPU test suite
# against the real tritonserver. Extra arguments go to pytest. With EMBEDDINGGEMMA_PATH set, the real
# checkpoint's parity tests run too.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m pytest -q -rs "$@"
