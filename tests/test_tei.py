"""The gateway's text-embeddings-inference routes, driven by huggingface_hub's InferenceClient and a LangChain
class, every vector against the KServe path and sentence-transformers; TEI's request fields, error shape and
status codes, and bad input of every kind while concurrent good requests stay exact."""
import json
import threading

import numpy as np
import pytest
import requests

from helpers import GOOD, assert_close, assert_good_beside_bad, expected_ids, reference, st_embed_ids, st_model
from test_openai import NAME, kserve, renorm
from egemma.engine.config import EngineConfig

pytestmark = pytest.mark.usefixtures("still_serving")


@pytest.fixture(scope="module")
def gateway(api_gateway):
    return api_gateway


def post(gateway, path, body, timeout=120):
    return requests.post(f"{gateway.url}{path}", data=body if isinstance(body, bytes) else json.dumps(body),
                         timeout=timeout)


def embed(gateway, **body) -> np.ndarray:
    r = post(gateway, "/embed", body)
    assert r.status_code == 200, r.text
    return np.array(r.json(), dtype=np.float32)


def test_huggingface_hub_feature_extraction(gateway, server, checkpoints):
    from huggingface_hub import InferenceClient
    c = InferenceClient(base_url=gateway.url)  # posts to the base URL: TEI serves POST / as /embed
    ref = reference(checkpoints["eos"], GOOD[1:5], prompt_name="query")  # GOOD[0] is empty: TEI refuses it
    got = c.feature_extraction(GOOD[1:5], prompt_name="query")
    assert_close(got, ref)
    assert_close(got, kserve(server, GOOD[1:5], prompt_name="query"))
    one = c.feature_extraction(GOOD[5], dimensions=16, truncate=True, normalize=True, truncation_direction="right")
    assert one.shape == (1, 16)
    assert_close(one, renorm(reference(checkpoints["eos"], GOOD[5:6]), 16))


def test_embed_fields(gateway, checkpoints):
    texts = GOOD[1:4]
    m, ref = st_model(checkpoints["eos"]), reference(checkpoints["eos"], texts)
    assert_close(embed(gateway, inputs=texts[0]), ref[:1])  # one string: still a list of one vector
    ids = expected_ids(m, texts)
    # token ids, alone and mixed with strings, with and without BOS/EOS: as their text
    assert_close(embed(gateway, inputs=ids[1]), ref[1:2])
    assert_close(embed(gateway, inputs=[texts[0], ids[1][1:-1], ids[2]]), ref)
    # left truncation is honoured where nothing is cut
    assert_close(embed(gateway, inputs=texts, truncation_direction="Left"), ref)
    assert_close(embed(gateway, inputs=texts, truncation_direction="left", truncate=False), ref)
    word = m.tokenizer("kalo", add_special_tokens=False)["input_ids"][0]
    cut = [m.tokenizer.bos_token_id] + [word] * 2046 + [m.tokenizer.eos_token_id]
    assert_close(embed(gateway, inputs=[[word] * 3000]), st_embed_ids(m, [cut]))


def test_tokenize(gateway, checkpoints):
    m = st_model(checkpoints["eos"])
    texts = [GOOD[3], "Grüße <eos> aus Köln"]
    r = post(gateway, "/tokenize", {"inputs": texts, "prompt_name": "query"})
    assert r.status_code == 200, r.text
    want = expected_ids(m, texts, prompt_name="query")
    assert [[t["id"] for t in toks] for toks in r.json()] == want
    for toks, ids in zip(r.json(), want):
        assert [t["text"] for t in toks] == m.tokenizer.convert_ids_to_tokens(ids)
        assert [t["special"] for t in toks] == [i in m.tokenizer.all_special_ids for i in ids]
        assert all(t["start"] is None and t["stop"] is None for t in toks)
    plain = post(gateway, "/tokenize", {"inputs": GOOD[3], "add_special_tokens": False}).json()
    assert [t["id"] for t in plain[0]] == expected_ids(m, [GOOD[3]])[0][1:-1]


