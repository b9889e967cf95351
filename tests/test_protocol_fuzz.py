"""Protocol-level fuzzing of every port the server exposes, with raw sockets and raw gRPC: the gateway's HTTP (lying
and malformed framing, slow, stalled and idle connections, huge headers, chunked bodies, binary-extension lengths
that contradict the body, shapes that overflow, BYTES length prefixes past the buffer, thousands of inputs, deep
JSON, the connection cap; the KServe cases on its fast lane and on its aiohttp path, the body-level ones on the
OpenAI and TEI routes too), Triton's gRPC port (no front: garbage frames and protobufs, odd and large messages,
huge metadata) and its metrics port. Every answer is an error or a correct result, nothing leaks (the gateway's
open file descriptors and connections are back where they were), and the server stays alive and exact."""
import gzip
import json
import os
import socket
import struct
import time

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as pb, service_pb2_grpc

from helpers import GOOD, assert_close, wait_for
from rawhttp import (INFER, binary_request, bytes_element, closed_by_peer, j, open_fds, read_responses, request,
                     start_front, tcp_connections, text_request, via_aiohttp)

pytestmark = pytest.mark.usefixtures("still_serving")
IDLE, BODY, CAP = 2.0, 2.0, 40  # the front's timeouts (s) for these tests, and a connection cap


@pytest.fixture(scope="module")
def front(server, tmp_path_factory):
    f = start_front(server, tmp_path_factory.mktemp("fuzz") / "front.log", f"--idle-timeout={IDLE}",
                    f"--body-timeout={BODY}")
    yield f
    f.stop()


@pytest.fixture
def no_leak(front):
    """The gateway holds as many descriptors and TCP connections after the test as before (give or take the
    pooled connections to Triton)."""
    pid = front.proc.pid
    fds, conns = open_fds(pid), tcp_connections(pid)
    yield
    wait_for(lambda: open_fds(pid) <= fds + 2 and tcp_connections(pid) <= conns + 2, IDLE + BODY + 10,
             f"the gateway's descriptors ({open_fds(pid)} vs {fds}) and connections ({tcp_connections(pid)} vs "
             f"{conns}) to be back")


def raw(port: int, data: bytes, timeout: float = 10.0) -> bytes | None:
    """Send data on a fresh connection; everything the peer sends until it closes, or None if it neither answered
    nor closed within timeout (a connection left hanging)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        out = b""
        try:
            s.sendall(data)
        except (BrokenPipeError, ConnectionResetError):  # the peer gave up on it early: read what it said
            pass
        try:
            while chunk := s.recv(65536):
                out += chunk
        except ConnectionResetError:
            pass
        except socket.timeout:
            return out or None
        return out


def status(reply: bytes | None) -> int:
    """The reply's HTTP status; 0: closed without an answer; -1: neither answered nor closed."""
    if reply is None:
        return -1
    return int(reply.split(b" ", 2)[1]) if reply.startswith(b"HTTP/1.") else 0


