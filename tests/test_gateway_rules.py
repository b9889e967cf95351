"""The gateway's pure rules, in milliseconds and without a server: admission (the API key, the body limit, the
encoding, what Triton 2.51 crashes on: check_kserve, json_depth), the fast lane's head parsing, the error mapping per
protocol, and the OpenAI / TEI input rules. tests/test_front.py, test_fastlane.py, test_openai.py, test_tei.py and
test_api_key.py hold the same rules end to end, through the real gateway and tritonserver."""
import json

import pytest

from egemma.gateway.admission import MAX_JSON_DEPTH, admit, check_kserve, json_depth, needs_key
from egemma.gateway.app import read_key
from egemma.gateway.common import Gateway
from egemma.gateway.errors import STATUS, GatewayError, Kind, Protocol, from_exception, protocol, raw, render
from egemma.gateway.fastlane import parse_head
from egemma.gateway.protocol import openai_embed, openai_input, options, tei_embed, tei_inputs
from egemma.gateway.upstream import UpstreamError

INFER = "/v2/models/embeddinggemma/infer"


def gw(key: bytes | None = None, max_body: int = 1000) -> Gateway:
    return Gateway(triton_http="127.0.0.1:1", triton_grpc="127.0.0.1:8001", max_body=max_body, api_key=key)


def kind_of(fn, *args) -> Kind | None:
    try:
        fn(*args)
    except GatewayError as e:
        return e.kind
    return None


def headers(**h) -> callable:
    """admit's view of headers given as keyword arguments (underscores for dashes)."""
    d = {k.replace("_", "-").encode(): v.encode() for k, v in h.items()}
    return d.get


def test_json_depth():
    assert json_depth(b'{"a": [1, 2, {"b": 3}]}') == 3  # few brackets: their count bounds the depth
    deep = b"[" * 500 + b"]" * 500
    assert json_depth(deep) == 500
    flat = b"[" + b"[1]," * 500 + b"[1]]"  # many brackets, shallow
    assert json_depth(flat) == 2
    assert json_depth(b'["' + b"[" * 500 + b'"]') == 1  # brackets inside a string do not nest
    assert json_depth(b'["\\"' + b"[" * 500 + b'"]') == 1  # nor after an escaped quote


@pytest.mark.parametrize("ihcl,body,want", [
    (None, json.dumps({"inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": ["x"]}]}), None),
    (None, '{"inputs": [], "inputs": []}', Kind.MALFORMED),  # duplicate keys: Triton reads the first, we the last
    (None, "{not json", Kind.MALFORMED),
    (None, "[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1), Kind.MALFORMED),
    (None, json.dumps({"inputs": [{"name": "T", "shape": [10 ** 15], "datatype": "INT8", "data": [1]}]}),
     Kind.VALIDATION),  # more elements than the JSON can carry: Triton aborts allocating them
    (None, json.dumps({"inputs": [{"name": "T", "shape": [2 ** 63], "datatype": "INT8", "data": [1]}]}),
     Kind.VALIDATION),
    (None, json.dumps({"inputs": [{"name": "T", "shape": [-1], "datatype": "INT8", "data": [1]}]}), Kind.VALIDATION),
    (None, json.dumps({"inputs": [{"name": "T", "shape": [10 ** 6], "datatype": "INT8",
                                   "parameters": {"binary_data_size": 10 ** 6}}]}), None),  # Triton checks that one
    (b"7", '{"a":1}xxxx', None),
    (b"0", "raw tensor bytes", None),
    (b"999", "{}", Kind.MALFORMED),  # past the body
    (b"-1", "{}", Kind.MALFORMED),
    (b"9" * 5000, "{}", Kind.MALFORMED),
    # what Triton 2.51 answers with a 500 (tests/test_fuzz.py finds each on every route)
    (None, json.dumps({"inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": ["a\ud800"]}]}),
     Kind.MALFORMED),  # a lone surrogate escape
    (None, json.dumps({"inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": ["\U0001F680"]}]}),
     None),  # a pair, as json.dumps writes it
    (None, json.dumps({"inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": [1]}]}),
     Kind.VALIDATION),  # a number in BYTES data
    (None, json.dumps({"inputs": [{"name": "X", "shape": [1, 2], "datatype": "INT32", "data": [2, 2 ** 63]}]}),
     Kind.VALIDATION),
    (None, json.dumps({"inputs": [{"name": "X", "shape": [1, 2], "datatype": "INT32", "data": [2, 2 ** 31]}]}),
     Kind.VALIDATION),  # Triton would wrap it
    (None, json.dumps({"inputs": [{"name": "X", "shape": [1, 2], "datatype": "INT32", "data": [[2, -2 ** 31]]}]}),
     None),
    (None, json.dumps({"inputs": [{"name": "X", "shape": [1], "datatype": "UINT8", "data": [-1]}]}), Kind.VALIDATION),
    (None, json.dumps({"inputs": [{"name": "X", "shape": [1], "datatype": "INT32", "data": [2, 5]}]}),
     Kind.VALIDATION),  # more data than the shape
    (None, json.dumps({"id": 5, "inputs": []}), Kind.VALIDATION),
    (None, json.dumps({"inputs": [], "parameters": [1]}), Kind.VALIDATION),
    (None, json.dumps({"inputs": [], "outputs": [{"name": "E", "parameters": {"binary_data": "yes"}}]}),
     Kind.VALIDATION),
    (None, json.dumps({"inputs": [], "parameters": {"prompt": "a\u0000b"}}), Kind.VALIDATION),  # Triton cuts at NUL
])
def test_check_kserve(ihcl, body, want):
    assert kind_of(check_kserve, INFER, ihcl, body.encode()) == want


