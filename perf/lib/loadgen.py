"""The one Python load driver of the benchmarks (perf_analyzer, perf/lib/pa.py, is the C++ one), so that the client
is the same for every server: an OpenAI-style HTTP route (`POST .../embeddings`: ours through the gateway, Infinity,
vLLM) over aiohttp, or Triton's gRPC (ours, and sentence-transformers behind the same Triton) over tritonclient's aio
client.

Workloads: `one_at_a_time` (c=1: each request sent when the last one answered), `closed_loop` (c connections
each sending back to back, spread over several processes so that one client core is not the ceiling, counted in
the same window after a warm-up) and `all_of` (a fixed list of requests with a given number in flight). Every
answer's status is checked (an error counts and is reported, never timed as a success); bodies are read whole but
parsed only by `vectors`, the fidelity check, so that JSON decoding stays out of the timings."""
import asyncio
import base64
import json
import multiprocessing as mp
import time
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Target:
    """kind: "openai" (url: the embeddings route, model: the served name, encoding: its encoding_format, float or
    base64) or "grpc" (url: host:port, model: the Triton model; its input `TEXT` BYTES [n, 1], or `TEXT_UTF8` UINT8
    [n, L] zero-padded as perf/serving/baseline_repository takes it)."""
    kind: str
    url: str
    model: str
    input: str = "TEXT"
    encoding: str = "float"


def payload(t: Target, texts: list[str]):
    """What one request carries: the JSON body, or the gRPC inputs."""
    if t.kind == "openai":
        return json.dumps({"model": t.model, "input": texts, "encoding_format": t.encoding}).encode()
    import tritonclient.grpc as grpcclient
    if t.input == "TEXT_UTF8":
        raw = [x.encode() for x in texts]
        n = max(map(len, raw))
        arr = np.frombuffer(b"".join(r.ljust(n, b"\0") for r in raw), np.uint8).reshape(len(raw), n)
        i = grpcclient.InferInput("TEXT_UTF8", list(arr.shape), "UINT8")
    else:
        arr = np.array([[x.encode()] for x in texts], dtype=np.object_)
        i = grpcclient.InferInput("TEXT", list(arr.shape), "BYTES")
    i.set_data_from_numpy(arr)
    return [i]


class Client:
    """`async with Client(target) as c:` then `await c.call(payload)` -> (ok, answer): the raw body (HTTP) or the
    InferResult (gRPC); ok is False on any error status or exception."""

    def __init__(self, t: Target):
        self.t, self.session, self.grpc = t, None, None

    async def __aenter__(self):
        if self.t.kind == "openai":
            import aiohttp
            self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                                 timeout=aiohttp.ClientTimeout(total=300))
        else:
            import tritonclient.grpc.aio as grpcaio
            self.grpc = grpcaio.InferenceServerClient(self.t.url)
        return self

    async def __aexit__(self, *exc):
        if self.session:
            await self.session.close()
        if self.grpc:
            await self.grpc.close()

    async def call(self, p) -> tuple[bool, object]:
        try:
            if self.session:
                async with self.session.post(self.t.url, data=p, headers={"Content-Type": "application/json"}) as r:
                    body = await r.read()
                    return r.status == 200, body
            return True, await self.grpc.infer(self.t.model, p)
        except Exception as e:  # a refused or reset connection, a gRPC error status: an error, counted
            return False, e


def vectors(t: Target, answer) -> np.ndarray:
    """The embeddings of one answer, rows in input order."""
    if t.kind == "openai":
        data = sorted(json.loads(answer)["data"], key=lambda d: d["index"])
        if t.encoding == "base64":
            return np.stack([np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in data])
        return np.array([d["embedding"] for d in data], np.float32)
    return answer.as_numpy("EMBEDDING").astype(np.float32)


