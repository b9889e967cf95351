"""The gateway's OpenAI routes, driven by clients nobody here wrote (the `openai` package, LangChain's
OpenAIEmbeddings), every vector against the KServe path and sentence-transformers; bad input of every kind gets
OpenAI's error shape while concurrent good requests stay exact."""
import base64
import json
import threading

import numpy as np
import pytest
import requests

from helpers import (GOOD, assert_close, assert_good_beside_bad, expected_ids, make_texts, reference, st_embed_ids, st_model,
                     text_input)

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.usefixtures("still_serving")
NAME = "google/embeddinggemma-300m"


def kserve(server, texts, **params) -> np.ndarray:
    import tritonclient.grpc as grpcclient
    c = grpcclient.InferenceServerClient(server.grpc_url)
    return np.concatenate([c.infer("embeddinggemma", [text_input(texts[a:a + 64])], parameters=params or None)
                           .as_numpy("EMBEDDING") for a in range(0, len(texts), 64)])  # 64 rows a request


def renorm(v: np.ndarray, d: int) -> np.ndarray:
    v = v[..., :d]
    return v / np.linalg.norm(v, axis=-1, keepdims=True)


@pytest.fixture(scope="module")
def gateway(api_gateway):
    return api_gateway


@pytest.fixture(scope="module")
def client(gateway):
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)


def vectors(r) -> np.ndarray:
    return np.array([d.embedding for d in r.data], dtype=np.float32)


def test_ensemble_num_tokens(server, checkpoints):
    """NUM_TOKENS (what usage reports) is each text's length as embedded; a KServe client naming its outputs gets
    only those, one naming none gets all the ensemble's (EMBEDDING as before, NUM_TOKENS beside it)."""
    import tritonclient.grpc as grpcclient
    c, m = grpcclient.InferenceServerClient(server.grpc_url), st_model(checkpoints["eos"])
    texts = [GOOD[2], "kalo " * 3000]  # the second is cut to 2048
    r = c.infer("embeddinggemma", [text_input(texts)], parameters={"prompt_name": "query"})
    assert {o.name for o in r.get_response().outputs} == {"EMBEDDING", "NUM_TOKENS"}
    want = [len(s) for s in expected_ids(m, texts, prompt_name="query")]
    assert r.as_numpy("NUM_TOKENS").tolist() == [[want[0]], [2048]] and want[1] == 2048
    only = c.infer("embeddinggemma", [text_input(texts)], outputs=[grpcclient.InferRequestedOutput("EMBEDDING")])
    assert [o.name for o in only.get_response().outputs] == ["EMBEDDING"]


def test_float_list_over_one_batch(client, server, checkpoints):
    texts = make_texts(71, 100, seed=9)[1:]  # over the ensemble's 64 rows: the gateway splits, calls concurrently
    # (the first text of make_texts is empty: OpenAI's schema refuses it)
    r = client.embeddings.create(input=texts, model=NAME, encoding_format="float")
    assert [d.index for d in r.data] == list(range(70)) and r.model == NAME
    assert_close(vectors(r), reference(checkpoints["eos"], texts))
    assert_close(vectors(r), kserve(server, texts))
    n = sum(map(len, expected_ids(st_model(checkpoints["eos"]), texts)))
    assert r.usage.prompt_tokens == r.usage.total_tokens == n


def test_default_base64_dimensions_prompt(client, server, checkpoints):
    raw = client.embeddings.with_raw_response.create(input=["what is the red planet", "Mars"], model=NAME, user="u1",
                                                     dimensions=32, extra_body={"prompt_name": "query"})
    assert json.loads(raw.http_request.content)["encoding_format"] == "base64"  # the client's own default
    wire = json.loads(raw.http_response.content)["data"][0]["embedding"]
    assert isinstance(wire, str)
    r = raw.parse()
    ref = renorm(reference(checkpoints["eos"], ["what is the red planet", "Mars"], prompt_name="query"), 32)
    assert_close(np.frombuffer(base64.b64decode(wire), dtype="<f4"), ref[0])
    assert_close(vectors(r), ref)
    assert_close(vectors(r), kserve(server, ["what is the red planet", "Mars"], prompt_name="query", dimensions=32))
    m = st_model(checkpoints["eos"])
    assert r.usage.prompt_tokens == sum(map(len, expected_ids(m, ["what is the red planet", "Mars"],
                                                              prompt_name="query")))


def test_token_arrays(client, checkpoints):
    """Ids with specials (as the tokenizer gives them) and without embed as their text does."""
    m = st_model(checkpoints["eos"])
    texts = GOOD[1:4]  # not GOOD[0], the empty text: its ids without specials would be an empty list
    full = expected_ids(m, texts)  # BOS ... EOS
    ref = reference(checkpoints["eos"], texts)
    for ids in (full, [s[1:-1] for s in full], [full[0][1:], full[1][:-1], full[2]]):
        r = client.embeddings.create(input=ids, model=NAME, encoding_format="float")
        assert_close(vectors(r), ref)
        assert r.usage.prompt_tokens == sum(map(len, full))
    one = client.embeddings.create(input=full[1][1:-1], model=NAME)  # one list of ints: one input
    assert len(one.data) == 1 and one.usage.prompt_tokens == len(full[1])
    assert_close(vectors(one), ref[1:2])


