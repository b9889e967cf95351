"""The serving logic behind the OpenAI and TEI routes, apart from their bodies and their routes (as vLLM's serving
module): one Embed's texts go through the ensemble and its token ids, completed by the id rule, straight to the
encoder, and come back as one answer in the request's order; and the served model's facts (special ids, lengths,
instance counts), read once from the configs and checkpoint the models themselves load."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np
from aiohttp import web
from tritonclient.utils import InferenceServerException

from egemma.engine.ids import complete
from egemma.gateway import calls
from egemma.gateway.common import GW
from egemma.gateway.errors import GatewayError, Kind
from egemma.gateway.protocol import Embed
from egemma.spec import ENCODER, TOKENIZER
from egemma.stub.adapter import triton_params


async def embed(app: web.Application, req: Embed) -> tuple[np.ndarray, np.ndarray]:
    """(embeddings [n, D] fp32, tokens embedded [n]: prompt, BOS, EOS, every window) of req.items, in order.
    GatewayError(VALIDATION) on req.field, naming the input (its place among the token-id inputs), for a token-id
    input the id rule refuses: an id outside the vocabulary, too long with long_text=error, windows that cannot be
    made."""
    gw = app[GW]
    text_at = [j for j, t in enumerate(req.items) if isinstance(t, str)]
    ids_at = [j for j, t in enumerate(req.items) if not isinstance(t, str)]
    cfg, seqs = (await facts(app)).cfg if ids_at else None, []
    for k, j in enumerate(ids_at):
        try:
            seqs.append(complete(req.items[j], cfg, req.opts.long_text, req.opts.chunk_overlap))
        except ValueError as e:
            raise GatewayError(Kind.VALIDATION, f"{req.id_errors}input {k}: {e}", req.field) from None
    emb, text_tokens = await calls.embed(gw, [req.items[j] for j in text_at], seqs, req.params, req.options)
    order = np.argsort(np.array(text_at + ids_at), kind="stable")
    ntok = np.concatenate([text_tokens, np.array([len(s) for s in seqs], dtype=text_tokens.dtype)])[order]
    if gw.tracing is not None:
        gw.tracing.note(**{"egemma.model": gw.model_name, "egemma.texts": len(req.items),
                           "egemma.tokens": int(ntok.sum())})
    return (emb if not (text_at and ids_at) else emb[order]), ntok


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
