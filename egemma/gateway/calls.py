"""The Triton calls behind the gateway's OpenAI and TEI routes, over its one shared aio gRPC client: texts through
the ensemble, token ids straight to the encoder, texts through the tokenizer model; and the served model's facts
(special ids, lengths, instance counts), read once from the configs and checkpoint the models themselves load."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np
import tritonclient.grpc as grpcclient
from aiohttp import web
from tritonclient.utils import InferenceServerException

from egemma.engine.ids import complete
from egemma.gateway import retry
from egemma.gateway.common import GW
from egemma.gateway.errors import GatewayError, Kind
from egemma.spec import (EMBEDDING, ENCODER, ENSEMBLE, INPUT_IDS, NUM_TOKENS, OPTIONS, SEQ_LEN, TEXT, TOKENIZER,
                         OptionError, RequestOptions, to_tensor)
from egemma.stub.adapter import triton_params

MAX_INPUTS = 2048  # inputs per HTTP request (OpenAI's own limit); the gateway splits them into calls of max_batch
_OUT_EMB = [grpcclient.InferRequestedOutput(EMBEDDING)]
_OUT_EMB_TOK = [*_OUT_EMB, grpcclient.InferRequestedOutput(NUM_TOKENS)]
_OUT_IDS = [grpcclient.InferRequestedOutput(INPUT_IDS), grpcclient.InferRequestedOutput(SEQ_LEN)]


# a failed Triton call: the request at fault, no server or model now, a full queue; anything else is Triton's
_KINDS = {"StatusCode.INVALID_ARGUMENT": Kind.VALIDATION, "StatusCode.UNAVAILABLE": Kind.UNHEALTHY,
          "StatusCode.RESOURCE_EXHAUSTED": Kind.OVERLOADED}


async def _infer(gw, model: str, inputs, outputs, params: dict):
    try:
        headers = gw.grpc_headers if gw.tracing is None else gw.tracing.headers(gw.grpc_headers)
        return await retry.call(gw, lambda: gw.grpc.infer(model, inputs, outputs=outputs, parameters=params or None,
                                                          headers=headers))
    except InferenceServerException as e:
        if "Request timeout expired" in (e.message() or ""):  # the models' queue time limit (their configs)
            raise GatewayError(Kind.OVERLOADED, f"{e.message()}: the request waited in a model's queue past the "
                                                "server's time limit (docs/limits.md); retry later") from None
        raise GatewayError(_KINDS.get(str(e.status()), Kind.BACKEND), e.message()) from None


def _chunks(n: int, size: int):
    return [(a, min(a + size, n)) for a in range(0, n, size)]


async def gather(*aws) -> list:
    """asyncio.gather that lets every call finish and then raises the first failure (a plain gather would
    leave the others' errors unretrieved)."""
    out = await asyncio.gather(*aws, return_exceptions=True)
    for r in out:
        if isinstance(r, BaseException):
            raise r
    return out


def _text_input(texts: list[str]):
    return _input(TEXT, np.array([[s.encode()] for s in texts], dtype=np.object_), "BYTES")


def _input(name: str, a: np.ndarray, dtype: str = "INT32"):
    t = grpcclient.InferInput(name, list(a.shape), dtype)
    t.set_data_from_numpy(a)
    return t


async def embed_texts(gw, texts: list[str], params: dict) -> tuple[np.ndarray, np.ndarray]:
    """(embeddings [n, D] fp32, token counts [n] as embedded: prompt, BOS and EOS included). Inputs over
    gw.max_batch go out as several calls at once."""
    async def one(a, b):
        r = await _infer(gw, ENSEMBLE, [_text_input(texts[a:b])], _OUT_EMB_TOK, params)
        return r.as_numpy(EMBEDDING), r.as_numpy(NUM_TOKENS).reshape(-1)
    if len(texts) <= gw.max_batch:  # the common request: one call, no gather
        emb, ntok = await one(0, len(texts))
    else:
        parts = await gather(*(one(a, b) for a, b in _chunks(len(texts), gw.max_batch)))
        emb, ntok = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    if gw.tracing is not None:
        gw.tracing.note(**{"egemma.model": gw.model_name, "egemma.texts": len(texts), "egemma.tokens": int(ntok.sum())})
    return emb, ntok


async def embed_ids(gw, rows: list[np.ndarray], params: dict, opts: RequestOptions) -> np.ndarray:
    """Embeddings [n, D] of complete id sequences (specials already in place; with long_text=chunk each row one
    input's windows: embed_id_lists), through the encoder model; opts: params as the models parse them."""
    async def one(a, b):
        lens = np.array([[len(r)] for r in rows[a:b]], dtype=np.int32)
        ids = np.zeros((b - a, int(lens.max())), dtype=np.int32)  # padding past SEQ_LEN is never read
        for j, r in enumerate(rows[a:b]):
            ids[j, :len(r)] = r
        # OPTIONS as the tokenizer passes them on (the one encoding, egemma.spec.to_tensor): the response cache keys
        # on it
        inputs = [_input(INPUT_IDS, ids), _input(SEQ_LEN, lens), _input(OPTIONS, to_tensor(opts, b - a))]
        return (await _infer(gw, ENCODER, inputs, _OUT_EMB, params)).as_numpy(EMBEDDING)
    if gw.tracing is not None:
        gw.tracing.note(**{"egemma.model": gw.model_name, "egemma.texts": len(rows),
                           "egemma.tokens": sum(len(r) for r in rows)})
    return np.concatenate(await gather(*(one(a, b) for a, b in _chunks(len(rows), gw.max_batch))))


async def tokenize(gw, texts: list[str], params: dict) -> list[np.ndarray]:
    """The ids the ensemble embeds for each text (BOS, prompt, text, EOS; truncated), from the tokenizer model."""
    async def one(a, b):
        r = await _infer(gw, TOKENIZER, [_text_input(texts[a:b])], _OUT_IDS, params)
        ids, lens = r.as_numpy(INPUT_IDS), r.as_numpy(SEQ_LEN).reshape(-1)
        return [ids[j, :n] for j, n in enumerate(lens.tolist())]
    return [r for part in await gather(*(one(a, b) for a, b in _chunks(len(texts), gw.max_batch)))
            for r in part]


def request_options(params: dict) -> RequestOptions:
    """The request options as the models parse them (egemma.spec, the one parser), for the gateway's own use of
    them; GatewayError(VALIDATION) for a bad one."""
    try:
        return RequestOptions.of(params)
    except OptionError as e:
        raise GatewayError(Kind.VALIDATION, str(e)) from None


async def embed_id_lists(app, rows: list[list[int]], params: dict, field: str,
                         prefix: str = "") -> tuple[np.ndarray, np.ndarray]:
    """(embeddings [n, D] fp32, tokens embedded [n]) of clients' token id lists, completed as the encoder gets them
    (egemma.engine.ids.complete, the id rule; long_text=chunk: each one's windows). GatewayError(VALIDATION) on
    `field`, naming the input, for an id outside the vocabulary, an over-long input with long_text=error
    (truncate=false), or windows that cannot be made."""
    cfg, opts, seqs = (await facts(app)).cfg, request_options(params), []
    for j, ids in enumerate(rows):
        try:
            seqs.append(complete(ids, cfg, opts.long_text, opts.chunk_overlap))
        except ValueError as e:
            raise GatewayError(Kind.VALIDATION, f"{prefix}input {j}: {e}", field) from None
    return await embed_ids(app[GW], seqs, params, opts), np.array([len(s) for s in seqs])


@dataclass(frozen=True)
class Facts:
    cfg: object  # egemma.engine.config.ModelConfig of the checkpoint the models loaded
    tokenizer_json: str  # the file the tokenizer model loaded
    encoder_params: dict
    tokenizer_instances: int
    encoder_max_batch: int


_FACTS = web.AppKey("egemma_facts", dict)


def init(app: web.Application):
    """Per-app state, made before the app starts (an aiohttp app's state is frozen after)."""
    if _FACTS not in app:
        app[_FACTS] = {"lock": asyncio.Lock()}


async def facts(app: web.Application) -> Facts:
    """Read once per process, from the model configs as Triton loaded them, the paths the models use (from the
    environment, as theirs: egemma.stub.adapter.env_path) and the checkpoint's own JSON files; retried on the next
    request when Triton is not up yet."""
    st = app[_FACTS]
    if "facts" in st:
        return st["facts"]
    async with st["lock"]:
        if "facts" not in st:
            st["facts"] = await _load_facts(app[GW])
    return st["facts"]


async def _load_facts(gw) -> Facts:
    from egemma.engine.config import ModelConfig  # torch-free: the gateway never loads the engine
    try:
        tok = (await gw.grpc.get_model_config(TOKENIZER, as_json=True))["config"]
        enc = (await gw.grpc.get_model_config(ENCODER, as_json=True))["config"]
    except InferenceServerException as e:
        raise GatewayError(Kind.UNHEALTHY, f"cannot read the model configs from Triton: {e.message()}") from None
    checkpoint, tp = triton_params(tok)
    _, ep = triton_params(enc)
    cfg = ModelConfig.load(checkpoint)
    instances = sum(int(g.get("count", 1)) for g in tok.get("instance_group", [])) or 1
    return Facts(cfg, tp.get("tokenizer_json", ""), ep, instances, int(enc.get("max_batch_size", 0)))