def test_token_arrays_truncation(client, gateway, checkpoints):
    m = st_model(checkpoints["eos"])
    word = m.tokenizer("kalo", add_special_tokens=False)["input_ids"][0]
    long = [word] * 3000
    r = client.embeddings.create(input=[long], model=NAME, dimensions=16, encoding_format="float")
    cut = [m.tokenizer.bos_token_id] + long[:2046] + [m.tokenizer.eos_token_id]  # as for text: EOS kept last
    assert_close(vectors(r), renorm(st_embed_ids(m, [cut]), 16))
    assert r.usage.prompt_tokens == 2048
    with pytest.raises(openai.BadRequestError, match="3002 tokens.*2048"):
        client.embeddings.create(input=[long], model=NAME, extra_body={"truncate": False})


def test_models_and_unknown_model(client, gateway):
    assert [m.id for m in client.models.list()] == [NAME, *gateway.aliases]
    assert client.models.retrieve(NAME).id == NAME
    for alias in gateway.aliases:
        assert client.embeddings.create(input="x", model=alias).model == NAME
    with pytest.raises(openai.NotFoundError) as e:
        client.embeddings.create(input="x", model="text-embedding-3-small")
    assert e.value.code == "model_not_found" and e.value.param == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("text-embedding-3-small")


def test_health(gateway):
    r = requests.get(f"{gateway.url}/health", timeout=10)
    assert r.status_code == 200 and r.content == b""


def test_langchain(gateway, checkpoints):
    lc = pytest.importorskip("langchain_openai")
    # check_embedding_ctx_length=False: else LangChain sends tiktoken's ids, not this model's (garbage vectors)
    e = lc.OpenAIEmbeddings(model=NAME, base_url=f"{gateway.url}/v1", api_key="unused",
                            check_embedding_ctx_length=False, max_retries=0)
    assert_close(np.array(e.embed_documents(GOOD[1:6]), dtype=np.float32), reference(checkpoints["eos"], GOOD[1:6]))
    assert_close(np.array(e.embed_query(GOOD[6]), dtype=np.float32), reference(checkpoints["eos"], GOOD[6:7])[0])


BAD = [  # (body, status, what the message names)
    (b"{not json", 400, "JSON"),
    (b"[1, 2]", 400, "object"),
    ({"model": NAME}, 400, "input"),
    ({"input": 5}, 400, "input"),
    ({"input": []}, 400, "input"),
    ({"input": ["a", [1]]}, 400, "input"),
    ({"input": [[]]}, 400, "input"),
    ({"input": [[1, 2.5]]}, 400, "input"),
    ({"input": [True, False]}, 400, "input"),
    ({"input": [[-1]]}, 400, "vocabulary"),
    ({"input": [[10 ** 12]]}, 400, "vocabulary"),
    ({"input": [[100000]]}, 400, "vocabulary"),
    ({"input": ["x"] * 2049}, 400, "2048"),
    ({"input": [[5]] * 2049}, 400, "2049 inputs"),
    ({"input": [5] * 3000}, 400, "flat list"),  # one input of 3000 ids: OpenAI's schema allows 2048 in a flat list
    ({"input": ""}, 400, "empty string"),  # OpenAI's schema: the input cannot be an empty string
    ({"input": ["x", ""]}, 400, "input[1] is an empty string"),
    ({"input": "x", "model": 5}, 400, "model"),
    ({"input": "x", "model": "nope"}, 404, "nope"),
    ({"input": "x", "encoding_format": "hex"}, 400, "encoding_format"),
    ({"input": "x", "dimensions": 20}, 400, "choose from"),
    ({"input": "x", "dimensions": "32"}, 400, "dimensions"),
    ({"input": "x", "prompt_name": "nope"}, 400, "Retrieval-query"),
    ({"input": "x", "prompt_name": 3}, 400, "prompt_name"),
    ({"input": "x", "prompt_name": {}}, 400, "prompt_name"),  # once a 502: tritonclient refused it without a status
    ({"input": "x", "prompt": ["x"]}, 400, "prompt"),
    ({"input": "x", "truncate": {}}, 400, "truncate"),
    ({"input": "x", "user": 5}, 400, "user"),
    ({"input": [[5, 6]], "prompt_name": "query"}, 400, "prompt"),
    ({"input": "x", "truncate": "maybe"}, 400, "truncate"),
    ({"input": "kalo " * 3000, "truncate": False}, 400, "2048"),
    ({"input": "x", "temperature": 1}, 400, "temperature"),
]


def test_bad_input_openai_shape_while_good_requests_stay_exact(gateway, client, checkpoints):
    good, got, errors = GOOD[1:7], {}, []  # GOOD[0] is the empty text

    def run_good(k):
        try:
            got[k] = vectors(client.embeddings.create(input=good, model=NAME, encoding_format="float"))
        except Exception as e:  # reported below: a good request must never fail
            errors.append(e)
    threads = [threading.Thread(target=run_good, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    url = f"{gateway.url}/v1/embeddings"
    for body, status, fragment in BAD + [(b"x" * (gateway.max_body + 1), 413, str(gateway.max_body))]:
        r = requests.post(url, data=body if isinstance(body, bytes) else json.dumps(body), timeout=120)
        assert r.status_code == status, (body if len(str(body)) < 200 else str(body)[:200], r.text)
        assert r.headers["Content-Type"] == "application/json"
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and fragment in err["message"], err
        assert err["type"] == "invalid_request_error"
    assert_good_beside_bad(gateway, threads, errors, got, reference(checkpoints["eos"], good))


def test_router_errors_in_openai_shape(gateway):
    """No such route, or a method the route does not take: OpenAI's JSON error, not aiohttp's text/plain."""
    for method, path, status in (("GET", "/v1/models/", 404), ("GET", "/v1/nope", 404), ("POST", "/v1/models", 405),
                                 ("GET", "/v1/embeddings", 405)):
        r = requests.request(method, f"{gateway.url}{path}", timeout=10)
        assert r.status_code == status and r.headers["Content-Type"] == "application/json", (path, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
