"""Traces (egemma.gateway.tracing), received by an OTLP/HTTP receiver here and decoded with the OpenTelemetry proto
package: one request's span tree on HTTP (the gateway's span, Triton's request under it, the ensemble, both models'
steps with their queue, their compute) and one on gRPC straight to Triton; a malformed traceparent is ignored and
the request served; an unreachable collector loses spans, never requests, and is logged once."""
import base64
import http.server
import json
import os
import subprocess
import sys
import threading
import time

import pytest
import requests
import tritonclient.grpc as grpcclient

from helpers import Launcher, argv, text_input, wait_for
from rawhttp import INFER, start_front, text_request

pb = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")
from google.protobuf import json_format  # noqa: E402  (with the proto package only)

from egemma.gateway.tracing import triton_args  # noqa: E402
from egemma.ops.front import Front  # noqa: E402
from egemma.ops.tritonserver import free_port  # noqa: E402

MODELS = {"embeddinggemma_tokenizer", "embeddinggemma_encoder"}


def _hex_ids_to_base64(o):
    """OTLP/JSON writes trace and span ids in hex; protobuf's JSON mapping reads bytes as base64."""
    if isinstance(o, dict):
        return {k: base64.b64encode(bytes.fromhex(v)).decode() if k in ("traceId", "spanId", "parentSpanId") and v
                else _hex_ids_to_base64(v) for k, v in o.items()}
    return [_hex_ids_to_base64(v) for v in o] if isinstance(o, list) else o


class Receiver:
    """An OTLP/HTTP traces endpoint: protobuf bodies (the gateway's exporter) and JSON ones (Triton's)."""

    def __init__(self):
        self.spans, self.lock = [], threading.Lock()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                req = pb.ExportTraceServiceRequest()
                if "json" in self.headers.get("Content-Type", ""):
                    json_format.ParseDict(_hex_ids_to_base64(json.loads(body)), req)
                else:
                    req.ParseFromString(body)
                with outer.lock:
                    for rs in req.resource_spans:
                        service = next(a.value.string_value for a in rs.resource.attributes if a.key == "service.name")
                        outer.spans += [(service, s) for ss in rs.scope_spans for s in ss.spans]
                self.send_response(200)
                self.send_header("Content-Type", self.headers.get("Content-Type", ""))
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *a):
                pass
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def trace(self, trace_id: str) -> list:
        with self.lock:
            return [(svc, s) for svc, s in self.spans if s.trace_id.hex() == trace_id]


def attrs(span) -> dict:
    return {a.key: json_format.MessageToDict(a.value).popitem()[1] for a in span.attributes}


@pytest.fixture(scope="module")
def traced(checkpoints, tmp_path_factory):
    """(receiver, a tritonserver exporting to it, the gateway before it exporting to it, its log)."""
    from conftest import Servers
    recv = Receiver()
    d = tmp_path_factory.mktemp("tracing")
    with Servers(d / "servers", checkpoints["eos"]) as start:
        server = start(extra_args=triton_args(recv.url))
        log = d / "gateway.log"
        gw = start_front(server, log, "--workers=2", f"--otlp-endpoint={recv.url}")
        try:
            yield recv, server, gw, log
        finally:
            gw.stop()
    recv.server.shutdown()


def _tree(recv, trace_id: str, n: int) -> dict:
    """{span id: (service, span)} of a trace once n spans of it arrived."""
    try:
        wait_for(lambda: len(recv.trace(trace_id)) >= n, 60, f"{n} spans of trace {trace_id}")
    except AssertionError as e:
        got = [(svc, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), s.name) for svc, s in recv.spans]
        raise AssertionError(f"{e}; received {got}") from None
    return {s.span_id.hex(): (svc, s) for svc, s in recv.trace(trace_id)}


def _triton_tree(spans: dict, root_parent: str) -> None:
    """Triton's spans of one request under root_parent: its request span, the ensemble, each model's step (with
    its queue) and that step's compute."""
    (request,) = [s for svc, s in spans.values() if s.parent_span_id.hex() == root_parent]
    (ens,) = [s for _, s in spans.values() if s.parent_span_id == request.span_id]
    assert attrs(ens)["triton.model_name"] == "embeddinggemma"
    steps = [s for _, s in spans.values() if s.parent_span_id == ens.span_id]
    assert {attrs(s)["triton.model_name"] for s in steps} == MODELS
    for step in steps:
        assert {"REQUEST_START", "QUEUE_START", "REQUEST_END"} <= {e.name for e in step.events}
        (compute,) = [s for _, s in spans.values() if s.parent_span_id == step.span_id]
        assert compute.name == "compute" and {"COMPUTE_START", "COMPUTE_END"} <= {e.name for e in compute.events}
        assert step.start_time_unix_nano <= compute.start_time_unix_nano <= compute.end_time_unix_nano
    assert {svc for svc, _ in spans.values()} == {"egemma-triton"}


