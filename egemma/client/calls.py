"""egemma-embed's calls to the server: one tritonclient.grpc.aio channel per --url, requests spread round-robin,
retried with backoff on anything but INVALID_ARGUMENT (UNAVAILABLE and lost connections while a watchdog restarts
the server, deadlines, a stub's INTERNAL error) until a request has failed for `retry_for` seconds, and a batch
the server refuses split in halves until the refused rows are found: one bad text fails its whole request."""
from __future__ import annotations

import asyncio
import itertools
import random
import time
from dataclasses import dataclass

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
from tritonclient.utils import InferenceServerException

from egemma.client.inputs import UsageError
from egemma.spec import CHUNK_EMBEDDING, CHUNK_OF, CHUNK_SPAN, ENSEMBLE, MAX_TEXT_BYTES, NUM_TOKENS, OUTPUTS, TEXT

REFUSED = "StatusCode.INVALID_ARGUMENT"
# Reconnect within a second or two of a restarted server listening again (gRPC's default backoff grows to 120 s);
# round_robin: a dns:/// target of several addresses (a headless Service) spreads over all of them.
CHANNEL = [("grpc.max_send_message_length", grpcclient.MAX_GRPC_MESSAGE_SIZE),
           ("grpc.max_receive_message_length", grpcclient.MAX_GRPC_MESSAGE_SIZE),
           ("grpc.initial_reconnect_backoff_ms", 250), ("grpc.min_reconnect_backoff_ms", 250),
           ("grpc.max_reconnect_backoff_ms", 2000), ("grpc.lb_policy_name", "round_robin")]


class Refused(Exception):
    """The server answered INVALID_ARGUMENT: something in the request's texts, never fixed by retrying."""


class Unreachable(Exception):
    """A request kept failing for the whole retry window."""


class Stopped(Exception):
    """The run is stopping: a request in backoff is given up rather than retried."""


@dataclass
class Embedded:
    vectors: np.ndarray  # [n, width] float32, or uint8 / int8 packed bits; with chunks a row per window
    tokens: np.ndarray  # [n] int32
    refused: dict[int, str]  # index in the batch -> the server's reason, for rows left out of vectors
    # with chunks: [n] the embedded text (counted without the refused ones) each window belongs to, and [n, 5] its
    # chunk number, text tokens [start, end) and characters [start, end) (the server's CHUNK_SPAN)
    of: np.ndarray | None = None
    chunks: np.ndarray | None = None