def stats(lat: list[float], errors: int, seconds: float | None = None) -> dict:
    """p50 / p99 ms of the latencies, req/s over `seconds` when given, and the error count."""
    lat = sorted(lat)
    out = {"n": len(lat), "errors": errors, "p50_ms": None, "p99_ms": None}
    if lat:
        out.update(p50_ms=1e3 * lat[len(lat) // 2], p99_ms=1e3 * lat[min(len(lat) - 1, int(len(lat) * 0.99))])
    if seconds:
        out["rps"] = len(lat) / seconds
    return out


async def _one_at_a_time(t: Target, batches: list[list[str]], warmup: int, max_n: int, seconds: float):
    ps = [payload(t, b) for b in batches]
    lat, errors = [], 0
    async with Client(t) as c:
        for i in range(warmup):
            await c.call(ps[i % len(ps)])
        t_end = time.perf_counter() + seconds
        while len(lat) + errors < max_n and time.perf_counter() < t_end:
            s = time.perf_counter()
            ok, _ = await c.call(ps[(len(lat) + errors) % len(ps)])
            if ok:
                lat.append(time.perf_counter() - s)
            errors += not ok
    return stats(lat, errors)


def one_at_a_time(t: Target, batches: list[list[str]], warmup=3, max_n=200, seconds=20.0) -> dict:
    """c=1 over the batches in turn, after `warmup` untimed requests: until max_n requests or `seconds`."""
    return asyncio.run(_one_at_a_time(t, batches, warmup, max_n, seconds))


async def _closed(t: Target, texts: list[str], conc: int, offset: int, t0: float, warmup: float, seconds: float):
    ps = [payload(t, [x]) for x in texts]
    lat, errors = [], 0
    async with Client(t) as c:
        async def loop(k):
            nonlocal errors
            i = k
            while (now := time.time()) < t0 + warmup + seconds:
                s = time.perf_counter()
                ok, _ = await c.call(ps[i % len(ps)])
                i += conc
                if now >= t0 + warmup and ok:
                    lat.append(time.perf_counter() - s)
                errors += now >= t0 + warmup and not ok
        await asyncio.sleep(max(0.0, t0 - time.time()))
        await asyncio.gather(*(loop(offset + k) for k in range(conc)))
    return lat, errors


def _closed_proc(t, texts, conc, offset, t0, warmup, seconds, q):
    q.put(asyncio.run(_closed(t, texts, conc, offset, t0, warmup, seconds)))


def closed_loop(t: Target, texts: list[str], conc: int, procs: int, warmup=2.0, seconds=8.0) -> dict:
    """conc single-text requests in flight, split over `procs` processes that start together; requests counted
    in the `seconds` after `warmup`."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    t0 = time.time() + 3.0 + 0.3 * procs  # every process started and connected before the window opens
    shares = [conc // procs + (k < conc % procs) for k in range(procs)]
    ps = [ctx.Process(target=_closed_proc, args=(t, texts, n, sum(shares[:k]), t0, warmup, seconds, q))
          for k, n in enumerate(shares) if n]
    for p in ps:
        p.start()
    parts = [q.get(timeout=t0 - time.time() + warmup + seconds + 300) for _ in ps]
    for p in ps:
        p.join()
    return stats([x for lat, _ in parts for x in lat], sum(e for _, e in parts), seconds)


async def _all_of(t: Target, batches: list[list[str]], inflight: int, keep):
    ps = [payload(t, b) for b in batches]
    errors, it = 0, iter(enumerate(ps))
    async with Client(t) as c:
        await c.call(ps[0])  # the connection made before the clock starts

        async def worker():
            nonlocal errors
            for i, p in it:
                ok, answer = await c.call(p)
                errors += not ok
                if ok and keep is not None:
                    keep(i, answer)
        s = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(inflight)))
        return time.perf_counter() - s, errors


def all_of(t: Target, batches: list[list[str]], inflight: int, keep=None) -> tuple[float, int]:
    """Every batch once, `inflight` requests at a time: (seconds, errors). keep(i, answer), if given, sees each
    batch's answer (i: its index), within the timed window: keep it cheap."""
    return asyncio.run(_all_of(t, batches, inflight, keep))


async def _embed(t: Target, batches: list[list[str]]):
    async with Client(t) as c:
        out = []
        for b in batches:
            ok, answer = await c.call(payload(t, b))
            if not ok:
                raise RuntimeError(f"{t.url}: {answer!r:.300}")
            out.append(vectors(t, answer))
    return np.concatenate(out)


def embed(t: Target, texts: list[str], per_request: int = 8) -> np.ndarray:
    """The texts' embeddings from the server, `per_request` texts a request."""
    return asyncio.run(_embed(t, [texts[i:i + per_request] for i in range(0, len(texts), per_request)]))