def test_info_health_metrics_embed_all(gateway):
    info = requests.get(f"{gateway.url}/info", timeout=10).json()
    assert info["model_id"] == NAME and info["max_input_length"] == 2048 and info["auto_truncate"] is True
    assert info["model_type"] == {"embedding": {"pooling": "mean"}} and info["max_client_batch_size"] == 2048
    # the encoder's config.pbtxt leaves its parameters empty: /info gives the engine's one default
    assert info["max_batch_tokens"] == EngineConfig.max_tokens and info["model_dtype"] == EngineConfig.dtype
    h = requests.get(f"{gateway.url}/health", timeout=10)
    assert h.status_code == 200 and h.content == b""
    met = requests.get(f"{gateway.url}/metrics", timeout=10)
    assert met.status_code == 200 and "nv_inference_request_success" in met.text
    r = post(gateway, "/embed_all", {"inputs": "x"})
    assert r.status_code == 501 and "hidden states" in r.json()["error"]


def test_langchain(gateway, checkpoints):
    """langchain-huggingface's HuggingFaceEndpointEmbeddings refuses a URL (hub ids only, since 1.0), so the
    LangChain class for a self-hosted TEI is langchain-community's HuggingFaceInferenceAPIEmbeddings."""
    lc = pytest.importorskip("langchain_community.embeddings")
    e = lc.HuggingFaceInferenceAPIEmbeddings(api_key="unused", api_url=f"{gateway.url}/embed")
    assert_close(np.array(e.embed_documents(GOOD[1:6]), dtype=np.float32), reference(checkpoints["eos"], GOOD[1:6]))


BAD = [  # (route, body, status, error_type, what the message names)
    ("/embed", b"{not json", 400, "Validation", "JSON"),
    ("/embed", b"[1]", 400, "Validation", "object"),
    ("/embed", {}, 422, "Validation", "inputs"),
    ("/embed", {"inputs": 5}, 422, "Validation", "inputs"),
    ("/embed", {"inputs": []}, 400, "Empty", "empty"),
    ("/embed", {"inputs": [[]]}, 400, "Empty", "empty"),
    ("/embed", {"inputs": ""}, 400, "Empty", "empty"),  # TEI's tokenizer: `inputs` cannot be empty
    ("/", {"inputs": ""}, 400, "Empty", "empty"),
    ("/embed", {"inputs": ["a", ""]}, 400, "Empty", "inputs[1]"),
    ("/tokenize", {"inputs": ""}, 400, "Empty", "empty"),
    ("/embed", {"inputs": ["a", 5]}, 422, "Validation", "inputs[1]"),
    ("/embed", {"inputs": [[1, 2.5]]}, 422, "Validation", "inputs[0]"),
    ("/embed", {"inputs": [[100000]]}, 422, "Validation", "[0, "),
    ("/embed", {"inputs": ["x"] * 2049}, 422, "Validation", "2048"),
    ("/embed", {"inputs": "x", "normalize": False}, 422, "Validation", "normalised"),
    ("/embed", {"inputs": "x", "normalize": "yes"}, 422, "Validation", "normalize"),
    ("/embed", {"inputs": "x", "truncate": 1}, 422, "Validation", "truncate"),
    ("/embed", {"inputs": "x", "truncation_direction": "up"}, 422, "Validation", "truncation_direction"),
    ("/embed", {"inputs": "kalo " * 3000, "truncation_direction": "Left"}, 422, "Validation", "left"),
    ("/embed", {"inputs": "kalo " * 3000, "truncate": False}, 422, "Validation", "2048"),
    ("/embed", {"inputs": [[5] * 3000], "truncate": False}, 422, "Validation", "2048"),
    ("/embed", {"inputs": "x", "dimensions": 20}, 422, "Validation", "choose from"),
    ("/embed", {"inputs": "x", "dimensions": "32"}, 422, "Validation", "dimensions"),
    ("/embed", {"inputs": "x", "prompt_name": "nope"}, 422, "Validation", "Retrieval-query"),
    ("/embed", {"inputs": "x", "prompt_name": {}}, 422, "Validation", "prompt_name"),
    ("/embed", {"inputs": "x", "truncate": {}}, 422, "Validation", "truncate"),
    ("/tokenize", {"inputs": "x", "prompt_name": {}}, 422, "Validation", "prompt_name"),  # once a 424
    ("/tokenize", {"inputs": "x", "prompt_name": ["q"]}, 422, "Validation", "prompt_name"),
    ("/tokenize", {"inputs": "x", "truncate": {}}, 422, "Validation", "truncate"),
    ("/embed", {"inputs": [[5, 6]], "prompt_name": "query"}, 422, "Validation", "prompt"),
    ("/tokenize", {"inputs": [[5, 6]]}, 422, "Validation", "inputs[0]"),
    ("/tokenize", {"inputs": []}, 400, "Empty", "empty"),
    ("/tokenize", {"inputs": "x", "add_special_tokens": "no"}, 422, "Validation", "add_special_tokens"),
    ("/tokenize", {"inputs": "x", "prompt_name": "nope"}, 422, "Validation", "Retrieval-query"),
]


