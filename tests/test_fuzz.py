"""Property-based fuzzing of the tokenizer model and the ensemble through the shared real tritonserver: random
unicode, control characters, lone surrogates, huge repeats and raw bytes either embed exactly or fail cleanly,
and the server keeps serving."""
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
