"""Bad input through the real tritonserver: empty, invalid UTF-8, oversized, wrong dtype or shape, NaN bait. Each bad
request is sent concurrently with good ones, which must still equal the sentence-transformers reference; it
costs that request only, and after every test the shared server must be live and answering correctly."""
import json
import time
import queue

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient

from helpers import (GOOD, assert_clean_error, assert_close, fire_concurrently, ids_input, max_text_bytes, model_stats,
                     raw_input, reference, st_embed_ids, st_model, text_input, wait_for)

pytestmark = pytest.mark.usefixtures("still_serving")


def mixed(server, good_ref, bad_jobs):
    """Send bad_jobs interleaved with one single-text request per GOOD text (so dynamic batching puts them in
    the same executions); assert every good one is exact; return the bad ones' (result, error)."""
    good = [("embeddinggemma", [text_input([t])]) for t in GOOD]
    jobs, where = [], []
    for k in range(max(len(good), len(bad_jobs))):
        if k < len(bad_jobs):
            where.append(len(jobs))
            jobs.append(bad_jobs[k])
        if k < len(good):
            jobs.append(good[k])
    res = fire_concurrently(grpcclient.InferenceServerClient(server.grpc_url), jobs)
    bad_idx = set(where)
    good_res = [r for k, r in enumerate(res) if k not in bad_idx]
    for (r, e), want in zip(good_res, good_ref):
        assert e is None, e
        assert_close(r.as_numpy("EMBEDDING"), want[None])
    return [res[k] for k in where]


def test_empty_batch_is_rejected(server, good_ref):
    # The client sends a [0, 1] tensor; Triton itself rejects it before any model runs.
    [(r, e)] = mixed(server, good_ref, [("embeddinggemma", [text_input([])])])
    assert r is None
    assert_clean_error(e, "'TEXT'")


def test_empty_string_embeds_bos_eos_only(server, checkpoints, good_ref):
    [(r, e), (ids, e2)] = mixed(server, good_ref, [("embeddinggemma", [text_input([""])]),
                                                   ("embeddinggemma_tokenizer", [text_input([""])])])
    assert e is None and e2 is None
    assert ids.as_numpy("INPUT_IDS").tolist() == [[2, 1]] and ids.as_numpy("SEQ_LEN").tolist() == [[2]]
    got = r.as_numpy("EMBEDDING")
    assert_close(got, reference(checkpoints["eos"], [""]))
    assert_close(got, st_embed_ids(st_model(checkpoints["eos"]), [[2, 1]]))


def test_invalid_utf8_fails_alone(server, good_ref):
    bad = [b"\xff\xfe bad", b"truncated \xc3", b"\xc0\xaf overlong", "\ud800".encode("utf-8", "surrogatepass"),
           b"fine \xed\xa0\x80 lone surrogate in the middle"]
    # One request per bad text, plus one request mixing a good and a bad text: a request is all or nothing.
    jobs = [("embeddinggemma", [text_input([b])]) for b in bad] + [("embeddinggemma", [text_input(["ok", bad[0]])])]
    for r, e in mixed(server, good_ref, jobs):
        assert r is None
        assert_clean_error(e, "not valid UTF-8")


def test_10mb_text_is_rejected_by_size(server, checkpoints, good_ref):
    limit = max_text_bytes(server)
    at_limit = ("kalo " * limit)[:limit]
    [(r, e), (r1, e1), (r2, e2)] = mixed(server, good_ref, [
        ("embeddinggemma", [text_input([b"kalo " * 2_000_000])]),  # 10 MB
        ("embeddinggemma", [text_input([at_limit + "a"])]),  # one byte over
        ("embeddinggemma", [text_input([at_limit])])])  # at the limit: fine (truncated to 2048 tokens)
    for r, e in ((r, e), (r1, e1)):
        assert r is None
        assert_clean_error(e, "max_text_bytes")
    assert e2 is None, e2
    assert_close(r2.as_numpy("EMBEDDING"), reference(checkpoints["eos"], [at_limit]))


def test_10000_texts_in_one_request_are_rejected(server, good_ref):
    [(r, e)] = mixed(server, good_ref, [("embeddinggemma", [text_input(["kalo the"] * 10_000)])])
    assert r is None
    assert_clean_error(e, "batch-size must be <= 64")


