"""The Triton adapters' per-request guard, through a real tritonserver: a tokenizer that raises on some texts fails
only the requests holding them, inside one execute of the tokenizer model, while the others in that execute
still equal sentence-transformers, and the server keeps serving."""
import json
import shutil

import pytest
import tritonclient.grpc as grpcclient
from tokenizers import Tokenizer

from helpers import (ROOT, assert_clean_error, assert_close, fire_concurrently, make_texts, model_stats, reference,
                     text_input, wait_for)

SNOWMAN = "☃"  # not in the generated checkpoint's vocabulary: without byte fallback it needs the unk token
QUEUE_DELAY_US = 3_000_000  # the tokenizer waits this long for a batch to fill: every request sent lands in one
GOOD = make_texts(8, 120, seed=12)


@pytest.fixture
def broken_tokenizer(checkpoints, tmp_path):
    """The checkpoint's resolved tokenizer.json with its byte fallback off and its BPE unk_token naming a token the
    vocabulary lacks: any character outside the vocabulary makes `tokenizers` raise "Unk token ... not found";
    other texts get the same ids as before. (Without byte fallback egemma/kernels/bpe.c does not serve it: the tokenizer
    model runs Hugging Face's.)"""
    from egemma.engine.tokenizer import resolved_tokenizer_json
    raw = resolved_tokenizer_json(checkpoints["eos"])
    d = json.loads(raw)
    assert d["model"]["type"] == "BPE" and "<no-such-token>" not in d["model"]["vocab"]
    d["model"]["unk_token"], d["model"]["byte_fallback"] = "<no-such-token>", False
    broken = json.dumps(d)
    good, bad = Tokenizer.from_str(raw), Tokenizer.from_str(broken)
    with pytest.raises(Exception, match="Unk token"):
        bad.encode(f"snow {SNOWMAN} man")
    assert good.encode(f"snow {SNOWMAN} man").ids  # the original falls back to its bytes
    for t in GOOD:
        assert bad.encode(t).ids == good.encode(t).ids
    f = tmp_path / "broken-tokenizer.json"
    f.write_text(broken)
    return f


@pytest.fixture
def batching_repository(tmp_path):
    """model_repository with the tokenizer model's dynamic batcher waiting QUEUE_DELAY_US for company."""
    repo = tmp_path / "repository"
    shutil.copytree(ROOT / "model_repository", repo, ignore=shutil.ignore_patterns("__pycache__"))
    cfg = repo / "embeddinggemma_tokenizer" / "config.pbtxt"
    text = cfg.read_text()
    assert text.count("max_queue_delay_microseconds: 0\n") == 1
    cfg.write_text(text.replace("max_queue_delay_microseconds: 0\n",
                                f"max_queue_delay_microseconds: {QUEUE_DELAY_US}\n"))
    return repo


def test_a_tokenizer_failure_costs_only_its_requests(start_server, checkpoints, broken_tokenizer,
                                                     batching_repository):
    srv = start_server(repository=batching_repository, params={"tokenizer_json": str(broken_tokenizer)},
                       instances={"embeddinggemma_encoder": 1, "embeddinggemma_tokenizer": 1})
    c = grpcclient.InferenceServerClient(srv.grpc_url)
    bad = [[f"snow {SNOWMAN} man"], [SNOWMAN], ["fine text", f"but {SNOWMAN} here"]]  # a request: all or nothing
    texts = [[t] for t in GOOD]
    for k, b in enumerate(bad):  # interleaved with the good ones
        texts.insert(3 * k + 1, b)
    before = model_stats(c, "embeddinggemma_tokenizer")
    res = fire_concurrently(c, [("embeddinggemma", [text_input(t)]) for t in texts])
    ref = iter(reference(checkpoints["eos"], GOOD))
    for t, (r, e) in zip(texts, res):
        if t in bad:
            assert r is None
            assert_clean_error(e, "tokenizer failure", "Unk token", status="StatusCode.INTERNAL")
        else:
            assert e is None, e
            assert_close(r.as_numpy("EMBEDDING"), next(ref)[None])
    # One execute held them all: the batched call raised, and the fallback answered request by request.
    rows = sum(map(len, texts))
    wait_for(lambda: model_stats(c, "embeddinggemma_tokenizer")[0] - before[0] >= rows, 30,
             "the tokenizer's statistics")
    after = model_stats(c, "embeddinggemma_tokenizer")
    assert (after[0] - before[0], after[1] - before[1]) == (rows, 1), (before, after)

    assert srv.proc.poll() is None and c.is_server_live() and c.is_server_ready()
    [(r, e), (r2, e2)] = fire_concurrently(c, [("embeddinggemma", [text_input(GOOD[:3])]),
                                               ("embeddinggemma", [text_input([SNOWMAN])])])
    assert e is None, e
    assert_close(r.as_numpy("EMBEDDING"), reference(checkpoints["eos"], GOOD[:3]))
    assert r2 is None
    assert_clean_error(e2, "tokenizer failure", status="StatusCode.INTERNAL")