def post(body: bytes = b"", path: str = INFER, **headers) -> bytes:
    head = {"Host": "x", "Connection": "close", "Content-Length": str(len(body)), **headers}
    return (f"POST {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in head.items()) + "\r\n").encode() + body


ONE = text_request()
BIN, _ = binary_request(bytes_element(b"hello"))


def post_binary(blob: bytes, **kw) -> bytes:
    body, headers = binary_request(blob, **kw)
    return post(body, **headers)


# (name, raw bytes, expected statuses); 0: closed without an answer.
CASES = [
    ("content-length shorter than the body", post(ONE).replace(b"Content-Length: %d" % len(ONE),
                                                              b"Content-Length: 10"), {400}),
    ("content-length not a number", post(ONE, **{"Content-Length": "12x"}), {400}),
    ("content-length negative", post(ONE, **{"Content-Length": "-1"}), {400}),
    ("two content-lengths", post(ONE).replace(b"Host: x", b"Host: x\r\nContent-Length: 3"), {400}),
    ("content-length and chunked", post(ONE, **{"Transfer-Encoding": "chunked"}), {400}),
    ("header line of 100 kB", post(ONE, **{"X-Big": "a" * 100_000}), {400, 431}),
    ("200 headers", post(ONE, **{f"X-{k}": "1" for k in range(200)}), {400, 431}),
    ("URL of 100 kB", post(ONE, path=INFER + "?" + "a" * 100_000), {400, 414}),
    ("not HTTP", os.urandom(4096), {400, 0}),
    ("NUL bytes in the request line", b"POST /v2\x00/x HTTP/1.1\r\nHost: x\r\n\r\n", {400, 0}),
    ("unknown method", post(ONE).replace(b"POST", b"BREW", 1), {400, 405}),
    ("PUT", post(ONE).replace(b"POST", b"PUT", 1), {405}),
    ("chunk size not hex", (f"POST {INFER} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n").encode(),
     {400}),
    ("chunk size of 2^48, then a stall", (f"POST {INFER} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                                          "1000000000000\r\n" + "x" * 1000).encode(), {0, 400, 413}),
    ("content-length 10^6, 10 bytes, then a stall", post(ONE[:10], **{"Content-Length": "1000000"}), {0}),
    ("gzip that is not gzip", post(b"\x1f\x8bnot gzip at all", **{"Content-Encoding": "gzip"}), {400}),
    ("unknown content-encoding", post(ONE, **{"Content-Encoding": "br"}), {400, 415}),
    ("inference header length past the body", post(BIN, **{"Inference-Header-Content-Length": "100000"}), {400}),
    ("inference header length negative", post(BIN, **{"Inference-Header-Content-Length": "-5"}), {400}),
    ("inference header length 12abc", post(BIN, **{"Inference-Header-Content-Length": "12abc"}), {400}),
    ("inference header length mid-JSON", post(BIN, **{"Inference-Header-Content-Length": "20"}), {400}),
    ("inference header length 2^64", post(BIN, **{"Inference-Header-Content-Length": str(2 ** 64)}), {400}),
    ("binary_data_size past the body", post_binary(bytes_element(b"hi"), size=10 ** 9), {400}),
    ("binary_data_size of 2^64-1", post_binary(bytes_element(b"hi"), size=2 ** 64 - 1), {400}),
    ("BYTES length prefix past the buffer", post_binary(struct.pack("<I", 2 ** 31) + b"hi"), {400}),
    ("BYTES length prefix 2^32-1", post_binary(struct.pack("<I", 2 ** 32 - 1)), {400}),
    ("binary shape [2^63]", post_binary(bytes_element(b"hi"), shape=(2 ** 63,)), {400}),
    ("shape product overflowing int64", post(text_request(shape=[2 ** 32, 2 ** 32])), {400}),
    ("shape [2^62, 4] of FP32", post(text_request(datatype="FP32", shape=[2 ** 62, 4], data=[1.0])), {400}),
    ("negative dim", post(text_request(shape=[-1, 1])), {400}),
    ("5000 inputs", post(j({"inputs": [{"name": f"T{k}", "datatype": "BYTES", "shape": [1, 1], "data": ["x"]}
                                       for k in range(5000)]})), {400}),
    ("duplicate shape key", post(b'{"inputs": [{"name": "TEXT", "datatype": "INT8", "shape": [1000000000000000],'
                                 b' "shape": [1, 1], "data": [1]}]}'), {400}),
    ("JSON 101 deep in parameters", post(j({"inputs": [], "parameters": None}).replace(
        b"null", b'{"a": ' * 101 + b"1" + b"}" * 101)), {400}),
    ("deep JSON to repository index", post(b"[" * 5000 + b"]" * 5000, "/v2/repository/index"), {400}),
    ("invalid UTF-8 in a JSON text", post(ONE.replace(b"hello", b"\xff\xfe")), {400}),
    ("text of 1 MB + 1 byte", post(text_request(data=["a" * 1_000_001])), {400}),
    ("absolute-form target: still only Triton", b"GET http://169.254.169.254:80/v2/health/live HTTP/1.1\r\n"
                                               b"Host: x\r\nConnection: close\r\n\r\n", {200}),
]
# The OpenAI and TEI routes (aiohttp only) get the body-level attacks too: deep JSON, a gzip bomb, a chunked body
# past the limit, a stalled body.
BOMB = gzip.compress(b"[" * (64 << 20))  # 64 KiB that inflate to 64 MiB
MIB_CHUNK = b"100000\r\n" + b"a" * (1 << 20) + b"\r\n"
for route in ("/v1/embeddings", "/embed"):
    CASES += [
        (f"{route}: JSON 100k deep", post(b"[" * 100_000 + b"]" * 100_000, route), {400}),
        (f"{route}: gzip inflating to 64 MiB", post(BOMB, route, **{"Content-Encoding": "gzip"}), {413}),
        (f"{route}: 5 MiB chunked", f"POST {route} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
         "Transfer-Encoding: chunked\r\n\r\n".encode() + MIB_CHUNK * 5 + b"0\r\n\r\n", {413}),
        (f"{route}: 10 bytes of 10^6, then a stall", post(b'{"input": ', route, **{"Content-Length": "1000000"}),
         {0}),
    ]

@pytest.mark.usefixtures("no_leak")
@pytest.mark.parametrize("path", ["fast lane", "aiohttp"])
def test_the_gateway_answers_malformed_http_with_errors(front, path):
    """On both KServe paths (rawhttp.via_aiohttp); a stalled request must be closed by the gateway's deadlines,
    not left hanging past raw()'s own timeout."""
    for name, data, want in CASES:
        reply = raw(front.port, data if path == "fast lane" else via_aiohttp(data))
        assert status(reply) in want, (name, reply if reply is None else reply[:300])


@pytest.mark.usefixtures("no_leak")
def test_pipelined_http10_and_chunked_requests_are_served(front, good_ref):
    def one(t):
        return j({"inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": [t]}]})
    with socket.create_connection(("127.0.0.1", front.port), timeout=60) as s:  # two requests in one write
        s.sendall(b"".join(f"POST {INFER} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(one(t))}\r\n\r\n".encode()
                           + one(t) for t in GOOD[:2]))
        for k, (code, _, body) in enumerate(read_responses(s, 2)):  # both answers may come in one read
            assert code == 200, body
            assert_close(np.array(json.loads(body)["outputs"][-1]["data"], np.float32)[None], good_ref[k:k + 1])
    body = one(GOOD[2])
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 7]), body[i:i + 7]) for i in range(0, len(body), 7))
    reply = raw(front.port, f"POST {INFER} HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n".encode() + chunked
                + b"0\r\n\r\n", timeout=60)
    assert status(reply) == 200, reply[:300]
    out = {o["name"]: o for o in json.loads(reply.split(b"\r\n\r\n", 1)[1])["outputs"]}["EMBEDDING"]
    assert_close(np.array(out["data"], np.float32)[None], good_ref[2:3])