def test_wrong_dtype_or_shape_grpc(server, good_ref):
    cases = [  # (inputs, what the error names)
        ([raw_input("TEXT", "INT32", np.array([[1]], dtype=np.int32))], "data-type is 'INT32'"),
        ([raw_input("TEXT", "FP32", np.array([[1.5]], dtype=np.float32))], "data-type is 'FP32'"),
        ([raw_input("TEXT", "BYTES", np.array([[b"a", b"b"]], dtype=object))], "unexpected shape"),
        ([raw_input("TEXT", "BYTES", np.array([b"a", b"b"], dtype=object))], "unexpected shape"),
        ([raw_input("TEXT", "BYTES", np.array([[[b"a"]]], dtype=object))], "unexpected shape"),
        ([raw_input("TXT", "BYTES", np.array([[b"a"]], dtype=object))], "unexpected inference input 'TXT'"),
        ([], "missing required input"),
    ]
    res = mixed(server, good_ref, [("embeddinggemma", inputs) for inputs, _ in cases])
    for (r, e), (_, fragment) in zip(res, cases):
        assert r is None
        assert_clean_error(e, fragment)


def test_wrong_dtype_or_shape_raw_http(server, good_ref):
    """Raw JSON posts while good gRPC requests are in flight. Triton answers 400 for a wrong type or shape and
    500 for a body it cannot parse; either way a JSON {"error": ...} for that request only."""
    url = f"http://{server.http_url}/v2/models/embeddinggemma/infer"

    def body(shape, datatype, data, name="TEXT"):
        return json.dumps({"inputs": [{"name": name, "shape": shape, "datatype": datatype, "data": data}]})
    cases = [(body([1, 1], "INT32", [1]), 400, "data-type is 'INT32'"),
             (body([1, 1], "FP32", [1.5]), 400, "data-type is 'FP32'"),
             (body([2, 1], "BYTES", ["only one"]), 400, "expected 2 string elements"),
             (body([1, 2], "BYTES", ["a", "b"]), 400, "unexpected shape"),
             (body([1, 1, 1], "BYTES", ["a"]), 400, "unexpected shape"),
             (body([0, 1], "BYTES", []), 400, "'TEXT'"),
             (body([1, 1], "BYTES", ["a"], name="TXT"), 400, "'TXT'"),
             (body([1, 1], "BYTES", [5]), 500, "Unable to parse"),
             ("{not json", 500, "failed to parse"),
             (json.dumps({"inputs": []}), 400, "missing required input")]
    c = grpcclient.InferenceServerClient(server.grpc_url)
    done = queue.Queue()
    for k, t in enumerate(GOOD):
        c.async_infer("embeddinggemma", [text_input([t])], client_timeout=120,
                      callback=lambda result, error, k=k: done.put((k, result, error)))
    with requests.Session() as http:
        for data, status, fragment in cases:
            r = http.post(url, data=data, timeout=60)
            assert r.status_code == status, (data, r.status_code, r.text)
            assert fragment in r.json()["error"], r.text
        ok = http.post(url, data=body([1, 1], "BYTES", [GOOD[3]]), timeout=60)
    assert ok.status_code == 200
    got = {o["name"]: o for o in ok.json()["outputs"]}["EMBEDDING"]
    assert_close(np.array(got["data"], dtype=np.float32).reshape(got["shape"]), good_ref[3:4])
    for _ in GOOD:
        k, r, e = done.get(timeout=130)
        assert e is None, e
        assert_close(r.as_numpy("EMBEDDING"), good_ref[k:k + 1])


NAN_BAIT = ["", " ", "\n" * 5000, "\x00" * 100, "\u200b\u200b", "<pad>", "<pad>" * 3000, "<bos><eos>", "<eos>" * 10,
            "<unk>", "a" * 200_000, "🚀" * 50_000, "\u0301" * 1000, "ﷺ" * 3000]


def test_nan_bait_gives_finite_exact_embeddings(server, checkpoints, good_ref):
    """Inputs that could make a sloppy pipeline produce NaN/Inf (nothing to pool, only specials or padding, the
    longest sequences, combining marks): every embedding finite and equal to the reference."""
    jobs = [("embeddinggemma", [text_input([t])]) for t in NAN_BAIT]
    id_rows = [[2, 1], [2] + [0] * 2046 + [1], [1] * 2048, [0], [2] * 2048]  # direct encoder calls
    for row in id_rows:
        jobs.append(("embeddinggemma_encoder", [raw_input("INPUT_IDS", "INT32", np.array([row], dtype=np.int32))]))
    res = mixed(server, good_ref, jobs)
    ref = np.concatenate([reference(checkpoints["eos"], NAN_BAIT), st_embed_ids(st_model(checkpoints["eos"]), id_rows)])
    for (r, e), want in zip(res, ref):
        assert e is None, e
        assert_close(r.as_numpy("EMBEDDING"), want[None])