def test_check_kserve_parses_only_infer_bodies():
    assert kind_of(check_kserve, "/v2/models/embeddinggemma/generate", None, b"{not json") is None
    deep = b'{"TEXT": ' + b"[" * 1000 + b"]" * 1000 + b"}"
    assert kind_of(check_kserve, "/v2/models/embeddinggemma/generate", None, deep) is Kind.MALFORMED


def req(line: str, *hdrs: str, body: bytes = b"") -> bytes:
    return (line + "\r\n" + "".join(h + "\r\n" for h in hdrs) + "\r\n").encode() + body


def test_parse_head_takes_plain_kserve_requests():
    head = parse_head(req(f"POST {INFER}?x=1 HTTP/1.1", "Host: x", "Content-Length: 3", "Api-Key:  k \t",
                          body=b"abc"))
    path, h, start, n = head
    assert path == INFER and n == 3 and h[b"api-key"] == b"k" and h[b"host"] == b"x"
    assert parse_head(req("GET /v2 HTTP/1.1", "Host: x"))[2:] == (len(req("GET /v2 HTTP/1.1", "Host: x")), 0)
    assert parse_head(req(f"POST {INFER} HTTP/1.1", "Content-Length: 3")[:-2]) is None  # head not complete yet


@pytest.mark.parametrize("data", [
    req(f"POST {INFER} HTTP/1.1", "Host: x"),  # no length: aiohttp knows what that means
    req(f"POST {INFER} HTTP/1.1", "Transfer-Encoding: chunked"),
    req(f"POST {INFER} HTTP/1.1", "Content-Length: 1", "Content-Encoding: gzip"),
    req(f"POST {INFER} HTTP/1.1", "Content-Length: 01"),
    req(f"POST {INFER} HTTP/1.1", "Content-Length: 1", "Content-Length: 1"),
    req(f"POST {INFER} HTTP/1.1", "Content-Length: 1", "Expect: 100-continue"),
    req(f"POST {INFER} HTTP/1.1", "Content-Length: 1", "Connection: upgrade"),
    req(f"POST {INFER} HTTP/1.0", "Content-Length: 1"),
    req("POST /v2/models/embedding%67emma/infer HTTP/1.1", "Content-Length: 1"),
    req("PUT /v2 HTTP/1.1", "Content-Length: 1"),
    req("POST /v1/embeddings HTTP/1.1", "Content-Length: 1"),
    req("GET /v2/health/ready HTTP/1.1"),
    req("GET /v2 HTTP/1.1", "Bad Header: x"),
    b"GET /v2 HTTP/1.1\r\n" + b"X: " + b"y" * 9000,  # no head end within 8 KiB
])
def test_parse_head_hands_anything_else_to_aiohttp(data):
    assert parse_head(data) is False


