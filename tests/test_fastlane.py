"""The gateway's fast lane (egemma.gateway.fastlane), seen from outside: a plain KServe request is answered with
Triton's own answer, byte for byte (no aiohttp `Server` header), also pipelined; a request the lane does not take
(chunked, compressed, HTTP/1.0, a health route) is answered by aiohttp, which adds its `Server` header, on the same
connection, which stays correct afterwards; SIGTERM lets the answer in flight out, with `Connection: close`."""
import gzip
import json
import signal
import socket
import time

import numpy as np
import pytest

from egemma.ops.procfs import rss_kb
from egemma.stub.instance import read_heartbeats
from helpers import GOOD, assert_close, wait_for
from rawhttp import INFER, j, read_responses, start_front

pytestmark = pytest.mark.usefixtures("still_serving")


@pytest.fixture(scope="module")
def front(server, tmp_path_factory):
    f = start_front(server, tmp_path_factory.mktemp("lane") / "front.log")
    yield f
    f.stop()


def one(text: str) -> bytes:
    return j({"inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": [text]}],
              "outputs": [{"name": "EMBEDDING"}]})


def head(path: str, body: bytes | None, **headers) -> bytes:
    h = {"Host": "x", **({"Content-Length": str(len(body))} if body is not None else {}), **headers}
    return f"{'POST' if body is not None else 'GET'} {path} HTTP/1.1\r\n".encode() + \
        b"".join(f"{k}: {v}\r\n".encode() for k, v in h.items()) + b"\r\n" + (body or b"")


def exchange(port: int, *requests: bytes) -> list[tuple[int, dict, bytes]]:
    """requests sent in one write on one connection; their answers in order."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(b"".join(requests))
        return read_responses(s, len(requests))


def embedding(body: bytes) -> np.ndarray:
    return np.array(json.loads(body)["outputs"][0]["data"], np.float32)[None]


def test_plain_requests_get_tritons_own_answer(front, server, good_ref):
    """Each as Triton's own HTTP answers it: status, headers and body (an embedding: equal within tolerance)."""
    cases = [head(INFER, one(GOOD[0])), head("/v2/models/embeddinggemma", None),
             head("/v2/models/embeddinggemma/config", None), head("/v2", None),
             head(INFER, j({"inputs": [{"name": "NOPE", "shape": [1, 1], "datatype": "BYTES", "data": ["x"]}]})),
             head("/v2/models/embeddinggemma/infer?x=1", one(GOOD[1]), Connection="keep-alive")]
    for req in cases:
        (want,), (got,) = exchange(server.http_port, req), exchange(front.port, req)
        assert got[0] == want[0] and "server" not in got[1], (req[:80], got[:2])
        assert {k: v for k, v in got[1].items() if k != "content-length"} == \
            {k: v for k, v in want[1].items() if k != "content-length"}, req[:80]
        if b"outputs" in req:
            assert_close(embedding(got[2]), embedding(want[2]))
        else:
            assert got[2] == want[2], req[:80]
    answers = exchange(front.port, *(head(INFER, one(t)) for t in GOOD[:4]))  # pipelined, in order
    for k, (code, h, body) in enumerate(answers):
        assert code == 200 and "server" not in h, body
        assert_close(embedding(body), good_ref[k:k + 1])


def test_a_connection_the_lane_hands_to_aiohttp_keeps_serving(front, good_ref):
    body = one(GOOD[5])
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    answers = exchange(front.port, head(INFER, one(GOOD[4])),
                       head(INFER, None, **{"Transfer-Encoding": "chunked"}).replace(b"GET", b"POST", 1) + chunked,
                       head(INFER, one(GOOD[6])))
    assert [("server" in h) for _, h, _ in answers] == [False, True, True], [h for _, h, _ in answers]
    for k, (code, _, b) in zip((4, 5, 6), answers):
        assert code == 200, b
        assert_close(embedding(b), good_ref[k:k + 1])
    for req in (head(INFER, gzip.compress(one(GOOD[7])), **{"Content-Encoding": "gzip"}),
                head(INFER, one(GOOD[7])).replace(b"HTTP/1.1", b"HTTP/1.0", 1)):
        (code, h, b), = exchange(front.port, req)
        assert code == 200 and "aiohttp" in h.get("server", ""), (req[:60], h)
        assert_close(embedding(b), good_ref[7:8])
    (code, h, b), = exchange(front.port, head("/v2/health/ready", None))
    assert code == 200 and "aiohttp" in h.get("server", ""), h