def test_bad_input_tei_shape_while_good_requests_stay_exact(gateway, checkpoints):
    good, got, errors = GOOD[1:7], {}, []  # GOOD[0] is the empty text

    def run_good(k):
        try:
            got[k] = embed(gateway, inputs=good)
        except Exception as e:  # reported below: a good request must never fail
            errors.append(e)
    threads = [threading.Thread(target=run_good, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    oversize = [(p, b"x" * (gateway.max_body + 1), 413, "Validation", str(gateway.max_body))
                for p in ("/embed", "/tokenize")]
    for path, body, status, kind, fragment in BAD + oversize:
        r = post(gateway, path, body)
        assert r.status_code == status, (path, str(body)[:200], r.text)
        assert r.headers["Content-Type"] == "application/json"
        assert r.json().keys() == {"error", "error_type"} and r.json()["error_type"] == kind, r.text
        assert fragment in r.json()["error"], r.text
    assert_good_beside_bad(gateway, threads, errors, got, reference(checkpoints["eos"], good))


def test_router_errors_and_bad_bodies_in_tei_shape(gateway):
    """No such route, a method the route does not take, a body that is not the gzip it says: TEI's JSON error."""
    for method, path, status in (("GET", "/nope", 404), ("GET", "/embed", 405), ("PUT", "/", 405)):
        r = requests.request(method, f"{gateway.url}{path}", timeout=10)
        assert r.status_code == status and r.json().keys() == {"error", "error_type"}, (path, r.text)
    r = requests.post(f"{gateway.url}/embed", data=b"not gzip", headers={"Content-Encoding": "gzip"}, timeout=10)
    assert r.status_code == 400 and r.json()["error_type"] == "Validation" and "gzip" in r.json()["error"], r.text


def test_health_from_the_watchdog_verdict_and_triton_down(tmp_path):
    """A gateway whose Triton is not there (a restart in progress): /health answers the watchdog's verdict file,
    and every route that needs Triton answers its protocol's 503 once the retry bound (--retry-seconds, here 1 s)
    has passed."""
    from egemma.ops.front import Front
    from egemma.ops.tritonserver import free_port
    from egemma.gateway import common
    port, verdict = free_port(), tmp_path / "health.json"
    dead = f"127.0.0.1:{free_port()}"
    url = f"http://127.0.0.1:{port}"
    front = Front([f"--port={port}", f"--triton-http={dead}", f"--triton-grpc={dead}", f"--health-file={verdict}",
                   "--retry-seconds=1"], url).start()
    try:
        r = requests.get(f"{url}/health", timeout=10)
        assert r.status_code == 503 and r.json() == {"error": "unhealthy: no watchdog verdict yet",
                                                     "error_type": "Unhealthy"}
        common.write_verdict(verdict, True)
        assert requests.get(f"{url}/health", timeout=10).status_code == 200
        common.write_verdict(verdict, False, "restarting: a stub died")
        assert "a stub died" in requests.get(f"{url}/health", timeout=10).json()["error"]
        r = requests.post(f"{url}/embed", json={"inputs": "x"}, timeout=30)
        assert r.status_code == 503 and r.json()["error_type"] == "Unhealthy", r.text
        r = requests.post(f"{url}/v1/embeddings", json={"input": "x"}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error", r.text
        r = requests.post(f"{url}/v1/embeddings", json={"input": [[5, 6]]}, timeout=30)  # needs the model's facts
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error", r.text
        for path in ("/info", "/metrics"):
            r = requests.get(f"{url}{path}", timeout=30)
            assert r.status_code in (404, 503) and set(r.json()) == {"error", "error_type"}, (path, r.text)
    finally:
        front.stop()
