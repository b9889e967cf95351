#!/usr/bin/env bash
# Rebuild the peers' offline bundle (vLLM 0.26.0 and Infinity 0.0.78 with what the GPU host lacks for them) on a box
# with PyPI, into .gpu/peers/ as perf/peers/peers_stage.sh takes it: peers-bundle.tar.partN (N = 0 .. parts-1, 40 MiB
# each at most: a device call carries 64 MiB) and peers-bundle.sha256 (`<sha256>  peers-bundle.tar`, `parts <n>`).
# The tar holds vllm-<ver>-site.tar.xz and infinity-<ver>-site.tar.xz: each a folder of top-level packages, the
# PYTHONPATH of that server's process only (perf/peers/peer_servers.py), over the host's python3 (3.12: torch 2.11.0+cu130,
# triton 3.6, numpy 2.5, transformers 5.17, ...; its package list: the device library's KINDS.md).
#   bash perf/peers/peers_bundle.sh        wheels cached in $PEERS_BUILD (default /tmp/peersbuild): a rerun downloads nothing
# Then carry one part per call (with the .sha256) and run `gpu_run.sh peers-stage` (perf/RESULTS.md, Peers).
set -euo pipefail
cd "$(dirname "$0")/../.."
W="${PEERS_BUILD:-/tmp/peersbuild}" OUT=.gpu/peers PART=$((40 * 1024 * 1024))
VLLM=0.26.0 INFINITY=0.0.78
# the host's interpreter and glibc, whatever this box runs (llguidance 1.7 is manylinux_2_31)
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64
      --platform manylinux_2_31_x86_64)

# vLLM: its wheel (pins torch==2.11.0, the host's) and what its imports need on the embedding serving path (api_server,
# pooling/embed, v1 engine + GPU worker, gemma3, FlashAttention backend, compilation) that the host lacks: found by
# importing every module of that path. httptools: uvicorn's HTTP parser in a standard install (uvicorn[standard]).
VLLM_REQS=("vllm==$VLLM" fastapi==0.136.3 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5
  annotated-types==0.8.0 typing-inspection==0.4.5 uvicorn==0.55.0 httptools==0.9.0 python-multipart==0.0.34
  pyzmq==27.3.0 msgspec==0.23.0 openai==3.63.0 httpx2==2.17.0 sniffio==1.3.1 openai-harmony==0.0.8
  xgrammar==0.2.7 apache-tvm-ffi==0.1.10 llguidance==1.7.6 partial-json-parser==0.2.1.1.post7
  prometheus-fastapi-instrumentator==8.1.0 pybase64==1.5.1 cbor2==6.3.0 cachetools==8.0.2 jmespath==1.1.0
  model-hosting-container-standards==0.1.16 watchfiles==1.3.0)
# Skipped from vLLM's Requires-Dist:
# - the host has them, and its versions must win: torch, torchvision, torchaudio, triton, numpy, numba, transformers,
#   tokenizers, safetensors, huggingface-hub, nvidia-* / cuda-* libraries, aiohttp, anyio, h11, httpx, click, rich,
#   typer, protobuf, prometheus-client, pillow, opencv-python-headless, tiktoken, sentencepiece, psutil, regex, ...
# - imported lazily, off this path (other models, kernels, quantization, multimodal, tools, structured-output
#   backends besides xgrammar/llguidance): flashinfer-python, tilelang, nvidia-cutlass-dsl, quack-kernels,
#   tokenspeed-mla, humming-kernels, cuda-tile, PyNvVideoCodec, torchcodec, mistral_common, compressed-tensors,
#   fastsafetensors, nvidia-cudnn-frontend, kernels, depyf, blake3, lm-format-enforcer, outlines_core, lark, mcp,
#   anthropic, ijson, nvtx, jiter
# - imported in try/except ImportError (optional): opentelemetry-* (tracing off), setproctitle (process titles),
#   websockets, python-dotenv (uvicorn's WebSocket / env file), email-validator, pydantic-extra-types
# And from the wheel's files (414 of its 708 MB unpacked): FA2 (Hopper runs FA3: fa_utils.get_flash_attn_version),
# the MoE and FlashMLA kernels (imports guarded), Blackwell-only third_party/fmha_sm100, the Rust front end (vllm-rs,
# off by default), deep_gemm's builds for Pythons other than 3.12.
VLLM_DROP=(vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/_moe_C_stable_libtorch.abi3.so vllm/_flashmla_C.abi3.so
  vllm/third_party/flashmla vllm/third_party/fmha_sm100 vllm/vllm-rs)

