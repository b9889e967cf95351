#!/usr/bin/env bash
# Assemble .gpu/ (ignored, never committed) for a device call of perf/gpu_run.sh: the serve set from ../shared/gpu/
# (Triton 2.51, the numpy-1.26 stub env, tritonclient + perf_analyzer, sgl-kernel: 53.4 MB, FA3 does not fit beside
# it), the real Gemma tokenizer's files (3.5 MB) and the wheels the host lacks (orjson, for the gateway).
#   bash perf/gpu_bundle.sh [CHECKPOINT]    (default ~/.cache/embeddinggemma-300m; fetched there when missing)
# Then: device run, carry [".gpu"]: bash perf/gpu_run.sh STEP ...   The peers' bundle is perf/peers/peers_bundle.sh's.
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED=../shared
CKPT="${1:-$HOME/.cache/embeddinggemma-300m}"
mkdir -p .gpu/whl
cp -f "$SHARED"/gpu/activate.sh "$SHARED"/gpu/triton-server-2.51.tar.xz "$SHARED"/gpu/numpy-1.26-stub.tar.xz \
  "$SHARED"/gpu/triton-client.tar.xz "$SHARED"/gpu/sgl-kernel-0.4.5-cu130-torch2.11.tar.xz .gpu/
[ -f "$CKPT/tokenizer.json" ] || bash "$SHARED/models/fetch-embeddinggemma.sh" "$CKPT"
tar cJf .gpu/gemma-tokenizer.txz -C "$CKPT" tokenizer.json tokenizer_config.json special_tokens_map.json
pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux_2_17_x86_64 -d .gpu/whl "orjson==3.13.0"
du -sh .gpu; du -ch .gpu/*.* .gpu/whl | tail -n 1