@pytest.mark.usefixtures("no_leak")
def test_slow_stalled_and_idle_connections_are_closed_while_others_are_served(front, good_ref):
    """30 connections that send nothing, half a header, or part of a body, and one that drips a body slower than
    the body timeout allows: each is closed by the front (idle / body timeout); a good request meanwhile is served."""
    stalls = []
    for k in range(30):
        s = socket.create_connection(("127.0.0.1", front.port), timeout=30)
        if k % 3 == 1:
            s.sendall(f"POST {INFER} HTTP/1.1\r\nHost: x\r\nContent-".encode())
        elif k % 3 == 2:
            s.sendall(f"POST {INFER} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(ONE)}\r\n\r\n".encode() + ONE[:9])
        stalls.append(s)
    drip = socket.create_connection(("127.0.0.1", front.port), timeout=30)
    drip.sendall(f"POST {INFER} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(ONE)}\r\n\r\n".encode())
    code, _, body = request(front.port, body=j({"inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES",
                                                            "data": [GOOD[4]]}]}), timeout=60)
    assert code == 200, body
    assert_close(np.array(json.loads(body)["outputs"][-1]["data"], np.float32)[None], good_ref[4:5])
    start = time.monotonic()
    for byte in ONE[:int((BODY + 1) / 0.25)]:  # one byte every 0.25 s: the whole body would take too long
        try:
            drip.sendall(bytes([byte]))
        except OSError:
            break
        time.sleep(0.25)  # the client's pace is the point of this case
    assert closed_by_peer(drip, 5), "a body dripping past the body timeout was not cut off"
    assert time.monotonic() - start < BODY + 6
    for s in stalls:
        assert closed_by_peer(s, IDLE + BODY + 5), "a stalled connection was kept open"
        s.close()
    drip.close()


def test_connections_over_the_cap_get_a_503_and_the_cap_frees_up(server, tmp_path):
    f = start_front(server, tmp_path / "front.log", f"--max-connections={CAP}", "--idle-timeout=60")
    try:
        held = [socket.create_connection(("127.0.0.1", f.port), timeout=10) for _ in range(CAP)]
        wait_for(lambda: tcp_connections(f.proc.pid, f.port) >= CAP, 10, "the front to accept them all")
        reply = raw(f.port, post(ONE))
        assert status(reply) == 503 and b"too many connections" in reply, reply
        for s in held:
            s.close()
        wait_for(lambda: status(raw(f.port, post(ONE))) == 200, 10, "the cap to free up")
        wait_for(lambda: tcp_connections(f.proc.pid, f.port) <= 2, 10, "the held connections to be gone")
    finally:
        f.stop()


# ------------------------------------------------------------------------- Triton's own gRPC and metrics ports

