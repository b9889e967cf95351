"""The Triton calls behind the gateway's OpenAI and TEI routes (egemma.gateway.serving), over its one shared aio
gRPC client, tried again while the server restarts (egemma.gateway.retry): texts through the ensemble, token ids
straight to the encoder, texts through the tokenizer model. A failed call is a GatewayError of its Kind."""
from __future__ import annotations

import asyncio

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from egemma.gateway import retry
from egemma.gateway.errors import GatewayError, Kind
from egemma.spec import EMBEDDING, ENCODER, ENSEMBLE, INPUT_IDS, NUM_TOKENS, OPTIONS, SEQ_LEN, TEXT, TOKENIZER

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
    leave the others' errors unretrieved); one call (the common request) is awaited as it is, without a task."""
    if len(aws) == 1:
        return [await aws[0]]
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


async def embed(gw, texts: list[str], seqs: list[np.ndarray], params: dict,
                options: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(embeddings [len(texts) + len(seqs), D] fp32: the texts' through the ensemble, then those of complete id
    sequences (specials in place; with long_text=chunk, an input's windows) through the encoder; tokens embedded per
    text [len(texts)]). Inputs over gw.max_batch go out as several calls at once; options: the request's OPTIONS row
    (egemma.spec.to_tensor), which every id row goes with (the response cache keys on it)."""
    n = gw.max_batch
    todo = [(ENSEMBLE, [_text_input(texts[a:b])], _OUT_EMB_TOK) for a, b in _chunks(len(texts), n)] + [
        (ENCODER, _ids_inputs(seqs[a:b], options), _OUT_EMB) for a, b in _chunks(len(seqs), n)]
    done = await gather(*(_infer(gw, *t, params) for t in todo))
    emb = np.concatenate([r.as_numpy(EMBEDDING) for r in done])
    ntok = [r.as_numpy(NUM_TOKENS).reshape(-1) for r, t in zip(done, todo) if t[0] == ENSEMBLE]
    return emb, np.concatenate(ntok) if ntok else np.zeros(0, np.int64)


def _ids_inputs(rows: list[np.ndarray], options: np.ndarray) -> list:
    lens = np.array([[len(r)] for r in rows], dtype=np.int32)
    ids = np.zeros((len(rows), int(lens.max())), dtype=np.int32)  # padding past SEQ_LEN is never read
    for j, r in enumerate(rows):
        ids[j, :len(r)] = r
    return [_input(INPUT_IDS, ids), _input(SEQ_LEN, lens), _input(OPTIONS, np.repeat(options, len(rows), axis=0))]


async def tokenize(gw, texts: list[str], params: dict) -> list[np.ndarray]:
    """The ids the ensemble embeds for each text (BOS, prompt, text, EOS; truncated), from the tokenizer model."""
    async def one(a, b):
        r = await _infer(gw, TOKENIZER, [_text_input(texts[a:b])], _OUT_IDS, params)
        ids, lens = r.as_numpy(INPUT_IDS), r.as_numpy(SEQ_LEN).reshape(-1)
        return [ids[j, :n] for j, n in enumerate(lens.tolist())]
    return [r for part in await gather(*(one(a, b) for a, b in _chunks(len(texts), gw.max_batch)))
            for r in part]