def test_http_request_span_tree(traced):
    recv, _, gw, _ = traced
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    r = requests.post(f"{gw.url}/v1/embeddings", json={"input": ["hello world", "second text"]},
                      headers={"traceparent": f"00-{trace_id}-{parent}-01"}, timeout=60)
    assert r.status_code == 200
    spans = _tree(recv, trace_id, 7)  # gateway, Triton's request, ensemble, 2 x (step, compute)
    (g,) = [s for svc, s in spans.values() if svc == "egemma-gateway"]
    assert g.parent_span_id.hex() == parent and g.name == "POST openai_embeddings"
    a = attrs(g)
    assert a["http.response.status_code"] in (200, "200") and int(a["egemma.texts"]) == 2
    assert int(a["egemma.tokens"]) == r.json()["usage"]["total_tokens"] and a["egemma.model"] == r.json()["model"]
    assert "hello" not in json.dumps(a)
    _triton_tree({k: v for k, v in spans.items() if v[0] != "egemma-gateway"}, g.span_id.hex())


def test_kserve_fast_lane_span_tree(traced):
    recv, _, gw, _ = traced
    trace_id, parent = "5bf92f3577b34da6a3ce929d0e0e4736", "10f067aa0ba902b7"
    r = requests.post(f"{gw.url}{INFER}", data=text_request(), timeout=60,
                      headers={"traceparent": f"00-{trace_id}-{parent}-01"})
    assert r.status_code == 200
    spans = _tree(recv, trace_id, 7)
    (g,) = [s for svc, s in spans.values() if svc == "egemma-gateway"]
    assert g.parent_span_id.hex() == parent and g.name == "POST kserve_infer"
    _triton_tree({k: v for k, v in spans.items() if v[0] != "egemma-gateway"}, g.span_id.hex())


def test_grpc_traceparent_joins_the_trace(traced):
    recv, server, _, _ = traced
    trace_id, parent = "6bf92f3577b34da6a3ce929d0e0e4736", "20f067aa0ba902b7"
    c = grpcclient.InferenceServerClient(server.grpc_url)
    c.infer("embeddinggemma", [text_input(["hello"])], headers={"traceparent": f"00-{trace_id}-{parent}-01"})
    _triton_tree(_tree(recv, trace_id, 6), parent)


def test_malformed_traceparent_is_ignored(traced):
    recv, _, gw, _ = traced
    for bad in ("00-zz-yy-01", "garbage", "00-" + "0" * 32 + "-" + "0" * 16 + "-01", "x" * 5000):
        for path, kw in (("/v1/embeddings", {"json": {"input": "bad traceparent"}}), (INFER, {"data": text_request()})):
            r = requests.post(f"{gw.url}{path}", headers={"traceparent": bad}, timeout=60, **kw)
            assert r.status_code == 200, (bad, path, r.text)


def test_unreachable_collector_loses_spans_not_requests(traced, tmp_path):
    """A gateway exporting to a closed port: every request served; the loss said once in its log."""
    _, server, _, _ = traced
    log, port = tmp_path / "gateway.log", free_port()
    with open(log, "w") as f:  # its stderr: where the loss is said
        proc = subprocess.Popen([sys.executable, "-m", "egemma.gateway.app", f"--port={port}",
                                 f"--triton-http={server.http_url}", f"--triton-grpc={server.grpc_url}",
                                 f"--otlp-endpoint=http://127.0.0.1:{free_port()}"], stderr=f)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: Front([], url).answers(), 60, "the gateway to answer")

        def served():
            assert requests.post(f"{url}/v1/embeddings", json={"input": "x"}, timeout=60).status_code == 200
            return "are lost" in log.read_text()
        wait_for(served, 60, "the gateway to say its spans are lost")
        # a few more export rounds (one a second) of spans that cannot go out, at wait_for's pace: the requests
        # carry a context to the traced fixture's Triton, which traced load crashes (docs/observability.md)
        end = time.monotonic() + 3

        def served_kserve():
            assert requests.post(f"{url}{INFER}", data=text_request(), timeout=60).status_code == 200
            return time.monotonic() > end
        wait_for(served_kserve, 30, "three more export rounds")
        assert log.read_text().count("are lost") == 1, log.read_text()
    finally:
        proc.terminate()
        proc.wait(30)


