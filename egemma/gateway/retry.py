"""A request that failed because the server was restarting is tried again until it is back: embedding is
idempotent, so the client sees delay, never the restart. Restarting means: no connection to Triton (refused, reset,
closed before its answer: the watchdog's restart, or Triton not up yet), or Triton's answer that the model process
serving the request died (RESTARTING). Tried again every RETRY_EVERY..1 s (doubling) for up to the gateway's
`retry_s` (--retry-seconds); then the last failure is the answer. Never while the server is stopping (a SIGTERM:
its 503 says so at once). One rule for the gateway's three ways to Triton: the fast lane's raw requests (`raw`), the
aiohttp proxy's and the OpenAI / TEI gRPC calls (`call`)."""
from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

from tritonclient.utils import InferenceServerException

from egemma.gateway.upstream import UpstreamError

# What Triton 2.51 answers (HTTP 500, gRPC INTERNAL) for a request whose model's stub process died, until the
# watchdog restarts the server; gRPC UNAVAILABLE is Triton not reachable (but an API key refusal is UNAVAILABLE too)
RESTARTING = ("is not healthy", "Stub process")
NOT_RESTARTING = ("restricted", "Request timeout expired")  # UNAVAILABLE too: no API key; the queue time limit
RETRY_EVERY = 0.05  # s, the first wait
# The gateway's gRPC channel: tritonclient's message limits, and reconnects after a restart tried every 0.1-0.5 s
# (gRPC's default backoff grows to minutes: the server would be back long before the channel looked again)
CHANNEL_ARGS = [("grpc.max_send_message_length", 2 ** 31 - 1), ("grpc.max_receive_message_length", 2 ** 31 - 1),
                ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 500)]


def restarting(outcome) -> bool:
    """Whether a try failed because the server was restarting: an answer as Upstream hands it on, or an exception
    (of the HTTP pool or of tritonclient)."""
    if isinstance(outcome, InferenceServerException):
        status, message = str(outcome.status()), outcome.message() or ""
        return (status == "StatusCode.UNAVAILABLE" and not any(m in message for m in NOT_RESTARTING)
                or status == "StatusCode.INTERNAL" and any(m in message for m in RESTARTING))
    if isinstance(outcome, (UpstreamError, OSError, asyncio.TimeoutError)):
        return True
    if isinstance(outcome, tuple):  # (raw answer, status, ...) or (status, headers, body)
        status, body = (outcome[1], outcome[0]) if isinstance(outcome[0], bytes) else (outcome[0], outcome[2])
        return status == 500 and any(m.encode() in body for m in RESTARTING)
    return False


class _Tries:
    def __init__(self, gw):
        self.gw, self.loop = gw, asyncio.get_running_loop()
        self.deadline, self.wait = self.loop.time() + gw.retry_s, RETRY_EVERY

    def again(self, outcome) -> float | None:
        """Seconds to wait before trying again after outcome, or None: it is the answer."""
        if self.gw.draining or not restarting(outcome) or self.loop.time() + self.wait > self.deadline:
            return None
        wait, self.wait = self.wait, min(2 * self.wait, 1.0)
        return wait


def raw(gw, data: bytes, done: Callable):
    """Upstream.send_raw(data, done), tried again while restarting (callbacks: no task per request)."""
    tries = None

    def answered(outcome):
        nonlocal tries
        tries = tries or _Tries(gw)
        if (wait := tries.again(outcome)) is None:
            return done(outcome)
        tries.loop.call_later(wait, gw.upstream.send_raw, data, answered)
    gw.upstream.send_raw(data, answered)


async def call(gw, attempt: Callable[[], Awaitable]):
    """await attempt(), again while restarting; its result, or its last exception."""
    tries = None
    while True:
        try:
            outcome = await attempt()
        except Exception as e:
            outcome = e
        tries = tries or _Tries(gw)
        if (wait := tries.again(outcome)) is None:
            if isinstance(outcome, Exception):
                raise outcome
            return outcome
        await asyncio.sleep(wait)