# Infinity: it fails with transformers 5 (batch_encode_plus is gone), so what `pip install
# "infinity-emb[server,torch]==0.0.78"` resolves, pinned as below (fastapi 0.165 needs opentelemetry), plus orjson
# (perf/peers/peers_stage.sh copies it for our gateway) and httptools (its server asks uvicorn for it); not posthog
# (telemetry: off, and imported only where installed). Pinned over the host's versions:
# sentence-transformers, transformers, tokenizers, huggingface_hub, typer, click, rich (infinity's own bounds).
# Not carried: torch, numpy (the host's 2.11 and 2.5; infinity pins numpy<2 but serves on 2.5), and what the host has
# at versions these accept: scikit-learn, scipy, safetensors, requests, pyyaml, tqdm, filelock, fsspec, hf-xet, regex,
# packaging, anyio, h11, pygments, markdown-it-py, shellingham, prometheus-client, uvloop, typing-extensions, ...
INF_REQS=("infinity-emb==$INFINITY" sentence-transformers==3.4.1 transformers==4.57.6 tokenizers==0.22.2
  huggingface_hub==0.36.2 typer==0.12.5 click==8.1.8 rich==13.9.4 uvicorn==0.32.1 httptools==0.9.0
  fastapi==0.136.3 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
  typing-inspection==0.4.5 prometheus-fastapi-instrumentator==8.1.0 orjson==3.13.0)

site() {  # NAME REQ...: the exact pins' wheels (cached), installed with no dependencies into $W/NAME
  local name=$1; shift
  python3 -m pip download -qq --no-deps "${PLAT[@]}" -d "$W/wheels" "$@"
  rm -rf "${W:?}/$name"
  python3 -m pip install -qq --no-deps --no-index --find-links "$W/wheels" --no-compile "${PLAT[@]}" \
    --target "$W/$name" "$@"
  rm -rf "$W/$name/bin"  # console scripts for this box's python: the servers start with `python3 -m`
}
pack() {  # NAME VERSION: $W/pack/NAME-VERSION-site.tar.xz, the same bytes from the same files
  tar -C "$W/$1" --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -cf - . \
    | xz -T0 -9 > "$W/pack/$1-$2-site.tar.xz"
  echo "$1 $2: $(du -sm "$W/$1" | cut -f1) MB unpacked, $(du -m "$W/pack/$1-$2-site.tar.xz" | cut -f1) MB as tar.xz"
}

mkdir -p "$W/wheels" "$W/pack" "$OUT"
site vllm "${VLLM_REQS[@]}"
(cd "$W/vllm" && rm -rf "${VLLM_DROP[@]}" && find vllm/third_party/deep_gemm -name '_C.cpython-3*.so' \
  ! -name '*cpython-312-*' -delete)
site infinity "${INF_REQS[@]}"
pack vllm "$VLLM" & packing=$!
pack infinity "$INFINITY"
wait "$packing"  # its failure stops here too

# Checks: what the servers and peers_stage.sh need is there, the dropped parts are gone.
for f in vllm/vllm/__init__.py vllm/vllm/entrypoints/openai/api_server.py vllm/vllm/_C_stable_libtorch.abi3.so \
    vllm/vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so vllm/fastapi vllm/pydantic_core vllm/zmq vllm/xgrammar \
    infinity/infinity_emb/cli.py infinity/transformers infinity/orjson; do
  [ -e "$W/$f" ] || { echo "peers_bundle: $W/$f missing" >&2; exit 1; }
done
compgen -G "$W/infinity/orjson-*.dist-info" > /dev/null || { echo "peers_bundle: no orjson dist-info" >&2; exit 1; }
for f in "${VLLM_DROP[@]}" torch numpy triton transformers; do
  [ ! -e "$W/vllm/$f" ] || { echo "peers_bundle: $f still in the vllm site" >&2; exit 1; }
done
for f in torch numpy triton; do
  [ ! -e "$W/infinity/$f" ] || { echo "peers_bundle: $f in the infinity site" >&2; exit 1; }
done

# The bundle, cut into parts.
tar -C "$W/pack" --mtime=@0 --owner=0 --group=0 --numeric-owner -cf "$W/peers-bundle.tar" \
  "vllm-$VLLM-site.tar.xz" "infinity-$INFINITY-site.tar.xz"
size=$(stat -c %s "$W/peers-bundle.tar") n=$(( (size + PART - 1) / PART ))
rm -f "$OUT"/peers-bundle.tar.part* "$OUT/peers-bundle.sha256"
for i in $(seq 0 $((n - 1))); do
  dd if="$W/peers-bundle.tar" of="$OUT/peers-bundle.tar.part$i" bs=1M skip=$((i * 40)) count=40 status=none
done
printf '%s  peers-bundle.tar\nparts %d\n' "$(sha256sum < "$W/peers-bundle.tar" | cut -d' ' -f1)" "$n" \
  > "$OUT/peers-bundle.sha256"
[ "$(for i in $(seq 0 $((n - 1))); do cat "$OUT/peers-bundle.tar.part$i"; done | sha256sum | cut -d' ' -f1)" \
  = "$(head -c 64 "$OUT/peers-bundle.sha256")" ] || { echo "peers_bundle: the parts do not add up" >&2; exit 1; }
ls -l "$OUT"
echo "peers_bundle: $n parts, $((size / 1024 / 1024)) MiB in all, in $OUT"