def test_sample_ratio_zero_traces_only_sampled_clients(start_server, tmp_path):
    """--otlp-sample-ratio 0: a request without a context is not traced (nor at Triton: no context goes there); a
    client's sampled traceparent still is. Spans leave in order, so once the sampled trace is in, an unsampled
    span sent before it would be too. A server of its own: no earlier test's spans can reach its receiver late."""
    triton_recv = Receiver()
    server = start_server(extra_args=triton_args(triton_recv.url))
    recv = Receiver()  # the gateway's spans; Triton's go to triton_recv
    gw = start_front(server, tmp_path / "gateway.log", f"--otlp-endpoint={recv.url}", "--otlp-sample-ratio=0")
    try:
        assert requests.post(f"{gw.url}/v1/embeddings", json={"input": "unsampled"}, timeout=60).status_code == 200
        assert requests.post(f"{gw.url}{INFER}", data=text_request(), timeout=60).status_code == 200
        trace_id, parent = "7bf92f3577b34da6a3ce929d0e0e4736", "30f067aa0ba902b7"
        r = requests.post(f"{gw.url}/v1/embeddings", json={"input": "sampled"}, timeout=60,
                          headers={"traceparent": f"00-{trace_id}-{parent}-01"})
        assert r.status_code == 200
        _triton_tree(_tree(triton_recv, trace_id, 6), _tree(recv, trace_id, 1).popitem()[0])
        for rc in (recv, triton_recv):
            with rc.lock:
                got = {(svc, s.name, s.trace_id.hex()) for svc, s in rc.spans}
            assert {t for *_, t in got} == {trace_id}, got
    finally:
        gw.stop()
        recv.server.shutdown()
        triton_recv.server.shutdown()


def test_triton_says_once_that_its_collector_is_unreachable(start_server, tmp_path):
    """Triton exporting to a closed port: the traced requests served; its exporter's errors (two lines per batch
    of spans, egemma.ops.tritonserver.OTLP_ERROR) passed on once."""
    server = start_server(extra_args=triton_args(f"http://127.0.0.1:{free_port()}"))
    c = grpcclient.InferenceServerClient(server.grpc_url)
    log = server.run_dir / "tritonserver.log"

    def served():
        tp = f"00-{os.urandom(16).hex()}-{os.urandom(8).hex()}-01"
        assert c.infer("embeddinggemma", [text_input(["x"])], headers={"traceparent": tp}).as_numpy("EMBEDDING").size
        return "its spans are lost" in log.read_text()
    wait_for(served, 60, "Triton to say its spans are lost")
    # a few more export rounds (one a second) of spans that cannot go out, at wait_for's pace: traced load crashes
    # Triton 2.51 (docs/observability.md), so a few dozen requests, not hundreds
    end = time.monotonic() + 3
    wait_for(lambda: served() and time.monotonic() > end, 30, "three more export rounds")
    assert log.read_text().count("OTLP HTTP Client") == 1, log.read_text()[-3000:]


@pytest.mark.parametrize("triton_spans", [False, True], ids=["default", "otlp-triton-spans"])
def test_launcher_traces_triton_only_when_asked(checkpoints, tmp_path, triton_spans):
    """The launcher with --otlp-endpoint: the gateway's spans of its requests arrive; Triton runs with a trace config,
    and its spans arrive, only with --otlp-triton-spans (traced load crashes Triton 2.51)."""
    recv, ports = Receiver(), [free_port() for _ in range(4)]
    la = Launcher([sys.executable, "-m", "egemma.ops.launcher", "--model", checkpoints["eos"], "--run-dir",
                   tmp_path / "run", "--http-port", ports[0], "--grpc-port", ports[1], "--metrics-port", ports[2],
                   "--triton-http-port", ports[3], "--gateway-workers", "1", "--otlp-endpoint", recv.url,
                   *(["--otlp-triton-spans"] if triton_spans else [])], tmp_path / "launcher")
    try:
        la.wait_ready()
        # a few traced requests: Triton 2.51 now and then exports none of a traced request's spans (2 in 120
        # requests straight to its gRPC, 2026-12-06), so its spans are asked of one of them
        trace_ids = [os.urandom(16).hex() for _ in range(3)]
        for trace_id in trace_ids:
            r = requests.post(f"http://127.0.0.1:{ports[0]}/v1/embeddings", json={"input": "x"}, timeout=60,
                              headers={"traceparent": f"00-{trace_id}-{os.urandom(8).hex()}-01"})
            assert r.status_code == 200, r.text
        traced = any(a.startswith("--trace-config") for a in argv(la.server_pid()))
        assert traced == triton_spans

        def arrived():
            services = [{svc for svc, _ in recv.trace(t)} for t in trace_ids]
            return (all("egemma-gateway" in s for s in services)
                    and (not triton_spans or any("egemma-triton" in s for s in services)))
        try:
            wait_for(arrived, 60, "the gateway's spans" + (" and Triton's" if triton_spans else ""))
        except AssertionError as e:
            got = [(svc, s.trace_id.hex(), s.name) for svc, s in recv.spans]
            raise AssertionError(f"{e}; traces {trace_ids}, received {got}") from None
    finally:
        la.close()
        recv.server.shutdown()


def test_triton_spans_without_a_collector_is_refused(capsys):
    from egemma.ops.launcher import parse
    with pytest.raises(SystemExit) as e:
        parse(["--otlp-triton-spans"])
    assert e.value.code == 2 and "--otlp-triton-spans needs --otlp-endpoint" in capsys.readouterr().err