def windows(of: np.ndarray, span: np.ndarray, num_tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(each window's tokens as embedded, [windows, 5] chunk number and span) from the server's CHUNK_OF /
    CHUNK_SPAN and each text's NUM_TOKENS: a text's windows each add the same BOS, prompt and EOS to their text
    tokens."""
    texts = len(num_tokens)
    n, body = np.bincount(of, minlength=texts), span[:, 1] - span[:, 0]
    extra = (num_tokens - np.bincount(of, weights=body, minlength=texts).astype(np.int64)) // np.maximum(n, 1)
    number = np.arange(len(of)) - (np.cumsum(n) - n)[of]
    return (body + extra[of]).astype(np.int32), np.column_stack([number, span]).astype(np.int32)


class Server:
    """Calls to `model` at every URL with one set of request parameters."""

    def __init__(self, urls: list[str], params: dict, encoding: str, timeout: float, retry_for: float,
                 model: str = ENSEMBLE):
        """params with return_chunks: each window of every text is a row (Embedded.of / chunks)."""
        self.clients = [grpcaio.InferenceServerClient(u, channel_args=CHANNEL) for u in urls]
        self.urls, self.params, self.model = urls, params, model
        self.chunked = bool(params.get("return_chunks"))
        names = (CHUNK_EMBEDDING, NUM_TOKENS, CHUNK_OF, CHUNK_SPAN) if self.chunked else (OUTPUTS[encoding], NUM_TOKENS)
        self.outputs = [grpcclient.InferRequestedOutput(n) for n in names]
        self.timeout, self.retry_for = timeout, retry_for
        self._next = itertools.cycle(range(len(urls)))
        self.retries = 0
        self.stopping = False
        self.on_retry = lambda url, error: None  # told of every failed attempt that will be retried

    async def _once(self, k: int, texts: list[bytes]) -> Embedded:
        i = grpcclient.InferInput(TEXT, [len(texts), 1], "BYTES")
        i.set_data_from_numpy(np.array(texts, dtype=np.object_).reshape(-1, 1))
        r = await self.clients[k].infer(self.model, [i], parameters=self.params, client_timeout=self.timeout,
                                        outputs=self.outputs)
        got = [r.as_numpy(o.name()) for o in self.outputs]
        if not self.chunked:
            return Embedded(got[0], got[1].reshape(-1), {})
        of = got[2].reshape(-1)
        tokens, chunks = windows(of, got[3], got[1].reshape(-1))
        return Embedded(got[0], tokens, {}, of, chunks)

    async def call(self, texts: list[bytes], k: int | None = None) -> Embedded:
        """One request's answer, retried (on the next URL each time, or always URL k) until it succeeds, the
        server refuses it (Refused), it has failed for retry_for seconds (Unreachable) or the run stops."""
        first, delay = None, 0.25
        while True:
            url = next(self._next) if k is None else k
            try:
                return await self._once(url, texts)
            except InferenceServerException as e:
                if e.status() == REFUSED:
                    raise Refused(e.message()) from None
                error = e
            first = first or time.monotonic()
            if time.monotonic() - first > self.retry_for:
                raise Unreachable(f"failing for {self.retry_for:g} s: {error.status()} {error.message()}") from None
            if self.stopping:
                raise Stopped() from None
            self.retries += 1
            self.on_retry(self.urls[url], error)
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(delay * 2, 5.0)

    async def embed(self, texts: list[bytes]) -> Embedded:
        """Every text's embedding, or the server's reason for the rows it refuses (found by splitting)."""
        try:
            return await self.call(texts)
        except Refused as e:
            if len(texts) == 1:
                return Embedded(None, None, {0: str(e)})
        half = len(texts) // 2
        a, b = await self.embed(texts[:half]), await self.embed(texts[half:])
        refused = {**a.refused, **{half + j: why for j, why in b.refused.items()}}
        parts = [p for p in (a, b) if p.vectors is not None]
        if not parts:
            return Embedded(None, None, refused)
        cat = [np.concatenate([p.vectors for p in parts]), np.concatenate([p.tokens for p in parts]), refused]
        if self.chunked:  # b's windows follow a's embedded texts
            ofs = [a.of] * (a.vectors is not None) + [b.of + half - len(a.refused)] * (b.vectors is not None)
            cat += [np.concatenate(ofs), np.concatenate([p.chunks for p in parts])]
        return Embedded(*cat)

    async def probe(self) -> tuple[int, np.dtype]:
        """Check the options against every URL with one short text (retried while a server comes up): the
        width and dtype of what it returns. A refused option is a UsageError naming the server's reason."""
        async def one(k):
            try:
                return await self.call([b"egemma-embed probe"], k)
            except Refused as e:
                raise UsageError(f"{self.urls[k]} refuses these options: {e}") from None
            except Unreachable as e:
                raise Unreachable(f"{self.urls[k]}: {e}") from None
        answers = await asyncio.gather(*(one(k) for k in range(len(self.clients))))
        shapes = {(e.vectors.shape[1], e.vectors.dtype) for e in answers}
        if len(shapes) != 1:
            raise UsageError(f"the servers at {', '.join(self.urls)} answer differently: {sorted(shapes)}")
        return shapes.pop()

    async def max_text_bytes(self) -> int | None:
        """The tokenizer's max_text_bytes from the first server's model config (empty there: the default,
        MAX_TEXT_BYTES), None if it cannot be read."""
        try:
            cfg = await self.clients[0].get_model_config(f"{self.model}_tokenizer", as_json=True)
            return int(cfg["config"]["parameters"]["max_text_bytes"]["string_value"] or MAX_TEXT_BYTES)
        except (InferenceServerException, KeyError, ValueError):
            return None

    async def close(self):
        await asyncio.gather(*(c.close() for c in self.clients))