def test_needs_key():
    for path in (INFER, "/v2/models/embeddinggemma/versions/1/infer", "/v2/models/m/generate",
                 "/v2/models/m/generate_stream", "/v1/embeddings", "/v1/models", "/embed", "/", "/tokenize", "/info"):
        assert needs_key(path), path
    for path in ("/v2", "/v2/health/ready", "/v2/models/embeddinggemma", "/v2/models/embeddinggemma/config",
                 "/v2/models/stats", "/health", "/metrics"):
        assert not needs_key(path), path


def test_admit_the_api_key():
    g = gw(b"s3cret")
    assert kind_of(admit, gw(), INFER, headers()) is None  # no key configured: open
    assert kind_of(admit, g, "/v2/models/embeddinggemma", headers()) is None  # metadata: open
    for path, h, want in [
        (INFER, headers(), Kind.UNAUTHORIZED),
        (INFER, headers(authorization="Bearer s3cret"), None),
        (INFER, headers(api_key="s3cret"), None),  # Triton's header, on KServe routes
        (INFER, headers(authorization="Bearer wrong"), Kind.UNAUTHORIZED),
        (INFER, headers(authorization="s3cret"), Kind.UNAUTHORIZED),
        # the credential rule: one credential, given once, its surrounding whitespace not part of it
        (INFER, headers(authorization="Bearer s3cret", api_key="wrong"), Kind.UNAUTHORIZED),
        (INFER, headers(authorization="Bearer s3cret", api_key="s3cret"), Kind.UNAUTHORIZED),
        (INFER, headers(api_key="s3cret, s3cret"), Kind.UNAUTHORIZED),  # aio_header's join of a repeated header
        (INFER, headers(api_key="s3cret, wrong"), Kind.UNAUTHORIZED),
        (INFER, headers(api_key=" \ts3cret \t"), None),
        (INFER, headers(authorization="Bearer s3cret  "), None),
        (INFER, headers(api_key="s3cr et"), Kind.UNAUTHORIZED),
        ("/v1/embeddings", headers(authorization="Bearer s3cret"), None),
        ("/v1/embeddings", headers(api_key="s3cret"), Kind.UNAUTHORIZED),  # OpenAI's and TEI's: Bearer only
        ("/embed", headers(api_key="s3cret"), Kind.UNAUTHORIZED),
        ("/embed", headers(authorization="Bearer s3cret\xff"), Kind.UNAUTHORIZED),
        ("/health", headers(), None),
    ]:
        assert kind_of(admit, g, path, h) == want, (path, h(b"authorization"), h(b"api-key"))


def test_admit_the_body_limit_and_encoding():
    g = gw(max_body=1000)
    assert kind_of(admit, g, INFER, headers(content_length="1000")) is None
    assert kind_of(admit, g, INFER, headers(content_length="0" * 5000 + "1001")) is Kind.TOO_LARGE
    assert kind_of(admit, g, "/embed", headers(content_length="1001")) is Kind.TOO_LARGE
    for enc in ("gzip", "deflate", "identity", " GZIP "):
        assert kind_of(admit, g, INFER, headers(content_encoding=enc)) is None
    assert kind_of(admit, g, INFER, headers(content_encoding="br")) is Kind.UNSUPPORTED_MEDIA
    try:
        admit(g, INFER, headers(content_length="5000"))
    except GatewayError as e:
        assert "1000" in str(e) and "8001" in str(e)  # the limit, and the gRPC port that takes more


