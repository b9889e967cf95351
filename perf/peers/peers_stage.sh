#!/usr/bin/env bash
# The peers' offline bundle (vLLM 0.26.0 and Infinity 0.0.78 with the packages the GPU host lacks) arrives in parts,
# one per device call (each call carries at most 64 MiB): this appends the parts carried in .gpu/peers/ to
# /tmp/peers/parts (a warm machine keeps /tmp for the next call), and once every part is there checks the sha256,
# unpacks the two site folders and tries the imports each server needs. Prints what is still missing.
#   bash perf/peers/peers_stage.sh        (gpu_run.sh step `peers-stage`; `peers` calls it too)
# Carried: .gpu/peers/peers-bundle.tar.partN (N = 0 .. parts-1) and .gpu/peers/peers-bundle.sha256, whose first
# line is `<sha256>  peers-bundle.tar` and second `parts <count>`. Result: /tmp/peers/vllm and /tmp/peers/infinity,
# each a folder for PYTHONPATH (perf/peers/peers.py puts it there for that server's process only), and /tmp/peers/gateway
# (orjson, which our gateway needs, for a call that carries no .gpu/whl).
set -uo pipefail
cd "$(dirname "$0")/../.."
P=/tmp/peers
mkdir -p "$P/parts"
cp -f .gpu/peers/peers-bundle.tar.part* .gpu/peers/peers-bundle.sha256 "$P/parts/" 2>/dev/null
if [ -f "$P/vllm/.done" ] && [ -f "$P/infinity/.done" ]; then
  echo "peers: unpacked already in $P"
elif [ ! -f "$P/parts/peers-bundle.sha256" ]; then
  echo "peers: no .gpu/peers/peers-bundle.sha256 carried yet (carry it with any part)"
else
  want=$(sed -n 's/^parts //p' "$P/parts/peers-bundle.sha256")
  missing=()
  for i in $(seq 0 $((want - 1))); do [ -f "$P/parts/peers-bundle.tar.part$i" ] || missing+=("part$i"); done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "peers: have $((want - ${#missing[@]})) of $want parts; still to carry: ${missing[*]}"
  else
    for i in $(seq 0 $((want - 1))); do cat "$P/parts/peers-bundle.tar.part$i"; done > "$P/peers-bundle.tar"
    if ! (cd "$P" && head -n1 parts/peers-bundle.sha256 | sha256sum -c --quiet -); then
      echo "peers: sha256 mismatch: the parts are not those of one bundle" >&2
    else
      tar xf "$P/peers-bundle.tar" -C "$P" && rm -f "$P/peers-bundle.tar" "$P"/parts/*.part*
      for name in vllm infinity; do
        mkdir -p "$P/$name" && tar xJf "$P"/"$name"-*-site.tar.xz -C "$P/$name" && touch "$P/$name/.done" \
          && rm -f "$P"/"$name"-*-site.tar.xz
      done
      # orjson alone, for our gateway (the host has its aiohttp and uvloop, not orjson): the same cp312 wheel's files
      mkdir -p "$P/gateway" && cp -r "$P"/infinity/orjson "$P"/infinity/orjson-*.dist-info "$P/gateway/"
      echo "peers: unpacked into $P/vllm, $P/infinity and $P/gateway ($(du -sh "$P" | cut -f1))"
    fi
  fi
fi
# What each server imports at start, in its own PYTHONPATH (never the host's site-packages changed).
[ -f "$P/vllm/.done" ] && PYTHONPATH="$P/vllm" python3 -c '
import importlib, vllm
bad = []
for m in ("vllm.entrypoints.openai.api_server", "vllm.model_executor.models.gemma3", "vllm.v1.engine.core",
          "vllm.v1.worker.gpu_model_runner", "vllm.v1.attention.backends.flash_attn", "vllm._C_stable_libtorch",
          "vllm.vllm_flash_attn._vllm_fa3_C"):
    try:
        importlib.import_module(m)
    except Exception as e:
        bad.append(f"{m}: {type(e).__name__}: {e}")
print(f"peers: vllm {vllm.__version__}:", "imports ok" if not bad else "MISSING\n  " + "\n  ".join(bad))' 2>&1 \
  | grep -v "^INFO\|^WARNING"
[ -f "$P/infinity/.done" ] && PYTHONPATH="$P/infinity" python3 -c '
import infinity_emb, sentence_transformers, transformers
from infinity_emb.infinity_server import create_server  # noqa: F401  (the server and its FastAPI stack)
print(f"peers: infinity {infinity_emb.__version__} (sentence-transformers {sentence_transformers.__version__}, "
      f"transformers {transformers.__version__}): imports ok")' 2>&1 | tail -n 3
true