def _busy(server, since: float) -> bool:
    """Whether a model instance is inside an execute that began after since (time.monotonic, as the stamps)."""
    return any(begin > max(end, since) for begin, end, _, _ in read_heartbeats(server.heartbeat_dir).values())


def test_sigterm_lets_the_answer_in_flight_out(server, tmp_path, good_ref):
    f = start_front(server, tmp_path / "front.log")
    texts = [(" ".join(GOOD) + " ") * 12] * 3 + [GOOD[8]]  # ~1.5 s on the CPU box, under the 10 s drain
    body = j({"inputs": [{"name": "TEXT", "shape": [len(texts), 1], "datatype": "BYTES", "data": texts}],
              "outputs": [{"name": "EMBEDDING"}]})
    with socket.create_connection(("127.0.0.1", f.port), timeout=120) as s:
        sent = time.monotonic()
        s.sendall(head(INFER, body))
        wait_for(lambda: _busy(server, sent), 60, "the request to reach a model")
        f.proc.send_signal(signal.SIGTERM)
        (code, h, b), = read_responses(s, 1)
    assert code == 200 and h.get("connection") == "close", (code, h, b[:200])
    out = np.array(json.loads(b)["outputs"][0]["data"], np.float32).reshape(len(texts), -1)
    assert_close(out[-1:], good_ref[8:9])
    assert f.proc.wait(30) == 0


def _rss_mb(pid: int) -> float:
    kb = rss_kb(pid)
    assert kb >= 0, f"process {pid} is gone"
    return kb / 1024


def test_a_client_that_pipelines_without_reading_is_stopped_not_buffered(front):
    """Requests sent and answers never read: the gateway stops reading that connection (our send blocks) instead
    of holding what comes; its memory stays flat."""
    rss, sent = _rss_mb(front.proc.pid), 0
    chunk = head("/v2/models/embeddinggemma/config", None) * 1000
    with socket.create_connection(("127.0.0.1", front.port), timeout=5) as s:
        try:
            while sent < 256 << 20:
                s.sendall(chunk)
                sent += len(chunk)
        except socket.timeout:
            pass
        assert sent < 64 << 20, f"the gateway took {sent >> 20} MiB of requests it could not answer"
        assert _rss_mb(front.proc.pid) - rss < 64, (rss, _rss_mb(front.proc.pid))


def test_pipelined_requests_refused_on_the_spot_are_each_answered(front, good_ref):
    """2000 refused requests between two good ones in one write: 2002 answers in order (the lane loops, it does not
    recurse), and odd lengths get answers, not a dropped connection."""
    bad = head(INFER, b"x")
    got = exchange(front.port, head(INFER, one(GOOD[9])), *[bad] * 2000, head(INFER, one(GOOD[10])))
    assert [a[0] for a in got] == [200] + [400] * 2000 + [200], {a[0] for a in got}
    assert_close(np.concatenate([embedding(got[0][2]), embedding(got[-1][2])]), good_ref[9:11])
    for req, want in ((head(INFER, one(GOOD[11]))
                       .replace(b"Content-Length: ", b"Content-Length: " + b"0" * 5000), {200}),  # digits: valid
                      (head(INFER, one(GOOD[11]), **{"Inference-Header-Content-Length": "9" * 5000}), {400}),
                      (head(INFER, one(GOOD[11])).replace(b"Content-Length: ", b"Content-Length:\t"), {200})):
        (code, _, b), = exchange(front.port, req)
        assert code in want, (req[:120], code, b[:200])
