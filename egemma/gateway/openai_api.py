"""OpenAI-compatible routes on the gateway: POST /v1/embeddings, GET /v1/models, GET /v1/models/{id}.

POST /v1/embeddings body (unknown fields are a 400, as OpenAI answers them):
  input            str | [str] | [int] | [[int]]   at most 2048 inputs, none an empty string; a flat [int] is one
                   input of at most 2048 ids (OpenAI's schema); ids are this model's tokenizer's ids
  model            the served model's name or a configured alias (absent: the served model); else 404
  dimensions       a Matryoshka size the server allows (768, 512, 256, 128 for EmbeddingGemma)
  encoding_format  "float" (default) | "base64" (little-endian fp32, what the openai client asks for by default)
  user             accepted and ignored
  prompt_name, prompt, truncate, long_text, chunk_overlap   extensions, as the KServe request parameters (text
                   input only for prompts; docs/long-documents.md for long_text)
The body is read by egemma.gateway.protocol, served by egemma.gateway.serving; errors are GatewayErrors, answered in
OpenAI's shape by the gateway's middleware (egemma.gateway.app).
Token ids: BOS is prepended unless the first id is BOS and EOS appended unless the last is EOS, so ids with or
without specials (e.g. from TEI /tokenize) embed exactly as their text; over 2048 tokens they are cut keeping
EOS last, or with truncate=false rejected, or with long_text=chunk windowed as a text is. usage.prompt_tokens
counts what was embedded (prompt, BOS, EOS, every window)."""
from __future__ import annotations

import base64
import time

from aiohttp import web

from egemma.gateway import protocol, serving
from egemma.gateway.admission import read_body
from egemma.gateway.common import GW, json_response

_CREATED = int(time.time())


async def embeddings(request: web.Request) -> web.Response:
    gw = request.app[GW]
    raw = await read_body(request, gw)
    req = protocol.openai_embed(raw, gw)
    emb, ntok = await serving.embed(request.app, req)
    vecs = [base64.b64encode(e.astype("<f4").tobytes()).decode() for e in emb] if req.base64 else emb
    tokens = int(ntok.sum())  # what was embedded: prompt, BOS, EOS, every window
    return json_response({
        "object": "list", "model": gw.model_name,
        "data": [{"object": "embedding", "index": k, "embedding": v} for k, v in enumerate(vecs)],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def _model(gw, name: str, demo: bool) -> dict:
    """OpenAI's Model object; `demo` (ours): true on a generated checkpoint with random weights."""
    return {"id": name, "object": "model", "created": _CREATED, "owned_by": "egemma", "root": gw.model_name,
            "demo": demo}


async def models(request: web.Request) -> web.Response:
    gw, demo = request.app[GW], (await serving.facts(request.app)).cfg.demo
    return json_response({"object": "list", "data": [_model(gw, n, demo) for n in (gw.model_name, *gw.aliases)]})


async def model(request: web.Request) -> web.Response:
    gw, name = request.app[GW], request.match_info["id"]
    protocol.check_model(gw, name)
    return json_response(_model(gw, name, (await serving.facts(request.app)).cfg.demo))


ROUTES = [("POST", "/v1/embeddings", embeddings), ("GET", "/v1/models", models),
          ("GET", r"/v1/models/{id:[\s\S]+}", model)]  # ids hold slashes (google/embeddinggemma-300m), any character
