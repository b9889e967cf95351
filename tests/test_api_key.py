"""The API key on every inference port, through the real launcher (`--api-key-file`, as the k8s manifests run it):
every inference route without a key, with a wrong one and with the right one, over the gateway's HTTP (KServe on
its fast lane and on its aiohttp path, OpenAI, TEI), Triton's gRPC and Triton's own loopback HTTP; each refusal
in its protocol's shape; health, metadata and metrics open without a key; the watchdog's canary passing (its
verdict is what /v2/health/live answers); the key in no log."""
import gzip
import json
import sys

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from helpers import GOOD, Launcher, assert_close, text_input
from rawhttp import INFER, request, via_aiohttp

KEY = "k3y-for-the-tests-0123456789"
# the credential rule: one credential, given once (headers differing in case are two lines of one header)
WRONG = {"none": {}, "wrong bearer": {"Authorization": f"Bearer {KEY}x"}, "wrong api-key": {"api-key": KEY[:-1]},
         "key without Bearer": {"Authorization": KEY}, "the right key twice": {"api-key": KEY, "API-Key": KEY},
         "right, then wrong": {"api-key": KEY, "API-Key": KEY + "x"}}
WRONG_KSERVE = {"both credentials, right": {"api-key": KEY, "Authorization": f"Bearer {KEY}"}}  # api-key: KServe's
RIGHT = {"bearer": {"Authorization": f"Bearer {KEY}"}, "api-key": {"api-key": KEY},
         "padded api-key": {"api-key": f"  {KEY} \t"}, "padded bearer": {"Authorization": f"\tBearer {KEY}  "}}


@pytest.fixture(scope="module")
def keyed(checkpoints, tmp_path_factory):
    """A launcher with an API key from a file (with the trailing newline a secret file may have), its ports."""
    from egemma.ops.tritonserver import free_port
    d = tmp_path_factory.mktemp("keyed")
    (d / "key").write_text(KEY + "\n")
    ports = dict(zip(("http", "grpc", "metrics", "triton_http"), (free_port() for _ in range(4))))
    la = Launcher([sys.executable, "-m", "egemma.ops.launcher", "--model", checkpoints["eos"], "--run-dir", d / "run",
                   "--http-port", ports["http"], "--grpc-port", ports["grpc"], "--metrics-port", ports["metrics"],
                   "--triton-http-port", ports["triton_http"], "--api-key-file", d / "key", "--gateway-workers", "1"],
                  d / "launcher")
    try:
        la.wait_ready()
        la.server_pid()
        la.ports, la.url, la.run_dir = ports, f"http://127.0.0.1:{ports['http']}", d / "run"
        yield la
    finally:
        la.close()


def kserve_body(texts) -> bytes:
    return json.dumps({"inputs": [{"name": "TEXT", "shape": [len(texts), 1], "datatype": "BYTES", "data": texts}],
                       "outputs": [{"name": "EMBEDDING"}]}).encode()


def embedding(body: bytes) -> np.ndarray:
    out = json.loads(body)["outputs"][0]
    return np.array(out["data"], np.float32).reshape(out["shape"])


@pytest.mark.parametrize("lane", ["fast lane", "aiohttp"])
def test_kserve_http_needs_the_key_on_both_lanes(keyed, good_ref, lane):
    port, body = keyed.ports["http"], kserve_body(GOOD[:2])
    path = INFER if lane == "fast lane" else via_aiohttp(f"POST {INFER} HTTP/1.1\r\n".encode()).split()[1].decode()
    for name, headers in {**WRONG, **WRONG_KSERVE}.items():
        status, h, b = request(port, "POST", path, body, headers)
        assert status == 401 and h["content-type"] == "application/json", (name, status, b)
        assert json.loads(b).keys() == {"error"} and "API key" in json.loads(b)["error"], b
        assert h["www-authenticate"].startswith("Bearer")
        assert "aiohttp" in h.get("server", ""), h  # the lane hands what it refuses to aiohttp, which reads the body
    for name, headers in RIGHT.items():
        status, h, b = request(port, "POST", path, body, headers)
        assert status == 200, (name, b[:300])
        assert_close(embedding(b), good_ref[:2])
    # Expect: 100-continue without a key: refused before the body is sent
    status, _, b = request(port, "POST", path, body, {"Expect": "100-continue"})
    assert status == 401, b
    # gzip on the aiohttp path, with the key: inflated and answered
    status, _, b = request(port, "POST", path, gzip.compress(body), {"Content-Encoding": "gzip", **RIGHT["bearer"]})
    assert status == 200, b[:300]
    assert_close(embedding(b), good_ref[:2])


def test_tritonclient_http_passes_the_key_as_a_header(keyed, good_ref):
    c = httpclient.InferenceServerClient(f"127.0.0.1:{keyed.ports['http']}")
    assert c.is_server_ready() and c.get_model_metadata("embeddinggemma")["name"] == "embeddinggemma"
    inp = text_input(GOOD[:3], httpclient)
    with pytest.raises(InferenceServerException, match="API key"):
        c.infer("embeddinggemma", [inp])
    got = c.infer("embeddinggemma", [inp], headers={"Authorization": f"Bearer {KEY}"}).as_numpy("EMBEDDING")
    assert_close(got, good_ref[:3])