def test_errors_map_once_per_protocol():
    e = GatewayError(Kind.VALIDATION, "bad dimensions", "dimensions")
    assert render(e, Protocol.KSERVE) == (400, b'{"error":"bad dimensions"}')
    status, body = render(e, Protocol.OPENAI)
    assert status == 400 and json.loads(body) == {"error": {
        "message": "bad dimensions", "type": "invalid_request_error", "param": "dimensions", "code": None}}
    status, body = render(e, Protocol.TEI)
    assert status == 422 and json.loads(body) == {"error": "bad dimensions", "error_type": "Validation"}
    for kind in Kind:  # every kind has a status in every protocol, and the TEI types are TEI's
        for p in Protocol:
            status, body = render(GatewayError(kind, "m"), p)
            assert 400 <= status < 600 and status == STATUS[p][kind]
        assert json.loads(render(GatewayError(kind, "m"), Protocol.TEI)[1])["error_type"] in (
            "Validation", "Empty", "Backend", "Overloaded", "Unhealthy", "Tokenizer")
    assert render(GatewayError(Kind.EMPTY, "m"), Protocol.TEI)[0] == 400
    assert render(GatewayError(Kind.BACKEND, "m"), Protocol.TEI)[0] == 424
    assert render(GatewayError(Kind.OVERLOADED, "m"), Protocol.OPENAI)[0] == 429
    status, body = render(GatewayError(Kind.UNAUTHORIZED, "key"), Protocol.OPENAI)
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    answer = raw(GatewayError(Kind.UNAUTHORIZED, "key"), Protocol.TEI, close=True)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 401 Unauthorized\r\n") and b"\r\nConnection: close" in head
    assert b"\r\nWWW-Authenticate: Bearer" in head and f"Content-Length: {len(body)}".encode() in head
    assert [protocol(p) for p in ("/v2/x", "/v1/embeddings", "/embed", "/")] == [
        Protocol.KSERVE, Protocol.OPENAI, Protocol.TEI, Protocol.TEI]


def test_failures_to_reach_triton():
    assert from_exception(UpstreamError("closed")).kind is Kind.BACKEND
    assert from_exception(ConnectionRefusedError()).kind is Kind.UNHEALTHY
    assert from_exception(TimeoutError()).kind is Kind.UNHEALTHY
    assert from_exception(KeyError("bug")).kind is Kind.INTERNAL
    e = GatewayError(Kind.EMPTY, "x")
    assert from_exception(e) is e


def test_openai_input_rules():
    assert openai_input("hi") == ["hi"]
    assert openai_input([1, 2]) == [[1, 2]]  # a flat list of ids is one input
    assert openai_input([[1] * 3000]) == [[1] * 3000]  # lists of ids are cut later, as text
    for x, kind, fragment in [
        ([1] * 2049, Kind.VALIDATION, "one list of 2049 token ids"),
        (["a"] * 2049, Kind.VALIDATION, "2049 inputs"),
        ([[1]] * 2049, Kind.VALIDATION, "2049 inputs"),
        ("", Kind.EMPTY, "empty string"),
        (["a", ""], Kind.EMPTY, r"input\[1\]"),
        ([], Kind.VALIDATION, "not empty"),
        ([[]], Kind.VALIDATION, "non-empty"),
        ({"a": 1}, Kind.VALIDATION, "input must be"),
    ]:
        with pytest.raises(GatewayError, match=fragment) as e:
            openai_input(x)
        assert e.value.kind is kind and e.value.param == "input"


def test_tei_input_rules():
    assert tei_inputs("hi", ids_ok=True) == ["hi"] and tei_inputs([5, 6], ids_ok=True) == [[5, 6]]
    for x, ids_ok, kind in [("", True, Kind.EMPTY), (["a", ""], False, Kind.EMPTY), ([], True, Kind.EMPTY),
                            ([[]], True, Kind.EMPTY), ([5, 6], False, Kind.VALIDATION),
                            ({"a": 1}, True, Kind.VALIDATION)]:
        assert kind_of(tei_inputs, x, ids_ok) is kind, x


def test_options_are_checked_before_they_reach_triton():
    """tritonclient refuses a parameter of another type without a gRPC status: a client's mistake, so checked here."""
    assert options({"prompt_name": "query", "truncate": False, "dimensions": None}, ("prompt_name", "truncate",
                                                                                      "dimensions")) == \
        {"prompt_name": "query", "truncate": False}
    for k, v in [("prompt_name", {}), ("prompt", ["x"]), ("truncate", {}), ("truncate", 1), ("dimensions", True),
                 ("dimensions", "32")]:
        with pytest.raises(GatewayError, match=k) as e:
            options({k: v}, (k,))
        assert e.value.kind is Kind.VALIDATION and e.value.param == k


