"""OpenTelemetry traces, off unless --otlp-endpoint: a span per gateway request, and Triton's own spans under it.

The gateway takes a client's W3C `traceparent` (a malformed one is ignored: a new trace starts), starts a SERVER span
per request (route, the served model, texts, tokens, status; never a request's text) and passes its context to
Triton in `traceparent`: gRPC metadata on the OpenAI / TEI routes, the HTTP header on the KServe proxy and fast lane.
With --otlp-triton-spans, Triton 2.51 (the nvidia-pytriton wheel's build has OpenTelemetry; tests/test_tracing.py
receives its spans) is started with `triton_args`: OpenTelemetry mode, rate 0, so that it traces exactly the
requests that carry a context (Triton traces every request with a propagated context, whatever its sampled flag;
the gateway passes one only for the requests it samples), and records the ensemble's request, each model's step
with its queue, and the compute, under the gateway's span. gRPC clients that send `traceparent` metadata to
Triton directly join their own trace the same way; those that send none are not traced. It is off by default
because traced load crashes Triton 2.51: it can free a traced request's trace while the trace of one of its
ensemble's steps still holds that trace's mutex (TraceManager::TraceRelease; fixed in Triton 2.57 by
triton-inference-server/server#8144); the more traced requests a second, the sooner (docs/observability.md).

Sampling: --otlp-sample-ratio of the new traces (default 1), a client's sampled flag kept (parent-based). Spans
are batched and sent on a thread of their own (OTLP/HTTP protobuf to <endpoint>/v1/traces); an endpoint that
cannot be reached loses spans, never a request, and is logged once. Off, the request path pays one `is None`."""
from __future__ import annotations

import logging
import re
import time
from urllib.parse import urlsplit

log = logging.getLogger("egemma.gateway")
SERVICE = "egemma-gateway"
_TRACEPARENT = re.compile(rb"\r\ntraceparent:[^\r]*", re.I)


def add_flags(ap, triton: bool = False):
    """--otlp-endpoint and --otlp-sample-ratio (the gateway's and the launcher's, which passes them on); triton: also
    --otlp-triton-spans (the launcher's, which starts Triton)."""
    ap.add_argument("--otlp-endpoint", metavar="URL",
                    help="OpenTelemetry collector, OTLP/HTTP (e.g. http://127.0.0.1:4318): a span per request at the "
                         "gateway (default: off)")
    ap.add_argument("--otlp-sample-ratio", type=_ratio, default=1.0, metavar="R",
                    help="share of new traces sampled, 0 to 1 (default 1; a client's sampled traceparent is kept)")
    if triton:
        ap.add_argument("--otlp-triton-spans", action="store_true",
                        help="with --otlp-endpoint, Triton's own spans too (its request, the ensemble, each model's "
                             "queue and compute) under the gateway's. Off by default: traced load crashes Triton "
                             "2.51 (docs/observability.md); for a debugging session, with a low sample ratio")


def _ratio(v: str) -> float:
    """--otlp-sample-ratio: a number in [0, 1]."""
    import argparse
    try:
        x = float(v)
    except ValueError:
        x = -1.0
    if not 0.0 <= x <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a number from 0 to 1, got {v!r}")
    return x


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of an endpoint given as a collector's base URL (http://host:4318) or in full."""
    return endpoint if urlsplit(endpoint).path.rstrip("/") else endpoint.rstrip("/") + "/v1/traces"


def triton_args(endpoint: str | None) -> list[str]:
    """tritonserver's flags to export its spans of the requests that carry a trace context to endpoint."""
    if not endpoint:
        return []
    return [f"--trace-config={c}" for c in (
        "mode=opentelemetry", f"opentelemetry,url={traces_url(endpoint)}", "rate=0", "count=-1", "level=TIMESTAMPS",
        "opentelemetry,resource=service.name=egemma-triton", "opentelemetry,bsp_schedule_delay=1000")]


class Tracing:
    """The gateway worker's tracer (made after the fork: the exporter's thread is the worker's own)."""

    def __init__(self, endpoint: str, ratio: float = 1.0):
        from opentelemetry import propagate, trace
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExportResult
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        class Exporter(OTLPSpanExporter):
            """Spans to the collector; a failure to reach it logged once (until it is reached again)."""
            failing = False

            def export(self, spans):
                try:
                    res = super().export(spans)
                except Exception as e:  # unreachable: requests raises, which the processor would log each batch
                    res, why = SpanExportResult.FAILURE, f"{type(e).__name__}: {e}"
                else:
                    why = "the collector refused them"
                if res is SpanExportResult.FAILURE and not self.failing:
                    log.warning("tracing: spans to %s are lost: %s (said once)", self._endpoint, why)
                self.failing = res is SpanExportResult.FAILURE
                return res

        logging.getLogger("opentelemetry.exporter.otlp.proto.http").setLevel(logging.CRITICAL)  # said above
        self.provider = TracerProvider(resource=Resource.create({"service.name": SERVICE}),
                                       sampler=ParentBased(TraceIdRatioBased(ratio)))
        self.provider.add_span_processor(BatchSpanProcessor(Exporter(endpoint=traces_url(endpoint), timeout=5),
                                                            schedule_delay_millis=1000))
        self.tracer = self.provider.get_tracer("egemma.gateway")
        self.trace, self.propagate = trace, propagate
        self.server_kind = trace.SpanKind.SERVER

    def start(self, method: str, route: str, carrier) -> object:
        """A SERVER span for a request whose headers are carrier (a mapping), child of its traceparent if valid."""
        ctx = self.propagate.extract(carrier)
        return self.tracer.start_span(f"{method} {route}", context=ctx, kind=self.server_kind,
                                      attributes={"http.request.method": method, "http.route": route},
                                      start_time=time.time_ns())

    def use(self, span):
        """`with tracing.use(span):` the span is current (its context goes with Triton calls made meanwhile)."""
        return self.trace.use_span(span, end_on_exit=False)

    def kserve(self, method: str, route: str, request: bytes, start: int, headers: dict) -> tuple[object, bytes, int]:
        """(span, the raw request with the span's traceparent for Triton in place of the client's, where its body
        starts) of a fast-lane request (egemma.gateway.fastlane: headers by lower-case bytes name)."""
        span = self.start(method, route, {k.decode("latin-1"): v.decode("latin-1") for k, v in headers.items()})
        head = _TRACEPARENT.sub(b"", request[:start - 2])  # through the last header's CRLF
        if (tp := self.traceparent(span)) is not None:
            head += b"traceparent: " + tp.encode() + b"\r\n"
        return span, head + request[start - 2:], len(head) + 2

    def traceparent(self, span) -> str | None:
        """The W3C traceparent that makes Triton's spans children of span; None when it is not sampled."""
        c = span.get_span_context()
        return f"00-{c.trace_id:032x}-{c.span_id:016x}-01" if c.trace_flags.sampled else None

    def headers(self, base: dict | None) -> dict | None:
        """base with the current span's traceparent (gRPC metadata / HTTP headers to Triton)."""
        tp = self.traceparent(self.trace.get_current_span())
        return base if tp is None else {**(base or {}), "traceparent": tp}

    def note(self, **attributes):
        """Attributes of the current request's span (counts and names only: never a request's text)."""
        span = self.trace.get_current_span()
        if span.is_recording():
            span.set_attributes(attributes)

    def end(self, span, status: int):
        span.set_attribute("http.response.status_code", status)
        if status >= 500:
            span.set_status(self.trace.Status(self.trace.StatusCode.ERROR))
        span.end()

    def shutdown(self):
        self.provider.shutdown()
