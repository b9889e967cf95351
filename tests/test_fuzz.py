"""Fuzzing through the shared real tritonserver. Property-based, of the tokenizer model and the ensemble: random
unicode, control characters, lone surrogates, huge repeats and raw bytes either embed exactly or fail cleanly. And
every field of every route (KServe on the gateway's two paths, OpenAI, TEI, gRPC) given hostile values (other JSON
types, integers past int32 / int64 / uint64, numbers as strings, NUL, lone surrogates): a 4xx or an answer that took
the value as it was, never a 5xx or a coercion. The server keeps serving."""
import json

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from hypothesis import HealthCheck, event, given, settings, strategies as st

from helpers import assert_clean_error, assert_close, fire_concurrently, max_text_bytes, reference, text_input

pytestmark = pytest.mark.usefixtures("still_serving")


def _surrogate_mix(parts):
    return "".join(parts).encode("utf-8", "surrogatepass")


FUZZ_TEXT = st.one_of(
    st.text(max_size=300).map(str.encode),  # any unicode (no surrogates)
    st.text(st.characters(categories=["Cc", "Cf", "Zs", "Zl", "Zp", "Mn"]), max_size=200).map(str.encode),
    st.lists(st.one_of(st.text(max_size=8), st.characters(categories=["Cs"])), max_size=8).map(_surrogate_mix),
    # huge repeats: some well past max_text_bytes (1 MB), some just under
    st.tuples(st.text(min_size=1, max_size=4), st.integers(1, 5_000) | st.integers(100_000, 600_000)).map(
        lambda t: (t[0] * t[1]).encode()),
    st.binary(max_size=100),
)


def _valid(texts, limit):
    try:
        [t.decode("utf-8") for t in texts]
    except UnicodeDecodeError:
        return False
    return all(len(t) <= limit for t in texts)


def _check_fuzz_answer(r, e, valid, ok):
    if valid:
        assert e is None, e
        ok(r)
    else:
        assert r is None
        assert_clean_error(e)
        assert "not valid UTF-8" in e.message() or "max_text_bytes" in e.message(), e.message()


