#!/usr/bin/env bash
# Serve EmbeddingGemma: scripts/serve.sh [--model DIR] [FLAG ...]; scripts/serve.sh --help lists the flags
# (docs/configuration.md). Sets up on first use, then runs the server in the foreground (Ctrl-C stops it).
set -euo pipefail
export EGEMMA_PROG="${EGEMMA_PROG:-$0}"  # --help speaks as the command typed
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] && .venv/bin/python -c "import egemma, pytriton" 2>/dev/null || scripts/setup.sh
exec .venv/bin/python -m egemma.ops.launcher "$@"