def test_openai_and_tei_routes_need_the_bearer_key(keyed, good_ref):
    openai = pytest.importorskip("openai")
    routes = [("POST", "/v1/embeddings", {"input": GOOD[1:3]}), ("GET", "/v1/models", None),
              ("GET", "/v1/models/google/embeddinggemma-300m", None), ("POST", "/embed", {"inputs": GOOD[1:3]}),
              ("POST", "/", {"inputs": GOOD[1:3]}), ("POST", "/tokenize", {"inputs": GOOD[1]}), ("GET", "/info", None),
              ("POST", "/embed_all", {"inputs": "x"})]
    for method, path, body in routes:
        for name, headers in {**WRONG, "api-key (KServe's only)": RIGHT["api-key"]}.items():
            r = requests.request(method, keyed.url + path, json=body, headers=headers, timeout=60)
            assert r.status_code == 401 and r.headers["WWW-Authenticate"].startswith("Bearer"), (path, name, r.text)
            if path.startswith("/v1"):
                assert r.json()["error"]["code"] == "invalid_api_key", r.text
            else:
                assert r.json().keys() == {"error", "error_type"}, r.text
        r = requests.request(method, keyed.url + path, json=body, headers=RIGHT["bearer"], timeout=60)
        assert r.status_code == (501 if path == "/embed_all" else 200), (path, r.text)
    client = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key=KEY, max_retries=0)
    r = client.embeddings.create(input=GOOD[1:3], model="google/embeddinggemma-300m", encoding_format="float")
    assert_close(np.array([d.embedding for d in r.data], np.float32), good_ref[1:3])
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="nope", max_retries=0).models.list()


def test_triton_grpc_and_its_own_http_need_the_key(keyed, good_ref):
    """Triton 2.51 refuses a restricted gRPC call with UNAVAILABLE (not UNAUTHENTICATED), and its own HTTP with a
    403; clients pass the key as gRPC metadata `triton-grpc-protocol-api-key`."""
    c = grpcclient.InferenceServerClient(f"127.0.0.1:{keyed.ports['grpc']}")
    assert c.is_server_live() and c.is_server_ready() and c.is_model_ready("embeddinggemma")
    assert c.get_model_metadata("embeddinggemma").name == "embeddinggemma"
    inp = [text_input(GOOD[:2])]
    for headers in (None, {"api-key": KEY}, {"authorization": f"Bearer {KEY}"},
                    {"triton-grpc-protocol-api-key": KEY + "x"}):
        with pytest.raises(InferenceServerException) as e:
            c.infer("embeddinggemma", inp, headers=headers)
        assert e.value.status() == "StatusCode.UNAVAILABLE" and "restricted" in e.value.message(), e.value
    got = c.infer("embeddinggemma", inp, headers={"triton-grpc-protocol-api-key": KEY}).as_numpy("EMBEDDING")
    assert_close(got, good_ref[:2])
    triton = keyed.ports["triton_http"]  # loopback, behind the gateway: restricted all the same
    assert request(triton, "POST", INFER, kserve_body(GOOD[:1]))[0] == 403
    status, _, b = request(triton, "POST", INFER, kserve_body(GOOD[:1]), {"api-key": KEY})
    assert status == 200, b[:300]


def test_probes_metadata_and_metrics_stay_open(keyed):
    port = keyed.ports["http"]
    for path in ("/v2/health/live", "/v2/health/ready", "/v2", "/v2/models/embeddinggemma",
                 "/v2/models/embeddinggemma/config", "/v2/models/embeddinggemma/stats"):
        for p in (path, via_aiohttp(f"GET {path} HTTP/1.1\r\n".encode()).split()[1].decode()):
            status, _, b = request(port, "GET", p)
            assert status == 200, (p, b[:200])  # live: the watchdog's verdict, so its keyed canary passes
    for path in ("/health", "/metrics"):
        assert requests.get(keyed.url + path, timeout=10).status_code == 200, path
    triton_metrics = requests.get(f"http://127.0.0.1:{keyed.ports['metrics']}/metrics", timeout=10).text
    assert "nv_inference_request_success" in triton_metrics
    # a route that does not exist is a 404 before any key is asked for
    assert requests.get(keyed.url + "/nope", timeout=10).status_code == 404


def test_model_configs_show_no_filesystem_path(keyed, checkpoints):
    """Config and metadata are open: they hold no path (the launcher passes the checkpoint and tokenizer file in the
    server's environment), over the gateway's two paths and Triton's gRPC alike."""
    port, c = keyed.ports["http"], grpcclient.InferenceServerClient(f"127.0.0.1:{keyed.ports['grpc']}")
    for model in ("embeddinggemma", "embeddinggemma_encoder", "embeddinggemma_tokenizer"):
        texts = [json.dumps(c.get_model_config(model, as_json=True)), json.dumps(c.get_model_metadata(model,
                                                                                                      as_json=True))]
        for path in (f"/v2/models/{model}/config", f"/v2/models/{model}"):
            for p in (path, via_aiohttp(f"GET {path} HTTP/1.1\r\n".encode()).split()[1].decode()):
                status, _, b = request(port, "GET", p)
                assert status == 200, (p, b[:200])
                texts.append(b.decode())
        for t in texts:
            assert str(checkpoints["eos"]) not in t and "tokenizer.json" not in t and str(keyed.run_dir) not in t, t


def test_no_key_and_no_traceback_in_the_logs(keyed):
    """After all the above (and a body that is not the gzip it says): the launcher's, Triton's and the gateway's
    output (all in the launcher's stdout and stderr) hold neither the key nor an unhandled exception."""
    status, _, b = request(keyed.ports["http"], "POST", "/embed", b"not gzip",
                           {"Content-Encoding": "gzip", **RIGHT["bearer"]})
    assert status == 400 and json.loads(b)["error_type"] == "Validation", b
    out = keyed.stdout.read_text() + keyed.stderr.read_text()
    assert "ready:" in out and "api key required" in out
    assert KEY not in out and "Traceback" not in out and "Unhandled exception" not in out, out[-3000:]