def _grpc_cases(server):
    ch = grpc.insecure_channel(server.grpc_url, options=[("grpc.max_send_message_length", -1),
                                                         ("grpc.max_receive_message_length", -1)])
    stub = service_pb2_grpc.GRPCInferenceServiceStub(ch)
    raw_infer = ch.unary_unary("/inference.GRPCInferenceService/ModelInfer")

    def req(shape, dtype="BYTES", raw_contents=(bytes_element(b"hi"),), n_inputs=1):
        r = pb.ModelInferRequest(model_name="embeddinggemma")
        for k in range(n_inputs):
            t = r.inputs.add()
            t.name, t.datatype = "TEXT" if n_inputs == 1 else f"T{k}", dtype
            t.shape.extend(shape)
        r.raw_input_contents.extend(list(raw_contents) * (n_inputs if len(raw_contents) == 1 else 1))
        return r
    return ch, [
        ("garbage protobuf", lambda: raw_infer(os.urandom(100_000), timeout=30)),
        ("empty protobuf", lambda: raw_infer(b"", timeout=30)),
        ("shape 1e15 INT8", lambda: stub.ModelInfer(req([10 ** 15], "INT8", [b"x"]), timeout=30)),
        ("shape 2^63-1", lambda: stub.ModelInfer(req([2 ** 63 - 1, 1]), timeout=30)),
        ("shape overflowing int64", lambda: stub.ModelInfer(req([2 ** 32, 2 ** 32]), timeout=30)),
        ("BYTES prefix past the buffer", lambda: stub.ModelInfer(req([1, 1], raw_contents=[
            struct.pack("<I", 2 ** 31) + b"hi"]), timeout=30)),
        ("more raw contents than inputs", lambda: stub.ModelInfer(req([1, 1], raw_contents=[b"a", b"b", b"c"]),
                                                                  timeout=30)),
        ("typed contents against a huge shape", lambda: stub.ModelInfer(pb.ModelInferRequest(
            model_name="embeddinggemma", inputs=[pb.ModelInferRequest.InferInputTensor(
                name="TEXT", datatype="BYTES", shape=[10 ** 15, 1],
                contents=pb.InferTensorContents(bytes_contents=[b"hi"]))]), timeout=30)),
        ("2000 inputs", lambda: stub.ModelInfer(req([1, 1], n_inputs=2000), timeout=30)),
        ("64 MiB message", lambda: stub.ModelInfer(req([1, 1], raw_contents=[bytes_element(b"a" * (64 << 20))]),
                                                   timeout=120)),
        ("1 MiB of metadata", lambda: stub.ServerLive(pb.ServerLiveRequest(), metadata=[("x-big", "a" * (1 << 20))],
                                                      timeout=30)),
        ("unknown model", lambda: stub.ModelInfer(pb.ModelInferRequest(model_name="x" * 100_000), timeout=30)),
    ]


def test_triton_grpc_port_survives_odd_messages_and_frames(server, good_ref):
    ch, cases = _grpc_cases(server)
    for name, call in cases:
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() != grpc.StatusCode.UNAVAILABLE, (name, e.value)
    ch.close()
    h2 = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    for data in (b"POST / HTTP/1.1\r\nContent-Length: 100000000\r\n\r\n" + b"x" * 100_000, os.urandom(1 << 20),
                 h2 + b"\xff\xff\xff\x00\x00\x00\x00\x00\x00" + os.urandom(100_000),  # a 16 MiB frame, cut short
                 h2 + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00" + b"\x00\x00\x04\x01\x00\x00\x00\x01" * 1000):
        raw(server.grpc_port, data, timeout=5)
    idle = [socket.create_connection(("127.0.0.1", server.grpc_port)) for _ in range(50)]
    import tritonclient.grpc as grpcclient
    from helpers import text_input
    c = grpcclient.InferenceServerClient(server.grpc_url)
    assert_close(c.infer("embeddinggemma", [text_input(GOOD[:2])], client_timeout=60).as_numpy("EMBEDDING"),
                 good_ref[:2])
    for s in idle:
        s.close()


def test_triton_metrics_port_survives_raw_http(server):
    port = server.metrics_port
    for data in (post(os.urandom(16 << 20), "/metrics"), post(b"", "/metrics", **{"X-Big": "a" * 1_000_000}),
                 os.urandom(1 << 20), b"GET /metrics HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
                 b"GET /" + b"a" * 100_000 + b" HTTP/1.1\r\n\r\n"):
        raw(port, data, timeout=5)
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(50)]
    half = [socket.create_connection(("127.0.0.1", port)) for _ in range(20)]
    for s in half:
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
    reply = raw(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", timeout=30)
    assert status(reply) == 200 and b"nv_inference_request_success" in reply, reply[:300]
    for s in idle + half:
        s.close()
