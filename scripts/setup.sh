#!/usr/bin/env bash
# Everything from scratch, idempotent: .venv with the packages, the tritonserver binary (one on PATH, else
# the one in the nvidia-pytriton wheel with the Python backend stub for this interpreter), a demo checkpoint.
#   PYTHON=python3.12 scripts/setup.sh     to pick the interpreter (3.10 - 3.13; the stub must match it)
#   scripts/setup.sh --system              (or EGEMMA_SETUP=system) the same install into $PYTHON itself, no
#                                          venv: the container image's step (deploy/Dockerfile)
#   EGEMMA_TORCH=torch==2.11.0 EGEMMA_EXTRAS=client,gpu scripts/setup.sh --system
#                                          what to install (defaults: torch==2.13.0, the tested CPU build, and
#                                          the extras server,test; --system: client, for an image that has its
#                                          own tritonserver)
# The venv mode also installs checkov into .cache/checkov-venv (the manifest tests' scanner). As root with apt-get
# (CI), it also installs kubectl (Debian's kubernetes-client) when none is on
# PATH: the manifest tests render deploy/ with `kubectl kustomize`; and Debian's prometheus (with promtool) when no
# promtool is: the observability tests run it.
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
    EXTRAS="${EGEMMA_EXTRAS:-server,test}"
    "$PY" -m pip install -q --disable-pip-version-check --upgrade pip ;;
  system) EXTRAS="${EGEMMA_EXTRAS:-client}" ;;
  *) echo "[setup] unknown mode '$MODE' (EGEMMA_SETUP=venv or system)" >&2; exit 2 ;;
esac
echo "[setup] installing packages into $("$PY" -c 'import sys; print(sys.prefix)') (first run: a few minutes)"
# The project itself needs any torch >= 2.4; the image pins the CUDA build its kernel wheels are built for.
"$PY" -m pip install -q --disable-pip-version-check "${EGEMMA_TORCH:-torch==2.13.0}" \
  -e ".[${EXTRAS}]"
"$PY" - <<'PY'
from egemma.ops.repository import demo_checkpoint
from egemma.ops.tritonserver import find_tritonserver
binary, backends = find_tritonserver()
print(f"[setup] tritonserver: {binary}\n[setup] backends:     {backends}")
print(f"[setup] demo checkpoint (random weights): {demo_checkpoint()}")
PY
# checkov, the manifest tests' security scanner, in a venv of its own: its pins clash with the test environment's.
CHECKOV=checkov==3.3.30
if [ "$MODE" = venv ] && [ ! -x .cache/checkov-venv/bin/checkov ]; then
  echo "[setup] installing $CHECKOV into .cache/checkov-venv for the manifest tests (first run: a few minutes)"
  "$PY" -m venv .cache/checkov-venv
  .cache/checkov-venv/bin/python -m pip install -q --disable-pip-version-check "$CHECKOV"
fi
# Debian's prometheus (2.42, with promtool): tests/test_observability.py runs the rules and the dashboard against it.
if [ "$MODE" = venv ] && ! command -v promtool >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "[setup] installing Debian's prometheus (and promtool) for the observability tests"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        prometheus >/dev/null; } \
      || echo "[setup] WARNING: prometheus did not install: tests/test_observability.py will fail" >&2
  else
    echo "[setup] NOTE: no promtool on PATH: tests/test_observability.py needs Debian's prometheus package" \
         "(apt-get install prometheus); it skips without it, and fails under CI=true" >&2
  fi
fi
if [ "$MODE" = venv ] && ! command -v kubectl >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "[setup] installing kubectl (Debian's kubernetes-client) for the manifest tests"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        kubernetes-client >/dev/null; } \
      || echo "[setup] WARNING: kubernetes-client did not install: tests/test_deploy_manifests.py will fail" >&2
  else
    echo "[setup] NOTE: no kubectl on PATH: tests/test_deploy_manifests.py needs one (Debian:" \
         "apt-get install kubernetes-client); they skip without it, and fail under CI=true" >&2
  fi
fi
echo "[setup] done"
