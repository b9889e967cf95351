#!/usr/bin/env bash
# One call on the GPU host: unpack the offline bundles, run the GPU tests, benchmark, print a short table.
#   device run, carry [.gpu/...]:  bash perf/gpu_run.sh [engine|serve|all]
# Full logs and JSON go to $OUT. Needs .gpu/activate.sh and the archives named in perf/README.md.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/egemma-out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source .gpu/activate.sh
site="$(python3 -c 'import site; print(site.getsitepackages()[0])')"
echo "$PWD" > "$site/egemma-dev.pth"  # the project importable by python3 and by the stub's venv
nvidia-smi --query-gpu=name,memory.used,clocks.sm,clocks.max.sm --format=csv,noheader
echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo '?') $(date -u +%FT%TZ)"
mode="${1:-engine}"
FULL=/tmp/egemma-full
if [ ! -f "$FULL/model.safetensors" ]; then  # real shapes, random weights; the real Gemma tokenizer if carried
  tok=()
  if [ -f .gpu/gemma-tokenizer.txz ]; then
    mkdir -p /tmp/gemma-tok && tar xJf .gpu/gemma-tokenizer.txz -C /tmp/gemma-tok && tok=(--tokenizer-from /tmp/gemma-tok)
  fi
  python3 scripts/make_checkpoint.py "$FULL" --full-size "${tok[@]}" >/dev/null
fi
if [ "$mode" = engine ] || [ "$mode" = all ]; then
  EGEMMA_FULL_CHECKPOINT="$FULL" python3 -m pytest -q -rs -p no:cacheprovider tests/test_kernels.py tests/test_gpu.py \
    2>&1 | tee "$OUT/gpu_tests.log" | tail -n 25
  python3 perf/profile_engine.py "$FULL" > "$OUT/profile_engine.log" 2>&1; grep -A3 "^== " "$OUT/profile_engine.log" | cut -c1-150
  python3 perf/bench_engine.py "$FULL" --out "$OUT/bench_engine.json" 2>&1 | tee "$OUT/bench_engine.log" \
    | grep -v "^\s*$" | tail -n 12
fi
if [ "$mode" = serve ] || [ "$mode" = all ]; then
  "$TRITON_STUB_PATH/python3" -c "import sentence_transformers" 2>&1 | tail -n 3 | sed 's/^/stub env: /'
  python3 perf/bench_serve.py "$FULL" --out /tmp/serve 2>&1 | tee "$OUT/bench_serve.log" | tail -n 30
  cp /tmp/serve/results.json /tmp/serve/serve_w3.png "$OUT/" 2>/dev/null
  tar czf "$OUT/serve.tgz" -C /tmp/serve .
fi