def test_bad_seq_len_fails_alone(server, good_ref):
    """Direct encoder calls whose SEQ_LEN lies outside [1, row width], over gRPC (beside good requests) and over
    Triton's HTTP: an INVALID_ARG (HTTP 400) each, the batch unharmed."""
    ids = np.array([[2, 100, 1]], dtype=np.int32)
    jobs = [("embeddinggemma_encoder", [raw_input("INPUT_IDS", "INT32", ids),
                                        raw_input("SEQ_LEN", "INT32", np.array([[n]], dtype=np.int32))])
            for n in (0, -3, 4)]
    for r, e in mixed(server, good_ref, jobs):
        assert r is None
        assert_clean_error(e, "SEQ_LEN values must lie in [1, 3]")
    url = f"http://{server.http_url}/v2/models/embeddinggemma_encoder/infer"
    with requests.Session() as http:
        for n in (0, -3, 4):
            r = http.post(url, json={"inputs": [
                {"name": "INPUT_IDS", "shape": [1, 3], "datatype": "INT32", "data": ids.ravel().tolist()},
                {"name": "SEQ_LEN", "shape": [1, 1], "datatype": "INT32", "data": [n]}]}, timeout=60)
            assert r.status_code == 400, (n, r.status_code, r.text)
            assert "SEQ_LEN values must lie in [1, 3]" in r.json()["error"], r.text


def test_an_encoder_request_over_the_token_budget_is_refused_at_once(server, good_ref):
    """256 x 2048 ids straight to the encoder (524288 tokens: minutes of two CPU cores) is over the default
    --max-request-tokens: refused before any of it is embedded, naming the limit, while the good requests beside
    it are answered exactly."""
    from egemma.stub.budget import DEFAULT
    big = ("embeddinggemma_encoder", ids_input([[2] + [5] * 2046 + [1]] * 256))
    assert 256 * 2048 > DEFAULT
    t0 = time.monotonic()
    [(r, e)] = mixed(server, good_ref, [big])
    assert r is None
    assert_clean_error(e, f"524288 tokens, over this server's limit of {DEFAULT} tokens per request",
                       "--max-request-tokens")
    assert time.monotonic() - t0 < 30, "refused only after a long wait"


def test_a_request_queued_past_the_time_limit_is_refused_with_a_clear_error(start_server, tmp_path):
    """The models' queue time limit (default_queue_policy in their configs; 120 s, here 1 s): requests queued behind
    a long one on the one encoder instance are refused with "Request timeout expired" (gRPC UNAVAILABLE) instead of
    waiting for minutes; the long one is answered."""
    import shutil

    from helpers import ROOT
    repo = tmp_path / "repository"
    shutil.copytree(ROOT / "model_repository", repo, ignore=shutil.ignore_patterns("__pycache__"))
    cfg = repo / "embeddinggemma_encoder" / "config.pbtxt"
    text = cfg.read_text()
    assert text.count("default_timeout_microseconds: 120000000 ") == 1
    cfg.write_text(text.replace("default_timeout_microseconds: 120000000 ", "default_timeout_microseconds: 1000000 "))
    srv = start_server(repository=repo, instances={"embeddinggemma_encoder": 1})
    c, long, done = grpcclient.InferenceServerClient(srv.grpc_url), ["kalo the " * 1500] * 32, queue.Queue()
    c.async_infer("embeddinggemma", [text_input(long)], callback=lambda result, error: done.put((result, error)),
                  client_timeout=300)
    wait_for(lambda: model_stats(c, "embeddinggemma_tokenizer")[0] >= 32, 60, "the long request to reach the encoder")
    behind = fire_concurrently(c, [("embeddinggemma", [text_input(long[:8])]) for _ in range(2)], timeout=300)
    assert done.get(timeout=300)[1] is None
    if any(e is None for _, e in behind):  # the long one was done before they queued: nothing to show
        pytest.skip("the encoder answered the long request before the others queued behind it")
    for _, e in behind:
        assert_clean_error(e, "Request timeout expired", status="StatusCode.UNAVAILABLE")
