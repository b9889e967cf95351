"""Hugging Face text-embeddings-inference (TEI) routes on the gateway: POST /embed (and POST /, as TEI serves
an embedding model), POST /embed_all (501), POST /tokenize, GET /info, GET /health, GET /metrics.

Request and response shapes, status codes and the error body {"error": str, "error_type": "Validation" |
"Empty" | "Backend" | "Overloaded" | "Unhealthy"} are TEI's (docs/openapi.json, router/src/http). Where this
server differs from TEI:
- normalize=false is a 422: the embeddings are always L2-normalised (the checkpoint's Normalize module runs in
  the encoder), so unnormalised vectors cannot be given.
- truncation_direction=left is honoured for inputs that need no truncation (left and right give the same ids);
  an input that would have to be cut is a 422 (this server cuts on the right, keeping EOS last).
- extensions: long_text (truncate | error | chunk) and chunk_overlap, as the KServe parameters
  (docs/long-documents.md); with long_text, truncate is not given. Per-window vectors (return_chunks) have no place
  in /embed's bare list of vectors.
- token-id inputs get BOS/EOS added where missing (as the OpenAI route); TEI embeds them without specials.
  prompt_name with token ids is a 422 (TEI decodes and re-tokenises them).
- /tokenize returns the ids the embedding uses (truncated to 2048 unless truncate=false; TEI's are untruncated);
  `text` is the vocabulary piece (e.g. "▁Mars"), not a slice of the input, and start/stop are null.
- /embed_all is a 501: per-token hidden states never leave the encoder's CUDA graph.
- /metrics is Triton's Prometheus text and the gateway's (egemma.gateway.metrics), not TEI's te_* metrics."""
from __future__ import annotations

import asyncio
from importlib import metadata

from aiohttp import web

from egemma.engine.config import EngineConfig  # torch-free: the defaults of the encoder's parameters
from egemma.gateway import calls, protocol, serving
from egemma.gateway import metrics as gateway_metrics
from egemma.gateway.admission import read_body
from egemma.gateway.common import GW, json_response, readiness
from egemma.gateway.errors import GatewayError, Kind
from egemma.gateway.upstream import Upstream
from egemma.spec import ENSEMBLE

_VOCAB = web.AppKey("egemma_vocab", dict)


async def embed(request: web.Request) -> web.Response:
    gw = request.app[GW]
    req = protocol.tei_embed(await read_body(request, gw))
    try:
        emb, _ = await serving.embed(request.app, req)
    except GatewayError as e:
        if req.left and e.kind is Kind.VALIDATION:  # maybe an input that needs cutting
            raise GatewayError(Kind.VALIDATION, f"{e}; truncation_direction=left is honoured only for inputs that "
                                                "need no truncation (this server cuts on the right, keeping EOS "
                                                "last)") from None
        raise
    return json_response(emb)


async def embed_all(request: web.Request) -> web.Response:
    raise GatewayError(Kind.NOT_IMPLEMENTED, "embed_all is not available: the encoder returns pooled, projected "
                                             "embeddings; per-token hidden states never leave its CUDA graph")


async def tokenize(request: web.Request) -> web.Response:
    gw = request.app[GW]
    texts, specials, params = protocol.tei_tokenize(await read_body(request, gw))
    seqs = await calls.tokenize(gw, texts, params)
    vocab = await _vocab(request.app)
    return json_response([[{"id": i, "text": vocab["pieces"][i], "special": i in vocab["special"],
                                "start": None, "stop": None} for i in (s if specials else s[1:-1]).tolist()]
                              for s in seqs])


async def _vocab(app) -> dict:
    """Pieces and special ids of the tokenizer file the tokenizer model loaded (read on first use)."""
    st = app[_VOCAB]
    if "pieces" not in st:
        from tokenizers import Tokenizer
        facts = await serving.facts(app)
        path = facts.tokenizer_json or str(facts.cfg.path / "tokenizer.json")
        tok = await asyncio.to_thread(Tokenizer.from_file, path)
        st["special"] = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
        st["pieces"] = [tok.id_to_token(i) or "" for i in range(tok.get_vocab_size())]
    return st


async def info(request: web.Request) -> web.Response:
    gw = request.app[GW]
    f = await serving.facts(request.app)
    try:
        version = metadata.version("embeddinggemma-triton")
    except metadata.PackageNotFoundError:
        version = "unknown"
    dtype, max_tokens = (f.encoder_params.get("dtype") or EngineConfig.dtype,
                         int(f.encoder_params.get("max_tokens") or EngineConfig.max_tokens))
    return json_response({
        "model_id": gw.model_name, "model_sha": None, "model_dtype": dtype,
        "served_model_name": gw.model_name, "model_type": {"embedding": {"pooling": "mean"}},
        "max_concurrent_requests": 0, "max_input_length": f.cfg.max_seq_length,
        "max_batch_tokens": max_tokens, "max_batch_requests": f.encoder_max_batch,
        "max_client_batch_size": protocol.MAX_INPUTS, "auto_truncate": True,
        "tokenization_workers": f.tokenizer_instances, "version": version, "sha": None, "docker_label": None,
        "demo": f.cfg.demo})  # ours: true on a generated checkpoint with random weights


async def health_route(request: web.Request) -> web.Response:
    """200 (empty) while serving, else 503: the watchdog's verdict when the launcher runs one, else Triton's
    readiness of the ensemble. Also the OpenAI-side /health (vLLM's: 200, empty)."""
    gw = request.app[GW]
    if gw.health_file or gw.draining:
        ok, why = readiness(gw)
    else:
        try:
            ok = await gw.grpc.is_model_ready(ENSEMBLE)
        except Exception as e:  # any failure to ask is a failure to serve
            ok, why = False, f"Triton is not reachable: {e}"
        else:
            why = "the model is not ready"
    if not ok:
        raise GatewayError(Kind.UNHEALTHY, f"unhealthy: {why}")
    return web.Response(status=200)


async def metrics(request: web.Request) -> web.Response:
    """Triton's Prometheus text as it is (nv_inference_*, nv_gpu_*), from its metrics port, then the gateway's
    own metrics (egemma.gateway.metrics)."""
    gw = request.app[GW]
    if not gw.triton_metrics:
        raise GatewayError(Kind.NOT_FOUND, "no metrics here: the gateway was started without --triton-metrics; "
                                           "Triton's are on its metrics port (8002 by default)")
    up = Upstream(gw.triton_metrics)  # a scrape every few seconds at most: no pool to keep
    try:
        status, _, text = await up.request("GET", "/metrics", {}, None)
    except (OSError, asyncio.TimeoutError) as e:
        raise GatewayError(Kind.UNHEALTHY, f"Triton's metrics endpoint is not reachable: {e}") from None
    finally:
        up.close()
    if status == 200:
        text += gateway_metrics.METRICS.render(gw.health_file, readiness(gw)[0]).encode()
    return web.Response(body=text, status=status, content_type="text/plain", charset="utf-8")


ROUTES = [("POST", "/", embed), ("POST", "/embed", embed), ("POST", "/embed_all", embed_all),
          ("POST", "/tokenize", tokenize), ("GET", "/info", info), ("GET", "/health", health_route),
          ("GET", "/metrics", metrics)]


def init(app: web.Application) -> None:
    app[_VOCAB] = {}
