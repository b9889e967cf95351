#!/usr/bin/env bash
# Serve EmbeddingGemma: scripts/serve.sh [--model DIR] [--host ADDR] [--http-port N] [--grpc-port N]
#                                          [--metrics-port N] [--param key=value ...]
# Sets up on first use, then runs the server in the foreground (Ctrl-C stops it).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] && .venv/bin/python -c "import egemma, pytriton" 2>/dev/null || scripts/setup.sh
exec .venv/bin/python -m egemma.ops.launcher "$@"