# still_serving (function-scoped) runs once around the whole property, as intended.
@settings(max_examples=150, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(texts=st.lists(FUZZ_TEXT, min_size=1, max_size=3))
def test_fuzz_tokenizer_and_ensemble(server, checkpoints, texts):
    """Random unicode, control characters, lone surrogates as bytes, huge repeats, raw bytes: valid UTF-8
    within max_text_bytes must succeed (ids BOS ... EOS; embeddings finite, and equal to the reference for
    texts small enough to check quickly); anything else must be a clean INVALID_ARGUMENT naming the problem."""
    valid = _valid(texts, max_text_bytes(server))
    event(f"valid={valid}, largest text {'>=' if max(map(len, texts)) >= 100_000 else '<'} 100 kB")
    c = grpcclient.InferenceServerClient(server.grpc_url)
    (tr, te), (er, ee) = fire_concurrently(c, [("embeddinggemma_tokenizer", [text_input(texts)]),
                                               ("embeddinggemma", [text_input(texts)])])

    def ids_ok(r):
        ids, lens = r.as_numpy("INPUT_IDS"), r.as_numpy("SEQ_LEN")[:, 0]
        assert ids.shape[0] == len(texts) and lens.shape == (len(texts),)
        for row, n in zip(ids, lens):
            assert 2 <= n <= 2048 and row[0] == 2 and row[n - 1] == 1

    def embedding_ok(r):
        got = r.as_numpy("EMBEDDING")
        assert got.shape[0] == len(texts) and np.isfinite(got).all()
        if sum(map(len, texts)) <= 20_000:
            assert_close(got, reference(checkpoints["eos"], [t.decode() for t in texts]))
    _check_fuzz_answer(tr, te, valid, ids_ok)
    _check_fuzz_answer(er, ee, valid, embedding_ok)
    assert server.proc.poll() is None


# ------------------------------------------------------------------ every field of every route: no 5xx, no coercion

# What a hostile client puts in a field: other JSON types, integers past int32 / int64 / uint64, a float, numbers as
# strings, NUL, a lone surrogate (json.dumps writes it as the escape \ud800), empty and nested containers.
HOSTILE = [None, True, False, 0, -1, 48.7, 1e308, 2 ** 31, 2 ** 63, 2 ** 64 - 1, -(2 ** 63) - 1, "", "48", "query",
           "a\u0000b", "query\u0000xyz", "\ud800", "x" * 5000, [], {}, [1], ["x"], [[1]], [2 ** 63], {"a": 1}]
OPENAI = ("input", "model", "dimensions", "encoding_format", "user", "prompt_name", "prompt", "truncate", "extra")
TEI_EMBED = ("inputs", "normalize", "truncate", "truncation_direction", "prompt_name", "dimensions")
TEI_TOKENIZE = ("inputs", "add_special_tokens", "truncate", "prompt_name")
OPTIONS = ("dimensions", "prompt_name", "prompt", "truncate", "encoding", "extra")


def _bodies(base: dict, fields, element_of: str) -> list[dict]:
    """base with each field set to each hostile value, and each value as an element of the input list and of a
    token-id list."""
    out = [{**base, f: v} for f in fields for v in HOSTILE]
    out += [{**base, element_of: [v]} for v in HOSTILE] + [{**base, element_of: [[2, 5, v]]} for v in HOSTILE]
    return out


def _kserve_bodies() -> list[tuple[str, dict]]:
    text = {"name": "TEXT", "datatype": "BYTES", "shape": [1, 1], "data": ["hello"]}
    ids = {"name": "INPUT_IDS", "datatype": "INT32", "shape": [1, 3], "data": [2, 5, 1]}
    out = []
    for model, tensor in (("embeddinggemma", text), ("embeddinggemma_tokenizer", text),
                          ("embeddinggemma_encoder", ids)):
        out += [(model, {"inputs": [tensor], "parameters": {k: v}}) for k in OPTIONS for v in HOSTILE]
        out += [(model, {"inputs": [{**tensor, k: v}]}) for k in ("name", "datatype", "shape", "data", "parameters")
                for v in HOSTILE]
        out += [(model, {"inputs": [{**tensor, "data": [v] * (3 if model.endswith("encoder") else 1)}]})
                for v in HOSTILE]
        out += [(model, {"inputs": [tensor], k: v}) for k in ("id", "parameters", "outputs") for v in HOSTILE]
        out += [(model, {"inputs": [tensor], "outputs": [{"name": "EMBEDDING", "parameters": {"binary_data": v}}]})
                for v in HOSTILE]
    return out


@pytest.mark.parametrize("lane", ["fast lane", "aiohttp"])
def test_every_field_of_every_kserve_route_is_never_a_5xx(api_gateway, lane):
    """Each hostile value in each request field, parameter, tensor field and data element of the three models'
    infer routes: answered (a 200: a value the model takes as it is) or refused with a 4xx, never a 5xx."""
    import requests
    s, query, bad = requests.Session(), "" if lane == "fast lane" else "?via=%61iohttp", []
    for model, body in _kserve_bodies():
        r = s.post(f"{api_gateway.url}/v2/models/{model}/infer{query}", data=json.dumps(body), timeout=60)
        if r.status_code >= 500:
            bad.append((model, body, r.status_code, r.text[:200]))
        elif r.status_code == 200 and isinstance(body.get("parameters"), dict) and body["parameters"]:
            (k, v), = body["parameters"].items()  # taken as given: the option's own type, never a coercion
            if type(v) is not {"dimensions": int, "truncate": bool}.get(k, str) or "\0" in str(v):
                bad.append((model, body, "coerced", r.text[:100]))
    assert not bad, "\n".join(map(str, bad))


def test_every_field_of_the_openai_and_tei_routes_is_never_a_5xx(api_gateway):
    import requests
    s = requests.Session()
    cases = [("/v1/embeddings", b) for b in _bodies({"input": "hello"}, OPENAI, "input")]
    for route in ("/embed", "/"):
        cases += [(route, b) for b in _bodies({"inputs": "hello"}, TEI_EMBED, "inputs")]
    cases += [("/tokenize", b) for b in _bodies({"inputs": "hello"}, TEI_TOKENIZE, "inputs")]
    bad = []
    for route, body in cases:
        r = s.post(api_gateway.url + route, data=json.dumps(body), timeout=60)
        if r.status_code >= 500:
            bad.append((route, body, r.status_code, r.text[:200]))
        elif r.status_code == 200:  # taken as given, never coerced: a NUL, a number as a string, a bool as a number
            for k in ("prompt", "prompt_name", "dimensions", "encoding_format", "truncation_direction"):
                v = body.get(k)
                if not (v is None or (isinstance(v, str) and "\0" not in v and k != "dimensions")
                        or (type(v) is int and k == "dimensions")):
                    bad.append((route, body, "coerced", r.text[:100]))
    assert not bad, "\n".join(map(str, bad))
    for path in ("/v1/models/" + "x" * 5000, "/v1/models/%00", "/v1/models/%ED%A0%80", "/info", "/health"):
        assert s.get(api_gateway.url + path, timeout=60).status_code < 500, path


def test_every_option_over_grpc_is_never_an_internal_error(server):
    """gRPC goes to Triton itself: each hostile option value of a type gRPC can carry (int64, bool, string, double)
    is taken as it is or refused with INVALID_ARGUMENT, never INTERNAL / UNKNOWN."""
    from tritonclient.utils import InferenceServerException
    c = grpcclient.InferenceServerClient(server.grpc_url)
    carried = [v for v in HOSTILE if type(v) in (bool, int, float) and abs(v) < 2 ** 63 or v in ("", "48", "query")
               or isinstance(v, str) and "\0" in v]  # what protobuf can carry (no lone surrogate, int64)
    for model, inputs in (("embeddinggemma", lambda: [text_input(["hello"])]),
                          ("embeddinggemma_tokenizer", lambda: [text_input(["hello"])])):
        for k in OPTIONS:
            for v in carried:
                try:
                    c.infer(model, inputs(), parameters={k: v}, client_timeout=60)
                except InferenceServerException as e:
                    assert e.status() == "StatusCode.INVALID_ARGUMENT", (model, k, v, e)
                else:  # taken: of the option's own type ("\0" cut by Triton before the model sees it: docs/limits.md)
                    assert type(v) is {"dimensions": int, "truncate": bool}.get(k, str), (model, k, v)
