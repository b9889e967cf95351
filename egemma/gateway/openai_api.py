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
Errors are GatewayErrors, answered in OpenAI's shape by the gateway's middleware (egemma.gateway.app).
Token ids: BOS is prepended unless the first id is BOS and EOS appended unless the last is EOS, so ids with or
without specials (e.g. from TEI /tokenize) embed exactly as their text; over 2048 tokens they are cut keeping
EOS last, or with truncate=false rejected, or with long_text=chunk windowed as a text is. usage.prompt_tokens
counts what was embedded (prompt, BOS, EOS, every window)."""
from __future__ import annotations

import base64
import time

from aiohttp import web

from egemma.gateway import calls
from egemma.gateway.common import GW, choice, json_response, options, read_json
from egemma.gateway.errors import GatewayError, Kind

FIELDS = {"input", "model", "dimensions", "encoding_format", "user", "prompt_name", "prompt", "truncate", "long_text",
          "chunk_overlap"}
_CREATED = int(time.time())


def check_model(gw, name) -> None:
    if name is not None and not isinstance(name, str):
        raise GatewayError(Kind.VALIDATION, f"model must be a string, got {name!r}", "model")
    if name is not None and name != gw.model_name and name not in gw.aliases:
        raise GatewayError(Kind.NOT_FOUND, f"The model `{name}` does not exist; this server serves `{gw.model_name}`"
                                           + (f" (aliases: {', '.join(gw.aliases)})" if gw.aliases else ""), "model",
                           "model_not_found")


def parse_input(x) -> tuple[str, list]:
    """("text", [str]) or ("ids", [[int]]), by OpenAI's schema: a string, or at most 2048 strings, or one list of
    at most 2048 token ids (one input), or at most 2048 lists of token ids (each of any length: over 2048 tokens
    cut, as text is)."""
    what = ("input must be a string, a list of strings, a list of token ids or a list of lists of token ids, "
            "and not empty")
    if isinstance(x, str):
        x = [x]
    if not isinstance(x, list) or not x:
        raise GatewayError(Kind.VALIDATION, what, "input")
    if all(isinstance(t, str) for t in x):
        kind, rows = "text", x
    elif all(type(t) is int for t in x):
        if len(x) > calls.MAX_INPUTS:
            raise GatewayError(Kind.VALIDATION, f"input is one list of {len(x)} token ids, over the limit of "
                                                f"{calls.MAX_INPUTS} for a flat list of ids (OpenAI's schema); send "
                                                "a longer input as a list of one token-id list, cut to 2048 tokens "
                                                "unless truncate is false", "input")
        kind, rows = "ids", [x]
    elif all(isinstance(r, list) and r and all(type(t) is int for t in r) for r in x):
        kind, rows = "ids", x
    else:
        raise GatewayError(Kind.VALIDATION, "input must be all strings or all token id lists (non-empty lists of "
                                            "integers)", "input")
    if len(rows) > calls.MAX_INPUTS:
        raise GatewayError(Kind.VALIDATION, f"input has {len(rows)} inputs, over the limit of {calls.MAX_INPUTS} "
                                            "inputs per request", "input")
    if kind == "text" and "" in rows:
        raise GatewayError(Kind.EMPTY, f"input[{rows.index('')}] is an empty string, which cannot be embedded",
                           "input")
    return kind, rows


async def embeddings(request: web.Request) -> web.Response:
    gw = request.app[GW]
    body = await read_json(request)
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise GatewayError(Kind.VALIDATION, f"Unrecognized request argument supplied: {', '.join(unknown)}",
                           unknown[0])
    check_model(gw, body.get("model"))
    fmt = choice(body, "encoding_format", ("float", "base64"), "float")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise GatewayError(Kind.VALIDATION, f"user must be a string, got {body['user']!r}", "user")
    params = options(body, ("dimensions", "prompt_name", "prompt", "truncate", "long_text", "chunk_overlap"))
    kind, items = parse_input(body.get("input"))
    if kind == "ids" and (prompt := next((k for k in ("prompt_name", "prompt") if k in params), None)):
        raise GatewayError(Kind.VALIDATION, f"{prompt} applies to text input; with token ids, put the prompt's ids "
                                            "first", prompt)
    emb, ntok = await (calls.embed_texts(gw, items, params) if kind == "text" else
                       calls.embed_id_lists(request.app, items, params, "input"))
    vecs = [base64.b64encode(e.astype("<f4").tobytes()).decode() for e in emb] if fmt == "base64" else emb
    tokens = int(ntok.sum())
    return json_response({
        "object": "list", "model": gw.model_name,
        "data": [{"object": "embedding", "index": k, "embedding": v} for k, v in enumerate(vecs)],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def _model(gw, name: str, demo: bool) -> dict:
    """OpenAI's Model object; `demo` (ours): true on a generated checkpoint with random weights."""
    return {"id": name, "object": "model", "created": _CREATED, "owned_by": "egemma", "root": gw.model_name,
            "demo": demo}


async def models(request: web.Request) -> web.Response:
    gw, demo = request.app[GW], (await calls.facts(request.app)).cfg.demo
    return json_response({"object": "list", "data": [_model(gw, n, demo) for n in (gw.model_name, *gw.aliases)]})


async def model(request: web.Request) -> web.Response:
    gw, name = request.app[GW], request.match_info["id"]
    check_model(gw, name)
    return json_response(_model(gw, name, (await calls.facts(request.app)).cfg.demo))


ROUTES = [("POST", "/v1/embeddings", embeddings), ("GET", "/v1/models", models),
          ("GET", r"/v1/models/{id:[\s\S]+}", model)]  # ids hold slashes (google/embeddinggemma-300m), any character
