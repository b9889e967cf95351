#!/usr/bin/env bash
# One call on the GPU host: unpack the offline bundles, then run the given steps in order and print short tables.
#   device run, carry [.gpu/...]:  bash perf/gpu_run.sh STEP [STEP ...]
# Steps:
#   deps                 only unpack what was carried (a warm machine keeps it for the next call: FA3 + sgl-kernel
#                        do not fit one transfer beside the server); prints the CPU layout and whether MPS is there
#   tokenizer            egemma/kernels/bpe.c against Hugging Face tokenizers on this host (tests/test_bpe.py, the real
#                        tokenizer if carried), which C compiler builds it, and perf/engine/tokenizer_pieces.py
#   engine               GPU tests, profile, engine benchmark
#   tests                only the GPU tests (tests/test_kernels.py, tests/test_gpu.py)
#   fused                perf/engine/bench_fused.py: the fused gate_up + gelu GEMM against cuBLAS + gelu_and_mul, per size
#   norms                perf/engine/bench_norms.py: the row-wise kernels against a copy of the same bytes, per warp count
#   small                perf/engine/bench_small_batch.py: the layer stack as one kernel (egemma/kernels/layer_stack.py)
#                        against the layered forward for small batches (checked, timed, then its per-phase clock)
#   profile              only perf/engine/profile_engine.py (kernels by group)
#   serve                serving benchmark (perf/serving/bench_serve.py) incl. the sentence-transformers baseline and
#                        the instance-count sweep in $EGEMMA_SWEEP (space-separated MODEL=N,MODEL=N variants);
#                        $EGEMMA_BENCH_ARGS go to bench_serve.py (e.g. "--suite short --skip-baseline --floor");
#                        EGEMMA_MPS=1 runs it with the CUDA MPS daemon
#   spy                  perf/serving/spy_serve.py: py-spy samples of both models' stubs while serving w1 and w2 (carry the
#                        server set and .gpu/py-spy, the static binary from the dev venv)
#   soak-start[=SECS]    start perf/serving/soak_gpu.py (30 s warm-up + 870 s) detached, so it outlives this call
#   soak-wait            wait (up to ~9 min) for the soak to end; its results go to $OUT either way
#   gateway              perf/serving/bench_gateway.py: single texts at c=64 through the gateway's OpenAI route vs gRPC
#                        (perf_analyzer + an aio driver), gateway workers 1/2/4; needs aiohttp + orjson (+ uvloop):
#                        carry .gpu/whl (perf/gpu_bundle.sh) beside the server set; $EGEMMA_GATEWAY_ARGS go to it
#   memory               perf/engine/memory_engine.py: GPU memory of one engine per stage and variant, with replay times;
#                        $EGEMMA_MEMORY_ARGS go to it (e.g. --variant NAME:PYTORCH_CUDA_ALLOC_CONF=...,max_tokens=N)
#   determinism          perf/engine/determinism.py: batch invariance of the engine (deterministic and per-bucket choices), its
#                        cost per workload, and a server's instances sharing one tuning file and one bit pattern;
#                        $EGEMMA_DETERMINISM_ARGS go to it (--serve: the cost end to end; --cache: the Zipf cache bench)
#   front                perf/serving/bench_front.py: one query over HTTP direct to Triton vs through the gateway (p50/p99,
#                        interleaved), and the largest request (64 x 1 MB over gRPC) split per model; carry
#                        .gpu/whl as for `gateway`; $EGEMMA_FRONT_ARGS go to it
#   peers-stage          perf/peers/peers_stage.sh: add the carried part(s) of the peers' bundle (.gpu/peers/, vLLM 0.26.0 +
#                        Infinity 0.0.78 and what the host lacks for them) to /tmp/peers; once all are there, unpack
#                        and check their imports. One part per call, calls back to back (a warm machine keeps /tmp)
#   peers                perf/peers/peers.py: ours (gateway OpenAI route + gRPC), sentence-transformers behind Triton,
#                        Infinity and vLLM on the same texts through one client; $EGEMMA_PEERS_ARGS go to it (e.g.
#                        "--servers infinity,vllm"); runs peers-stage first. Results in $OUT/peers.json + logs
#   corpus               perf/serving/bench_corpus.py: egemma-embed end to end against the server's own saturation (an aio
#                        driver, perf_analyzer) on the same docs (100k docs, lognormal lengths, median ~180
#                        tokens, 32 a request, 16 in flight); needs pyarrow + tqdm on the host and tritonclient's
#                        grpc; $EGEMMA_CORPUS_ARGS go to it (e.g. "--docs 200000", or "--floor": the clients' own
#                        ceilings against do-nothing models)
#   long                 perf/serving/bench_long.py: 16 documents of ~8k tokens embedded whole (long_text=chunk) against
#                        the same windows sent as pre-split texts, docs/s and tokens/s, and the host work of each arm;
#                        $EGEMMA_LONG_ARGS go to it
#   boot                 perf/serving/boot.py: `python -m egemma.ops.launcher` on the full-size checkpoint started cold (empty
#                        --cache-dir) then warm, each instance's boot phases, process start to ready, and the stop
#                        after each (SIGTERM to exit); the launcher runs the gateway, so carry .gpu/whl
#                        as for `gateway`; $EGEMMA_BOOT_ARGS go to it (launcher arguments after --)
# Full logs and JSON go to $OUT. Needs .gpu/ as perf/gpu_bundle.sh assembles it.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/egemma-out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source .gpu/activate.sh
if compgen -G ".gpu/whl/*.whl" > /dev/null; then  # wheels the host lacks (perf/gpu_bundle.sh: orjson for the gateway)
  python3 -m pip install -q --no-index --no-deps --target /tmp/gpu-deps/whl .gpu/whl/*.whl \
    && export PYTHONPATH="/tmp/gpu-deps/whl${PYTHONPATH:+:$PYTHONPATH}"
fi
site="$(python3 -c 'import site; print(site.getsitepackages()[0])')"
echo "$PWD" > "$site/egemma-dev.pth"  # the project importable by python3 and by the stub's venv
nvidia-smi --query-gpu=name,memory.used,clocks.sm,clocks.max.sm --format=csv,noheader
echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo '?') $(date -u +%FT%TZ)"
FULL=/tmp/egemma-full
SOAK=/tmp/egemma-soak
if [ ! -f "$FULL/model.safetensors" ]; then  # real shapes, random weights; the real Gemma tokenizer if carried
  tok=()
  if [ -f .gpu/gemma-tokenizer.txz ]; then
    mkdir -p /tmp/gemma-tok && tar xJf .gpu/gemma-tokenizer.txz -C /tmp/gemma-tok && tok=(--tokenizer-from /tmp/gemma-tok)
  fi
  python3 scripts/make_checkpoint.py "$FULL" --full-size "${tok[@]}" >/dev/null
fi
for step in "$@"; do
  echo "== $step $(date -u +%T)"
  case "$step" in
    deps) lscpu | grep -E "^(Model name|CPU\(s\)|Thread|Core|Socket)"; command -v nvidia-cuda-mps-control ;;
    tokenizer)
      command -v cc gcc
      EMBEDDINGGEMMA_PATH="$FULL" python3 -m pytest -q -rs -p no:cacheprovider tests/test_bpe.py 2>&1 \
        | tee "$OUT/bpe_tests.log" | tail -n 8
      (python3 -m perf.engine.tokenizer_pieces "$FULL" 2>&1 | grep -v "^\[transformers\]" | tee "$OUT/tokenizer_pieces.log") ;;
    engine)
      EGEMMA_FULL_CHECKPOINT="$FULL" python3 -m pytest -q -rs -p no:cacheprovider tests/test_kernels.py tests/test_gpu.py \
        2>&1 | tee "$OUT/gpu_tests.log" | tail -n 25
      python3 -m perf.engine.profile_engine "$FULL" --trace-dir "$OUT" > "$OUT/profile_engine.log" 2>&1; grep -A3 "^== " "$OUT/profile_engine.log" | cut -c1-260
      python3 -m perf.engine.bench_engine "$FULL" --out "$OUT/bench_engine.json" 2>&1 | tee "$OUT/bench_engine.log" \
        | grep -v "^\s*$" | tail -n 12 ;;
    tests)
      EGEMMA_FULL_CHECKPOINT="$FULL" python3 -m pytest -q -rs -p no:cacheprovider tests/test_kernels.py tests/test_gpu.py \
        2>&1 | tee "$OUT/gpu_tests.log" | tail -n 25 ;;
    fused) python3 -m perf.engine.bench_fused 2>&1 | tee "$OUT/bench_fused.log" ;;
    norms) python3 -m perf.engine.bench_norms 2>&1 | tee "$OUT/bench_norms.log" ;;
    small) python3 -m perf.engine.bench_small_batch "$FULL" 2>&1 | tee "$OUT/bench_small_batch.log" ;;
    profile)
      python3 -m perf.engine.profile_engine "$FULL" --trace-dir "$OUT" > "$OUT/profile_engine.log" 2>&1; grep -A3 "^== " "$OUT/profile_engine.log" | cut -c1-260 ;;
    serve)
      # EGEMMA_MPS=1: the encoder processes share the GPU through CUDA MPS (a user daemon; the GPU's settings
      # are untouched) instead of time-slicing it; the daemon is stopped again after the benchmark.
      [ -n "${EGEMMA_MPS:-}" ] && { nvidia-cuda-mps-control -d && echo "MPS daemon started" || echo "no MPS"; }
      # shellcheck disable=SC2086  # the sweep variants are meant to split on spaces
      python3 -m perf.serving.bench_serve "$FULL" --out /tmp/serve ${EGEMMA_BENCH_ARGS:-} --sweep ${EGEMMA_SWEEP:-} 2>&1 | tee "$OUT/bench_serve.log" \
        | grep -v "^\[transformers\]" | tail -n 40
      [ -n "${EGEMMA_MPS:-}" ] && echo quit | nvidia-cuda-mps-control
      cp /tmp/serve/results.json /tmp/serve/serve_w3.png "$OUT/" 2>/dev/null
      tar czf "$OUT/serve.tgz" -C /tmp/serve . ;;
    spy)
      (python3 -m perf.serving.spy_serve "$FULL" --out "$OUT/spy" --py-spy "$PWD/.gpu/py-spy" 2>&1 \
        | grep -v "^\[transformers\]" | tee "$OUT/spy.log" | tail -n 140) ;;
    soak-start*)
      secs="${step#soak-start}"; secs="${secs#=}"
      mkdir -p "$SOAK"
      setsid nohup python3 -m perf.serving.soak_gpu "$FULL" --seconds "${secs:-870}" --warmup 30 --out "$SOAK" > "$SOAK/log" 2>&1 < /dev/null &
      echo "soak started (pid $!), log in $SOAK/log" ;;
    soak-wait)
      for _ in $(seq 108); do [ -f "$SOAK/soak.json" ] && break; sleep 5; done
      tail -n 8 "$SOAK/log"
      cp "$SOAK/log" "$OUT/soak.log" 2>/dev/null
      [ -f "$SOAK/soak.json" ] && cp "$SOAK/soak.json" "$OUT/" && tar czf "$OUT/soak.tgz" -C "$SOAK" . ;;
    gateway)
      if python3 -c "import aiohttp, orjson" 2>/dev/null; then
        # shellcheck disable=SC2086  # the extra arguments are meant to split on spaces
        python3 -m perf.serving.bench_gateway "$FULL" --out /tmp/gateway ${EGEMMA_GATEWAY_ARGS:-} 2>&1 \
          | tee "$OUT/bench_gateway.log" | grep -v "^\[transformers\]" | tail -n 14
        cp /tmp/gateway/results.json "$OUT/gateway.json" 2>/dev/null
      else
        echo "gateway: no aiohttp/orjson on this host: carry .gpu/whl (perf/gpu_bundle.sh)"
      fi ;;
    memory)
      # shellcheck disable=SC2086  # the extra arguments are meant to split on spaces
      python3 -m perf.engine.memory_engine "$FULL" --out "$OUT/memory.json" ${EGEMMA_MEMORY_ARGS:-} 2>&1 \
        | tee -a "$OUT/memory.log" | tail -n 12 ;;
    front)
      # shellcheck disable=SC2086  # the extra arguments are meant to split on spaces
      python3 -m perf.serving.bench_front "$FULL" --out /tmp/front ${EGEMMA_FRONT_ARGS:-} 2>&1 | tee "$OUT/bench_front.log" \
        | grep -v "^\[transformers\]" | tail -n 12
      cp /tmp/front/front.json /tmp/front/server.log "$OUT/" 2>/dev/null
      grep -h "CUDA graphs captured" /tmp/front/server.log | cut -c1-300 ;;
    determinism)
      # shellcheck disable=SC2086  # the extra arguments are meant to split on spaces
      python3 -m perf.engine.determinism "$FULL" --out "$OUT/determinism.json" ${EGEMMA_DETERMINISM_ARGS:-} 2>&1 | grep -v "^\[transformers\]" \
        | tee "$OUT/determinism.log" | grep -v "^I1\|^W1\|^E1" | tail -n 20 ;;
    peers-stage) bash perf/peers/peers_stage.sh ;;
    peers)
      bash perf/peers/peers_stage.sh
      # shellcheck disable=SC2086  # the extra arguments are meant to split on spaces
      (python3 -m perf.peers.peers "$FULL" --out /tmp/peers-out --results "$OUT/peers.json" ${EGEMMA_PEERS_ARGS:-} 2>&1 \
        | tee "$OUT/peers.log" \
        | grep -v "^\[transformers\]" | grep -E "^(workloads|[a-z-]+: (ready|FAILED|[0-9]+ s)|\|)" | cut -c1-400)
      tar czf "$OUT/peers-logs.tgz" -C /tmp/peers-out --exclude ours-run . 2>/dev/null ;;
    corpus)
      # shellcheck disable=SC2086  # the extra arguments are meant to split on spaces
      python3 -m perf.serving.bench_corpus "$FULL" --out /tmp/corpus ${EGEMMA_CORPUS_ARGS:-} 2>&1 | tee "$OUT/bench_corpus.log" \
        | grep -v "^\[transformers\]" | tail -n 12
      cp /tmp/corpus/corpus.json /tmp/corpus/cli.log "$OUT/" 2>/dev/null ;;
    long)
      # shellcheck disable=SC2086  # the extra arguments are meant to split on spaces
      python3 -m perf.serving.bench_long "$FULL" --out "$OUT/long.json" ${EGEMMA_LONG_ARGS:-} 2>&1 | tee "$OUT/bench_long.log" \
        | grep -v "^\[transformers\]" | tail -n 8 ;;
    boot)
      # shellcheck disable=SC2086  # the extra arguments are meant to split on spaces
      python3 -m perf.serving.boot "$FULL" --out "$OUT/boot.json" ${EGEMMA_BOOT_ARGS:-} 2>&1 | tee "$OUT/boot.log" \
        | grep -v "^\[transformers\]" | tail -n 30 ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
