#!/usr/bin/env bash
# Everything from scratch, idempotent: .venv with the packages, the tritonserver binary (one on PATH, else
# the one in the nvidia-pytriton wheel with the Python backend stub for this interpreter), a demo checkpoint.
#   PYTHON=python3.12 scripts/setup.sh     to pick the interpreter (3.10 - 3.13; the stub must match it)
#   scripts/setup.sh --system              (or EGEMMA_SETUP=system) the same install into $PYTHON itself, no
#                                          venv: the container image's step (deploy/Dockerfile)
#   EGEMMA_TORCH=torch==2.11.0 EGEMMA_EXTRAS=server,gpu scripts/setup.sh --system
#                                          what to install (defaults: torch==2.13.0, the tested CPU build, and
#                                          the extras server,test)
set -euo pipefail
cd "$(dirname "$0")/.."
MODE="${EGEMMA_SETUP:-venv}"
[ "${1:-}" = "--system" ] && MODE=system
PY="${PYTHON:-python3}"
case "$MODE" in
  venv)
    if [ ! -x .venv/bin/python ]; then
      echo "[setup] creating .venv with $($PY --version)"
      "$PY" -m venv .venv
    fi
    PY=.venv/bin/python
    "$PY" -m pip install -q --disable-pip-version-check --upgrade pip ;;
  system) ;;
  *) echo "[setup] unknown mode '$MODE' (EGEMMA_SETUP=venv or system)" >&2; exit 2 ;;
esac
echo "[setup] installing packages into $("$PY" -c 'import sys; print(sys.prefix)') (first run: a few minutes)"
# The project itself needs any torch >= 2.4; the image pins the CUDA build its kernel wheels are built for.
"$PY" -m pip install -q --disable-pip-version-check "${EGEMMA_TORCH:-torch==2.13.0}" \
  -e ".[${EGEMMA_EXTRAS:-server,test}]"
"$PY" - <<'PY'
from egemma.ops.repository import DEMO, ROOT
from egemma.ops.tritonserver import find_tritonserver
import subprocess, sys
binary, backends = find_tritonserver()
print(f"[setup] tritonserver: {binary}\n[setup] backends:     {backends}")
if not (DEMO / "model.safetensors").exists():
    subprocess.run([sys.executable, str(ROOT / "scripts/make_checkpoint.py"), str(DEMO)], check=True,
                   stdout=subprocess.DEVNULL)
print(f"[setup] demo checkpoint (random weights): {DEMO}")
PY
echo "[setup] done"
