"""The gateway's own Prometheus metrics, and GET /metrics's text: Triton's (nv_inference_*, nv_gpu_*) followed by the
gateway's families, the model instances' (egemma.stub.metrics.STUB_FAMILIES, from the files the stubs write into
--stats-dir) and the watchdog's restarts (from the verdict file).

The gateway counts what only it sees: each HTTP request's duration and status by route, and its own refusals by
reason. What Triton counts (queue and compute time per model, requests, executions) is not counted again. The
workers (forked processes) write their own slots of one shared map made before the fork (`setup`), so a scrape
answered by any worker sums all of them; a request costs a dict lookup and three stores. Label values come from
fixed lists: a route's name, never its path (which holds a model name the client chose), a status code, an
egemma.gateway.errors.Kind."""
from __future__ import annotations

import mmap
import time

from aiohttp import web

from egemma.gateway import common
from egemma.gateway.common import GW, REFUSED
from egemma.gateway.errors import Kind
from egemma.stub.metrics import STUB_FAMILIES, Family, Shared, layout, read_stats, render

ROUTES = ("kserve_infer", "kserve", "health", "openai_embeddings", "openai", "tei_embed", "tei_tokenize", "tei",
          "metrics", "other")
CODES = ("200", "400", "401", "403", "404", "405", "413", "415", "422", "424", "429", "500", "501", "502", "503",
         "504", "other")
FAMILIES = [
    Family("egemma_request_duration_seconds", "HTTP request duration at the gateway, from its head read to its "
           "answer, by route, seconds",
           (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
           {"route": ROUTES}),
    Family("egemma_requests_total", "HTTP requests answered by the gateway, by route and status code", (),
           {"route": ROUTES, "code": CODES}),
    Family("egemma_requests_refused_total", "HTTP requests answered with an error the gateway wrote (its own "
           "refusals, and Triton's failures as the gateway maps them), by reason", (),
           {"reason": tuple(k.value for k in Kind)}),
]
_TEI = {"/": "tei_embed", "/embed": "tei_embed", "/tokenize": "tei_tokenize", "/metrics": "metrics",
        "/health": "health", "/info": "tei", "/embed_all": "tei"}
_CODES = frozenset(CODES)


def route_of(path: str) -> str:
    """The route label of a request path (decoded, without the query)."""
    if path.startswith("/v2"):
        if path.startswith("/v2/health"):
            return "health"
        return "kserve_infer" if path.endswith("/infer") and path.startswith("/v2/models/") else "kserve"
    if path.startswith("/v1"):
        return "openai_embeddings" if path == "/v1/embeddings" else "openai"
    return _TEI.get(path, "other")


class Metrics:
    """The gateway's families in a map shared by `workers` processes; `worker(k)` picks process k's slots."""

    def __init__(self, workers: int = 1, stats_dir: str | None = None):
        self.n = layout(FAMILIES)[1]
        self.workers, self.stats_dir = workers, stats_dir  # stats_dir: the model instances' metrics files
        self.mm = mmap.mmap(-1, 8 * self.n * workers)  # anonymous and shared: forked workers write the same pages
        self.worker(0)

    def worker(self, k: int):
        self.w = Shared(FAMILIES, self.mm, at=k * self.n)

    def answered(self, path: str, status: int, seconds: float):
        route, code = route_of(path), str(status)
        self.w.observe("egemma_request_duration_seconds", seconds, (route,))
        self.w.inc("egemma_requests_total", (route, code if code in _CODES else "other"))

    def refused(self, kind: Kind):
        self.w.inc("egemma_requests_refused_total", (kind.value,))

    def render(self, health_file: str | None, ready: bool) -> str:
        """The text of every family; ready: the gateway's readiness now (egemma_ready)."""
        view = memoryview(self.mm).cast("d")
        text = render(FAMILIES, [view[k * self.n:(k + 1) * self.n] for k in range(self.workers)])
        text += render(STUB_FAMILIES, read_stats(self.stats_dir, STUB_FAMILIES) if self.stats_dir else [])
        text += ("# HELP egemma_ready Whether this server is ready (the gateway's /v2/health/ready: the watchdog's "
                 "verdict, not stopping)\n# TYPE egemma_ready gauge\n" f"egemma_ready {int(ready)}\n")
        if health_file:
            text += ("# HELP egemma_watchdog_restarts_total Restarts of tritonserver by the launcher's watchdog\n"
                     "# TYPE egemma_watchdog_restarts_total counter\n"
                     f"egemma_watchdog_restarts_total {common.restarts(health_file)}\n")
        return text


@web.middleware
async def observe(request: web.Request, handler):
    """Every aiohttp answer counted, and traced when tracing is on (egemma.gateway.tracing): the span is current
    while the handler runs, so the Triton calls it makes carry its context."""
    t0, status, tr = time.perf_counter(), 500, request.app[GW].tracing
    span = None if tr is None else tr.start(request.method, route_of(request.path), request.headers)
    try:
        if span is None:
            r = await handler(request)
        else:
            with tr.use(span):
                r = await handler(request)
        status = r.status
        return refusal(r)
    except web.HTTPException as e:
        status = e.status
        raise
    finally:
        METRICS.answered(request.path, status, time.perf_counter() - t0)
        if span is not None:
            tr.end(span, status)


METRICS = Metrics()  # replaced by setup() in a gateway with workers, before they fork


def refusal(r: web.StreamResponse) -> web.StreamResponse:
    """r, its reason counted when it is an error answer of the gateway's (egemma.gateway.common.error_response)."""
    if (kind := r.get(REFUSED)) is not None:
        METRICS.refused(kind)
    return r


def done(path: str, status: int, t0: float, tracing, span):
    """A fast-lane answer (egemma.gateway.fastlane) counted, and its span ended."""
    METRICS.answered(path, status, time.perf_counter() - t0)
    if span is not None:
        tracing.end(span, status)


def add_flags(ap):
    """The gateway's flags of what it observes: --stats-dir, and tracing's (egemma.gateway.tracing)."""
    from egemma.gateway import tracing
    ap.add_argument("--stats-dir", help="where the model instances write their metrics (the launcher's "
                                        "heartbeat directory), rendered at GET /metrics")
    tracing.add_flags(ap)


def start_worker(gw, a, k: int):
    """Worker k (0: the first process) writes its own slots, and traces with a tracer of its own when asked (made
    after the fork: the exporter's thread is the worker's)."""
    METRICS.worker(k)
    if a.otlp_endpoint:
        from egemma.gateway.tracing import Tracing
        gw.tracing = Tracing(a.otlp_endpoint, a.otlp_sample_ratio)


def setup(workers: int, stats_dir: str | None = None) -> Metrics:
    global METRICS
    METRICS = Metrics(workers, stats_dir)
    return METRICS
