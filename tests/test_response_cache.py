"""Triton's response cache (launcher --response-cache-mb). Triton 2.51 keys it on the model, its version and the
input tensors, never on the request parameters: on the ensemble it answers a `dimensions` or `prompt_name` request
with another request's vector (shown first, on that naive setup). Ours caches the encoder step, whose inputs are the
ids (prompt and truncation already applied) and the OPTIONS tensor (dimensions, encoding): every option that changes
the answer is in the key, and a hit has the bits of a fresh computation."""
import shutil

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from helpers import GOOD, ids_input, text_input

DIMS = {"matryoshka_dims": "48,32,16"}  # as the shared server's
CPU = {"embeddinggemma_encoder": 1, "embeddinggemma_tokenizer": 1}
OPTION_SETS = [{}, {"dimensions": 32}, {"prompt_name": "query"}, {"prompt": "search: "}, {"encoding": "ubinary"},
               {"dimensions": 16, "encoding": "binary"}]


def ask(c, text, params):
    out = {"ubinary": "EMBEDDING_UBINARY", "binary": "EMBEDDING_BINARY"}.get(params.get("encoding"), "EMBEDDING")
    return c.infer("embeddinggemma", [text_input([text])], parameters=params or None,
                   outputs=[grpcclient.InferRequestedOutput(out)]).as_numpy(out)


def hits(c, model) -> int:
    s = c.get_inference_statistics(model, as_json=True)["model_stats"][0]["inference_stats"]
    return int(s.get("cache_hit", {}).get("count", 0))


def test_naive_ensemble_cache_answers_with_another_requests_vector(start_server, tmp_path):
    """The setup this design avoids: the cache on the ensemble. A request for 32 dimensions gets the 48 of the
    request before it; a query-prompt request gets the plain text's vector."""
    from egemma.ops.repository import REPO
    repo = tmp_path / "naive"
    shutil.copytree(REPO, repo)
    cfg = repo / "embeddinggemma" / "config.pbtxt"
    cfg.write_text(cfg.read_text() + "\nresponse_cache { enable: true }\n")
    c = grpcclient.InferenceServerClient(start_server(repository=repo, response_cache_mb=16, params=DIMS,
                                                      instances=CPU).grpc_url)
    full = ask(c, GOOD[0], {})
    assert ask(c, GOOD[0], {"dimensions": 32}).shape == full.shape == (1, 48)  # wrong: 32 were asked for
    assert np.array_equal(ask(c, GOOD[0], {"prompt_name": "query"}), full)  # wrong: the prompt changes the vector
    assert hits(c, "embeddinggemma") == 2


def test_encoder_cache_keys_on_every_option_and_hits_equal_fresh(start_server, server):
    c = grpcclient.InferenceServerClient(start_server(response_cache_mb=16, params=DIMS, instances=CPU).grpc_url)
    fresh = grpcclient.InferenceServerClient(server.grpc_url)  # the shared server: no cache
    texts = [GOOD[1], GOOD[2] + " " + GOOD[3]]
    for text in texts:
        for params in OPTION_SETS:
            want = ask(fresh, text, params)
            before = hits(c, "embeddinggemma_encoder")
            first, again = ask(c, text, params), ask(c, text, params)
            assert np.array_equal(first, want) and np.array_equal(again, want), params
            assert hits(c, "embeddinggemma_encoder") == before + 1, params  # the second was a hit
        # truncate=false on a text that fits embeds the default's ids: the key is what is embedded, so both hit
        before = hits(c, "embeddinggemma_encoder")
        assert np.array_equal(ask(c, text, {"truncate": False}), ask(fresh, text, {}))
        assert hits(c, "embeddinggemma_encoder") == before + 1
    answers = [ask(c, texts[0], p).tobytes() for p in OPTION_SETS]
    assert len(set(answers)) == len(answers)  # no option set was answered with another's vector


def test_direct_encoder_calls_must_carry_options_when_cached(start_server):
    """With the cache on, the encoder refuses calls without OPTIONS, so that no answer is cached under a key without
    it (one that a request asking other dimensions by parameter would hit). A call that carries it gets what it asks
    for; parameters that disagree with it are refused where it computes (a hit answers as OPTIONS asks)."""
    c = grpcclient.InferenceServerClient(start_server(response_cache_mb=16, params=DIMS, instances=CPU).grpc_url)
    opts = grpcclient.InferInput("OPTIONS", [1, 2], "INT32")
    opts.set_data_from_numpy(np.array([[32, 0]], dtype=np.int32))
    for rows, params in (([[2, 11, 1]], None), ([[2, 12, 1]], {"dimensions": 32})):
        with pytest.raises(InferenceServerException, match="send the OPTIONS input"):
            c.infer("embeddinggemma_encoder", ids_input(rows), parameters=params)
    rows = [[2, 11, 12, 13, 1]]
    assert c.infer("embeddinggemma_encoder", [*ids_input(rows), opts]).as_numpy("EMBEDDING").shape == (1, 32)
    with pytest.raises(InferenceServerException, match="disagree"):  # other ids: a miss, so the encoder sees it
        c.infer("embeddinggemma_encoder", [*ids_input([[2, 14, 1]]), opts], parameters={"dimensions": 16})


def test_triton_caches_an_error_as_an_empty_answer(start_server):
    """Triton 2.51 keeps a model's error response in the cache as an answer with no outputs: the same bad request
    again gets no error and no EMBEDDING. So every check that can refuse an ensemble request runs in the tokenizer,
    never cached (dimensions included), and the gateway checks ids before it calls the encoder. An upgrade that
    fixes this shows here."""
    c = grpcclient.InferenceServerClient(start_server(response_cache_mb=16, params=DIMS, instances=CPU).grpc_url)
    for _ in range(2):  # through the ensemble: refused both times, by the tokenizer
        with pytest.raises(InferenceServerException, match="dimensions 7 is not supported"):
            ask(c, GOOD[0], {"dimensions": 7})
    opts = grpcclient.InferInput("OPTIONS", [1, 2], "INT32")
    opts.set_data_from_numpy(np.array([[0, 0]], dtype=np.int32))
    bad = [*ids_input([[2, 10 ** 6, 1]]), opts]
    with pytest.raises(InferenceServerException, match="vocabulary"):
        c.infer("embeddinggemma_encoder", bad)
    again = c.infer("embeddinggemma_encoder", bad)  # a direct caller's bad ids, the second time
    assert again.as_numpy("EMBEDDING") is None
