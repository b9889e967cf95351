#!/usr/bin/env bash
# Everything from scratch, idempotent: .venv with the packages, the tritonserver binary (one on PATH, else
# the one in the nvidia-pytriton wheel with the Python backend stub for this interpreter), a demo checkpoint.
#   PYTHON=python3.12 scripts/setup.sh     to pick the interpreter (3.10 - 3.13; the stub must match it)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
echo "[setup] installing packages into .venv (first run: a few minutes)"
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
# torch 2.13.0 is the tested CPU build; the project itself needs any torch >= 2.4.
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0 -e '.[server,test]'
.venv/bin/python - <<'PY'
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
