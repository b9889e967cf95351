"""Through the real tritonserver: HTTP and gRPC, batches in one request, concurrent mixed-length requests that
dynamic batching packs together, direct token-id calls, per-request errors. Every answer is compared with
sentence-transformers on the same checkpoint."""
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from helpers import (assert_close, fire_concurrently, ids_input, make_texts, model_stats, reference, st_embed_ids,
                     st_model, text_input, wait_for)


def test_http_batch_in_one_request(server, checkpoints):
    texts = make_texts(12, 200, seed=1) + ["", "<eos>"]
    c = httpclient.InferenceServerClient(server.http_url)
    got = c.infer("embeddinggemma", [text_input(texts, httpclient)]).as_numpy("EMBEDDING")
    assert_close(got, reference(checkpoints["eos"], texts))


def test_grpc_batch_in_one_request(server, checkpoints):
    texts = make_texts(20, 500, seed=2)
    c = grpcclient.InferenceServerClient(server.grpc_url)
    got = c.infer("embeddinggemma", [text_input(texts)]).as_numpy("EMBEDDING")
    assert_close(got, reference(checkpoints["eos"], texts))


def test_over_long_text_is_truncated_like_sentence_transformers(server, checkpoints):
    texts = ["kalo the " * 3000, "short"]
    c = grpcclient.InferenceServerClient(server.grpc_url)
    got = c.infer("embeddinggemma", [text_input(texts)]).as_numpy("EMBEDDING")
    assert_close(got, reference(checkpoints["eos"], texts))


def test_concurrent_single_text_requests_are_batched_and_each_correct(server, checkpoints):
    texts = make_texts(48, 450, seed=4)[::-1]
    ref = reference(checkpoints["eos"], texts)
    c = grpcclient.InferenceServerClient(server.grpc_url)
    before = model_stats(c, "embeddinggemma_encoder")
    res = fire_concurrently(c, [("embeddinggemma", [text_input([t])]) for t in texts])
    for (r, e), want in zip(res, ref):
        assert e is None, e
        assert_close(r.as_numpy("EMBEDDING"), want[None])
    # Triton updates its statistics just after the responses go out.
    wait_for(lambda: model_stats(c, "embeddinggemma_encoder")[0] - before[0] >= 48, 30, "the encoder's statistics")
    after = model_stats(c, "embeddinggemma_encoder")
    inferences, executions = after[0] - before[0], after[1] - before[1]
    assert inferences == 48 and executions < inferences  # dynamic batching packed requests together


def test_encoder_takes_token_ids_directly_and_bad_requests_fail_alone(server, checkpoints):
    rng = np.random.default_rng(0)
    rows = [[2, *rng.integers(4, 1000, n).tolist(), 1] for n in (1, 40, 300)]
    ref = st_embed_ids(st_model(checkpoints["eos"]), rows)
    c = grpcclient.InferenceServerClient(server.grpc_url)
    jobs = [("embeddinggemma_encoder", ids_input(rows)),
            ("embeddinggemma_encoder", ids_input([[2, 99999, 1]])),  # outside the vocabulary
            ("embeddinggemma_encoder", ids_input([rows[1]], seq_len=False)),  # no SEQ_LEN: full rows
            ("embeddinggemma_encoder", ids_input([rows[2]])),
            ("embeddinggemma_encoder", ids_input(rows, pad=-7)), ]  # padding past SEQ_LEN is never read
    (good, e0), (_, bad), (nolen, e2), (one, e3), (padded, e4) = fire_concurrently(c, jobs)
    assert e0 is None and e2 is None and e3 is None and e4 is None
    assert bad is not None and "vocabulary" in str(bad)
    assert_close(good.as_numpy("EMBEDDING"), ref)
    assert_close(nolen.as_numpy("EMBEDDING"), ref[1:2])
    assert_close(one.as_numpy("EMBEDDING"), ref[2:3])
    assert_close(padded.as_numpy("EMBEDDING"), ref)


def test_invalid_utf8_is_a_clean_error(server):
    c = grpcclient.InferenceServerClient(server.grpc_url)
    i = grpcclient.InferInput("TEXT", [1, 1], "BYTES")
    i.set_data_from_numpy(np.array([[b"\xff\xfe bad"]], dtype=object))
    with pytest.raises(Exception, match="UTF-8"):
        c.infer("embeddinggemma", [i])
    assert c.is_server_ready()


def test_checkpoint_resolution_order(checkpoints, monkeypatch, tmp_path):
    from egemma.ops.repository import resolve_checkpoint
    monkeypatch.setenv("EMBEDDINGGEMMA_PATH", str(checkpoints["noeos"]))
    assert resolve_checkpoint(str(checkpoints["eos"])) == checkpoints["eos"].resolve()  # --model wins
    assert resolve_checkpoint(None) == checkpoints["noeos"].resolve()
    with pytest.raises(SystemExit, match="does not exist"):
        resolve_checkpoint(str(tmp_path / "missing"))