@pytest.mark.parametrize("body, param", [
    ({"input": [], "dimensions": "32"}, "dimensions"),  # every field's own check before the input's
    ({"input": [], "chunk_overlap": 1}, "input"),  # the options' combination rules last
    ({"input": ["a", ""], "truncate": False, "long_text": "chunk"}, "input"),
    ({"input": [[1]], "prompt": "q", "chunk_overlap": 1}, "prompt"),  # a prompt with token ids before combinations
    ({"input": "a", "chunk_overlap": 1}, None),
])
def test_a_body_with_several_bad_fields_is_told_of_the_first(body, param):
    with pytest.raises(GatewayError) as e:
        openai_embed(json.dumps(body).encode(), Gateway(triton_http="h:1", triton_grpc="h:2"))
    assert e.value.param == param, e.value


def test_tei_prompt_with_token_ids_is_refused_with_its_field():
    """Before any embedding: TEI's truncation_direction=left note belongs to errors of inputs that need cutting."""
    with pytest.raises(GatewayError, match=r"prompt_name applies to text inputs; with token ids, put the prompt's ids "
                                           r"first$") as e:
        tei_embed(json.dumps({"inputs": [[1, 2]], "prompt_name": "query", "truncation_direction": "left"}).encode())
    assert e.value.param == "prompt_name" and e.value.kind is Kind.VALIDATION


def test_the_key_file(tmp_path):
    """One word of printable ASCII; the newline a secret file may end with is not part of it."""
    f = tmp_path / "key"
    f.write_text("s3cret\n")
    assert read_key(str(f)) == b"s3cret" and read_key(None) is None
    for bad in ("", "\n", "two words", "k\x01ey", "ключ"):
        f.write_text(bad)
        with pytest.raises(SystemExit, match="printable ASCII"):
            read_key(str(f))


def test_the_retry_rule():
    """What counts as the server restarting (egemma.gateway.retry.restarting): tried again; anything else is the
    answer."""
    from tritonclient.utils import InferenceServerException as E

    from egemma.gateway.retry import restarting
    from egemma.gateway.upstream import UpstreamError
    dead = ("in ensemble 'embeddinggemma', Failed to process the request(s) for model instance 'x', message: Stub "
            "process 'x' is not healthy.")
    for outcome in (ConnectionRefusedError(), UpstreamError("Triton closed the connection"), TimeoutError(),
                    E(dead, status="StatusCode.INTERNAL"), E("Socket closed", status="StatusCode.UNAVAILABLE"),
                    (b"HTTP/1.1 500 Internal Server Error\r\n\r\n" + dead.encode(), 500, {}, 38),
                    (500, {}, dead.encode())):
        assert restarting(outcome), outcome
    for outcome in (E("This protocol is restricted, expecting header 'triton-grpc-protocol-api-key'",
                      status="StatusCode.UNAVAILABLE"),
                    E("in ensemble 'embeddinggemma', Request timeout expired", status="StatusCode.UNAVAILABLE"),
                    E("dimensions must be an integer", status="StatusCode.INVALID_ARGUMENT"),
                    E("engine failure: out of memory", status="StatusCode.INTERNAL"),
                    (b"HTTP/1.1 400 Bad Request\r\n\r\n{}", 400, {}, 28), (500, {}, b'{"error":"other"}'),
                    (200, {}, dead.encode())):
        assert not restarting(outcome), outcome


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
@pytest.mark.parametrize("lost", [False, True])  # connection_lost not yet run / already run
def test_a_request_on_a_connection_closed_before_it_went_out_is_answered(loop, lost):
    """Triton killed between the gateway's connect and its send (a restart): the request gets an UpstreamError,
    which the gateway retries, never silence (a KServe request through the fast lane once waited for its client's
    timeout: uvloop raised on the write, in a task nobody awaited)."""
    import asyncio
    from egemma.gateway.upstream import _Conn
    policy = asyncio.DefaultEventLoopPolicy() if loop == "asyncio" else pytest.importorskip("uvloop").EventLoopPolicy()

    async def run():
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        _, conn = await asyncio.get_running_loop().create_connection(_Conn, "127.0.0.1", port)
        conn.transport.close()
        if lost:  # connection_lost is called soon after close: let it run
            for _ in range(100):
                if conn.closed:
                    break
                await asyncio.sleep(0)
            assert conn.closed
        got = []
        conn.start(b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n", got.append)
        server.close()
        return got
    with asyncio.Runner(loop_factory=policy.new_event_loop) as runner:
        got = runner.run(run())
    assert len(got) == 1 and isinstance(got[0], UpstreamError), got
