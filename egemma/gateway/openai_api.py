"""OpenAI-compatible routes on the gateway: POST /v1/embeddings, GET /v1/models, GET /v1/models/{id}.

POST /v1/embeddings body (unknown fields are a 400, as OpenAI answers them):
  input            str | [str] | [int] | [[int]]   at most 2048 inputs; ids are this model's tokenizer's ids
  model            the served model's name or a configured alias (absent: the served model); else 404
  dimensions       a Matryoshka size the server allows (768, 512, 256, 128 for EmbeddingGemma)
  encoding_format  "float" (default) | "base64" (little-endian fp32, what the openai client asks for by default)
  user             accepted and ignored
  prompt_name, prompt, truncate   extensions, as the KServe request parameters (text input only for prompts)
Token ids: BOS is prepended unless the first id is BOS and EOS appended unless the last is EOS, so ids with or
without specials (e.g. from TEI /tokenize) embed exactly as their text; over 2048 tokens they are cut keeping
EOS last, or with truncate=false rejected. usage.prompt_tokens counts what was embedded (prompt, BOS, EOS)."""
from __future__ import annotations

import base64
import logging
import time

import numpy as np
import orjson
from aiohttp import web

from egemma.gateway import calls
from egemma.gateway.guard import Rejected, read_body

FIELDS = {"input", "model", "dimensions", "encoding_format", "user", "prompt_name", "prompt", "truncate"}
_CREATED = int(time.time())
log = logging.getLogger("egemma")


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


def json_response(obj, status: int = 200) -> web.Response:
    """orjson: fp32 arrays as their shortest round-trip decimals, ~15x faster than json with float lists."""
    return web.Response(body=orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY), status=status,
                        content_type="application/json")


def error_response(status: int, message: str, param=None, code=None) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return json_response({"error": {"message": message, "type": kind, "param": param, "code": code}}, status)


_BACKEND_STATUS = {"invalid": 400, "unavailable": 503, "overloaded": 429, "internal": 502}


async def read_json(request: web.Request, error) -> dict:
    """The body as a JSON object, or `error(status, message)` raised: 413 over the gateway's body limit
    (checked on Content-Length before reading, as the KServe routes do)."""
    try:
        body = orjson.loads(await read_body(request, request.app["gw"]))
    except Rejected as e:
        raise error(e.status, str(e)) from None
    except orjson.JSONDecodeError as e:
        raise error(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise error(400, "the body must be a JSON object")
    return body


def check_model(gw, name) -> None:
    if name is not None and not isinstance(name, str):
        raise OpenAIError(400, f"model must be a string, got {name!r}", "model")
    if name is not None and name != gw.model_name and name not in gw.aliases:
        raise OpenAIError(404, f"The model `{name}` does not exist; this server serves `{gw.model_name}`"
                               + (f" (aliases: {', '.join(gw.aliases)})" if gw.aliases else ""), "model",
                          "model_not_found")


def parse_input(x) -> tuple[str, list]:
    """("text", [str]) or ("ids", [[int]])."""
    if isinstance(x, str):
        return "text", [x]
    if not isinstance(x, list) or not x:
        raise OpenAIError(400, "input must be a string, a list of strings, a list of token ids or a list of "
                               "lists of token ids, and not empty", "input")
    if len(x) > calls.MAX_INPUTS:
        raise OpenAIError(400, f"input has {len(x)} items, over the limit of {calls.MAX_INPUTS}", "input")
    if all(isinstance(t, str) for t in x):
        return "text", x
    if all(type(t) is int for t in x):
        x = [x]
    if not all(isinstance(r, list) and r and all(type(t) is int for t in r) for r in x):
        raise OpenAIError(400, "input must be all strings or all token id lists (non-empty lists of integers)",
                          "input")
    return "ids", x


async def embeddings(request: web.Request) -> web.Response:
    gw = request.app["gw"]
    try:
        body = await read_json(request, OpenAIError)
        unknown = sorted(set(body) - FIELDS)
        if unknown:
            raise OpenAIError(400, f"Unrecognized request argument supplied: {', '.join(unknown)}", unknown[0])
        check_model(gw, body.get("model"))
        fmt = body.get("encoding_format") or "float"
        if fmt not in ("float", "base64"):
            raise OpenAIError(400, f"encoding_format must be 'float' or 'base64', got {fmt!r}", "encoding_format")
        dims = body.get("dimensions")
        if dims is not None and type(dims) is not int:
            raise OpenAIError(400, f"dimensions must be an integer, got {dims!r}", "dimensions")
        kind, items = parse_input(body.get("input"))
        params = {k: body[k] for k in ("dimensions", "prompt_name", "prompt", "truncate") if body.get(k) is not None}
        if kind == "text":
            emb, ntok = await calls.embed_texts(gw, items, params)
        else:
            emb, ntok = await _embed_ids(request.app, items, params)
    except OpenAIError as e:
        return error_response(e.status, str(e), e.param, e.code)
    except calls.BackendError as e:
        return error_response(_BACKEND_STATUS[e.kind], str(e))
    except Exception as e:  # a bug of ours: logged, and still an answer in OpenAI's shape
        log.exception("openai /v1/embeddings")
        return error_response(500, f"internal error: {type(e).__name__}: {e}")
    vecs = [base64.b64encode(e.astype("<f4").tobytes()).decode() for e in emb] if fmt == "base64" else emb
    tokens = int(ntok.sum())
    return json_response({
        "object": "list", "model": gw.model_name,
        "data": [{"object": "embedding", "index": k, "embedding": v} for k, v in enumerate(vecs)],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


async def _embed_ids(app, rows: list[list[int]], params: dict) -> tuple[np.ndarray, np.ndarray]:
    for k in ("prompt_name", "prompt"):
        if k in params:
            raise OpenAIError(400, f"{k} applies to text input; with token ids, put the prompt's ids first", k)
    facts = await calls.facts(app)
    truncate = params.pop("truncate", True)
    if type(truncate) is not bool:
        raise OpenAIError(400, f"truncate must be true or false, got {truncate!r}", "truncate")
    try:
        seqs = calls.complete_ids(rows, facts, truncate)
    except ValueError as e:
        raise OpenAIError(400, str(e), "input") from None
    return await calls.embed_ids(app["gw"], seqs, params), np.array([len(s) for s in seqs])


def _model(gw, name: str) -> dict:
    return {"id": name, "object": "model", "created": _CREATED, "owned_by": "egemma", "root": gw.model_name}


async def models(request: web.Request) -> web.Response:
    gw = request.app["gw"]
    return json_response({"object": "list", "data": [_model(gw, n) for n in (gw.model_name, *gw.aliases)]})


async def model(request: web.Request) -> web.Response:
    gw, name = request.app["gw"], request.match_info["id"]
    try:
        check_model(gw, name)
    except OpenAIError as e:
        return error_response(e.status, str(e), e.param, e.code)
    return json_response(_model(gw, name))


def add_routes(app: web.Application) -> None:
    calls.init(app)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{id:.+}", model)  # ids such as google/embeddinggemma-300m hold a slash
