"""Per-request options through the real server against sentence-transformers on the same checkpoint, every
error path as a clean per-request INVALID_ARG inside a mixed concurrent batch, and the metrics."""
import urllib.request

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from sentence_transformers.util import quantize_embeddings

from egemma.stub.metrics import STUB_FAMILIES, read_stats, render
from helpers import assert_close, fire_concurrently, make_texts, reference, st_model, text_input

TEXTS = make_texts(10, 200, seed=7)


def infer(server, texts, output="EMBEDDING", **params):
    c = grpcclient.InferenceServerClient(server.grpc_url)
    return c.infer("embeddinggemma", [text_input(texts)], parameters=params,
                   outputs=[grpcclient.InferRequestedOutput(output)]).as_numpy(output)


@pytest.mark.parametrize("prompt_name", ["query", "document", "Retrieval-query", "STS", "Classification"])
def test_prompt_name(server, checkpoints, prompt_name):
    assert_close(infer(server, TEXTS, prompt_name=prompt_name),
                   reference(checkpoints["eos"], TEXTS, prompt_name=prompt_name))


def test_literal_prompt_over_http(server, checkpoints):
    c = httpclient.InferenceServerClient(server.http_url)
    got = c.infer("embeddinggemma", [text_input(TEXTS, httpclient)],
                  parameters={"prompt": "task: custom | query: "}).as_numpy("EMBEDDING")
    assert_close(got, reference(checkpoints["eos"], TEXTS, prompt="task: custom | query: "))


@pytest.mark.parametrize("dim", [32, 16, 48])
def test_dimensions_truncate_then_renormalise(server, checkpoints, dim):
    got = infer(server, TEXTS, dimensions=dim)
    ref = st_model(checkpoints["eos"]).encode(TEXTS, truncate_dim=dim, normalize_embeddings=True)
    assert got.shape == (len(TEXTS), dim)
    assert_close(got, ref)


@pytest.mark.parametrize("encoding,output", [("ubinary", "EMBEDDING_UBINARY"), ("binary", "EMBEDDING_BINARY")])
def test_binary_encodings(server, checkpoints, encoding, output):
    got = infer(server, TEXTS, output=output, encoding=encoding, dimensions=32)
    ref = quantize_embeddings(st_model(checkpoints["eos"]).encode(TEXTS, truncate_dim=32, normalize_embeddings=True),
                              precision=encoding)
    assert got.dtype == ref.dtype and got.shape == (len(TEXTS), 4)
    # a bit can only flip where the float sits within rounding of zero
    assert (got != ref).mean() <= 0.01


def test_truncate_true_is_the_default(server, checkpoints):
    long = ["kalo the " * 3000]
    assert_close(infer(server, long, truncate=True), reference(checkpoints["eos"], long))


def test_error_paths_are_per_request_inside_a_mixed_concurrent_batch(server, checkpoints):
    c = grpcclient.InferenceServerClient(server.grpc_url)
    good = make_texts(12, 300, seed=8)
    bad = [({"prompt_name": "nope"}, "Retrieval-query"), ({"dimensions": 20}, "choose from"),
           ({"truncate": False}, "over the 2048-token limit"), ({"encoding": "int4"}, "encoding must be one of"),
           ({"colour": "blue"}, "unknown parameters"), ({"dimensions": "x"}, "integer"),
           # no coercion, and no string cut at a NUL (over gRPC Triton cuts it before the model sees it: docs/limits.md)
           ({"dimensions": "32"}, "dimensions must be an integer"), ({"dimensions": True}, "dimensions must be"),
           ({"dimensions": 32.5}, "dimensions must be"), ({"dimensions": 2 ** 40}, "dimensions must be"),
           ({"truncate": "false"}, "truncate must be true or false")]
    jobs = [("embeddinggemma", [text_input([t])], {}, None) for t in good]
    for params, needle in bad:  # interleaved with the good ones
        text = "kalo the " * 3000 if params.get("truncate") is False else "fine text"
        jobs.insert(len(jobs) // 2, ("embeddinggemma", [text_input([text])], params, needle))
    results = fire_concurrently(c, [(m, i) for m, i, _, _ in jobs], [p for _, _, p, _ in jobs])
    ref = iter(reference(checkpoints["eos"], good))
    for (r, e), (_, _, _, needle) in zip(results, jobs):
        if needle is None:
            assert e is None, e
            assert_close(r.as_numpy("EMBEDDING"), next(ref)[None])
        else:
            assert e is not None and needle in str(e) and "INVALID_ARG" in str(e), (needle, e)
    assert c.is_server_ready()


def test_metrics_are_exported(server):
    """The models' metrics are the stubs' files (the gateway renders them: tests/test_observability.py), each quantity
    once: none on Triton's port, where Triton's own counts are."""
    infer(server, ["count me"])
    text = render(STUB_FAMILIES, read_stats(server.heartbeat_dir, STUB_FAMILIES))
    values = {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines() if ln.startswith("egemma_")}
    for name in ("egemma_batch_tokens_sum", "egemma_batch_size_count", "egemma_tokenize_duration_seconds_count",
                 "egemma_engine_duration_seconds_sum", "egemma_encoder_seconds_total"):
        assert values[name] > 0, name
    assert values["egemma_eager_runs_total"] + values["egemma_graph_replays_total"] > 0
    triton = urllib.request.urlopen(f"http://{server.host}:{server.metrics_port}/metrics").read().decode()
    assert "nv_inference_count{" in triton and not any(ln.startswith("egemma_") for ln in triton.splitlines())
