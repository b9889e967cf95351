"""Texts over the model's 2048 tokens (issue #44, docs/long-documents.md): long_text=chunk against
sentence-transformers' own modules run on each window's ids and combined by the documented rule (mean pooling over
all tokens of all windows, then Dense and Normalize), per-window vectors and spans, and the bad inputs."""
import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient

from helpers import assert_clean_error, assert_close, st_embed_ids, st_ids, st_model, text_input

CHUNK_OUT = ["EMBEDDING", "NUM_TOKENS", "CHUNK_EMBEDDING", "CHUNK_OF", "CHUNK_SPAN"]


def windows(model, text: str, prompt: str = "", overlap: int = 0) -> tuple[list[list[int]], list[tuple[int, int]]]:
    """The windows' ids and text-token spans by the documented rule, from sentence-transformers' tokenizer."""
    tk = model.tokenizer
    ids = tk(prompt + text, add_special_tokens=False)["input_ids"]
    pids = tk(prompt, add_special_tokens=False)["input_ids"] if prompt else []
    p = next((k for k, (a, b) in enumerate(zip(pids, ids)) if a != b), min(len(pids), len(ids)))
    head, body, room = [tk.bos_token_id] + ids[:p], ids[p:], model.max_seq_length - 2 - p
    spans = [(0, min(room, len(body)))]
    while spans[-1][1] < len(body):
        a = spans[-1][0] + room - overlap
        spans.append((a, min(a + room, len(body))))
    return [head + body[a:b] + [tk.eos_token_id] for a, b in spans], spans


def combined(model, seqs: list[list[int]]) -> np.ndarray:
    """sentence-transformers' Transformer and Pooling on each window, the means weighted by the windows' lengths,
    then its remaining modules (Dense, Dense, Normalize)."""
    pooled = []
    with torch.inference_mode():
        for s in seqs:
            f = {"input_ids": torch.tensor([s]), "attention_mask": torch.ones(1, len(s), dtype=torch.long),
                 "modality": "text"}
            for m in list(model)[:2]:
                f = m(f)
            pooled.append(f["sentence_embedding"][0].double())
        w = torch.tensor([len(s) for s in seqs], dtype=torch.float64)
        f = {"sentence_embedding": ((torch.stack(pooled) * w[:, None]).sum(0) / w.sum()).float()[None]}
        for m in list(model)[2:]:
            f = m(f)
    return f["sentence_embedding"][0].numpy()


def infer(server, texts, outputs=("EMBEDDING", "NUM_TOKENS"), **params):
    c = grpcclient.InferenceServerClient(server.grpc_url)
    r = c.infer("embeddinggemma", [text_input(texts)], parameters=params,
                outputs=[grpcclient.InferRequestedOutput(o) for o in outputs])
    return {o: r.as_numpy(o) for o in outputs}


def words(n: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    vocab = "the of search result query document kalo mars planet red grüße 日本 🚀 alpha beta".split()
    return " ".join(rng.choice(vocab, n))


LONG = [words(3000, 1), words(7000, 2)]


@pytest.mark.parametrize("kw", [{}, {"prompt_name": "document"}, {"chunk_overlap": 100}])
def test_chunk_is_the_token_weighted_mean_of_the_windows(server, checkpoints, kw):
    m = st_model(checkpoints["eos"])
    texts = [*LONG, "short text", ""]
    got = infer(server, texts, long_text="chunk", **kw)
    prompt = m.prompts[kw["prompt_name"]] if "prompt_name" in kw else ""
    ws = [windows(m, t, prompt, kw.get("chunk_overlap", 0))[0] for t in texts]
    assert [len(w) for w in ws][:2] >= [2, 3]
    assert_close(got["EMBEDDING"], np.stack([combined(m, w) for w in ws]))
    # NUM_TOKENS counts what was embedded: every window, its BOS, prompt and EOS included
    assert got["NUM_TOKENS"].reshape(-1).tolist() == [sum(map(len, w)) for w in ws]


def test_a_text_that_fits_gives_todays_vector(server, checkpoints):
    m = st_model(checkpoints["eos"])
    body = m.tokenizer(words(3000, 3), add_special_tokens=False)["input_ids"]
    edge = m.tokenizer.decode(body[:m.max_seq_length - 2])  # exactly one window
    assert len(m.tokenizer(edge, add_special_tokens=False)["input_ids"]) == m.max_seq_length - 2
    texts = ["fits", "   ", edge, edge + " the"]
    chunk, today = infer(server, texts, long_text="chunk"), infer(server, texts)
    assert (chunk["EMBEDDING"][:3] == today["EMBEDDING"][:3]).all()
    assert chunk["NUM_TOKENS"][3, 0] > m.max_seq_length  # one token over: a second window
    assert_close(chunk["EMBEDDING"][3:], combined(m, windows(m, texts[3])[0])[None])


def test_return_chunks_gives_each_window_with_its_spans(server, checkpoints):
    m = st_model(checkpoints["eos"])
    texts = ["short", LONG[0], LONG[1]]
    got = infer(server, texts, CHUNK_OUT, long_text="chunk", return_chunks=True, prompt_name="query")
    prompt = m.prompts["query"]
    ws = [windows(m, t, prompt) for t in texts]
    assert got["CHUNK_OF"].reshape(-1).tolist() == [j for j, (w, _) in enumerate(ws) for _ in w]
    assert_close(got["CHUNK_EMBEDDING"], st_embed_ids(m, [s for w, _ in ws for s in w]))
    assert_close(got["EMBEDDING"], np.stack([combined(m, w) for w, _ in ws]))
    spans, k, same = got["CHUNK_SPAN"].tolist(), 0, 0
    for j, (w, sp) in enumerate(ws):
        for s, (a, b) in zip(w, sp):
            ta, tb, ca, cb = spans[k]
            k += 1
            assert (ta, tb) == (a, b)
            # the characters reproduce the window's text tokens; where that text tokenises (after the prompt) into
            # the same tokens, sentence-transformers on it gives the window's vector (a window may start or end
            # inside a word, whose piece alone tokenises otherwise: docs/long-documents.md)
            piece, body = texts[j][ca:cb], s[len(s) - 1 - (b - a):-1]
            assert m.tokenizer.decode(body).strip() == piece.strip()
            if st_ids(m, [piece], prompt=prompt)[0] == s:
                same += 1
                assert_close(got["CHUNK_EMBEDDING"][k - 1:k], m.encode([piece], prompt=prompt))
    assert k == len(spans) and same >= 1


def test_return_chunks_with_dimensions(server, checkpoints):
    got = infer(server, [LONG[0]], CHUNK_OUT, long_text="chunk", return_chunks=True, dimensions=32)
    assert got["EMBEDDING"].shape == (1, 32) and got["CHUNK_EMBEDDING"].shape == (len(got["CHUNK_OF"]), 32)
    assert np.allclose(np.linalg.norm(got["CHUNK_EMBEDDING"], axis=1), 1, atol=1e-5)


@pytest.mark.parametrize("params,needle", [
    ({"long_text": "split"}, "one of truncate, error, chunk"),
    ({"long_text": "chunk", "chunk_overlap": 2046}, "chunk_overlap 2046 must lie in [0, 2046)"),
    ({"long_text": "chunk", "chunk_overlap": -1}, "chunk_overlap must be an integer in [0, 2147483647], got -1"),
    ({"long_text": "chunk", "chunk_overlap": "x"}, "chunk_overlap must be an integer in [0, 2147483647], got \"x\""),
    ({"chunk_overlap": 5}, "apply to long_text=chunk"),
    ({"long_text": "chunk", "prompt": "x " * 2100}, "leaving no room for text"),
    ({"long_text": "chunk", "truncate": False}, "contradicts long_text=chunk"),
    ({"long_text": "chunk", "return_chunks": True, "encoding": "ubinary"}, "leave encoding float"),
    ({"long_text": "error"}, "over the 2048-token limit"),
])
def test_bad_input(server, params, needle):
    c = grpcclient.InferenceServerClient(server.grpc_url)
    with pytest.raises(Exception) as e:
        c.infer("embeddinggemma", [text_input([LONG[0]])], parameters=params)
    assert_clean_error(e.value, needle)


def test_deterministic_chunked_texts(server):
    """The same long text alone and beside others in one request: the same vector (windows are rows of one batch)."""
    alone = infer(server, [LONG[1]], long_text="chunk")["EMBEDDING"]
    beside = infer(server, ["a", LONG[0], LONG[1], "b"], long_text="chunk")["EMBEDDING"]
    np.testing.assert_allclose(beside[2], alone[0], atol=1e-6)


def test_every_protocol_gives_the_same_vectors(server, api_gateway, checkpoints):
    """KServe gRPC and HTTP, OpenAI and TEI, texts and their token ids (windowed as the text is): the same vectors,
    and usage counts every window."""
    import requests
    import tritonclient.http as httpclient
    m = st_model(checkpoints["eos"])
    texts, opts = [LONG[0], "short"], {"long_text": "chunk", "chunk_overlap": 64}
    ref = infer(server, texts, **opts)
    url = api_gateway.url
    h = httpclient.InferenceServerClient(url.split("://")[1])
    kserve_http = h.infer("embeddinggemma", [text_input(texts, httpclient)], parameters=opts).as_numpy("EMBEDDING")
    ids = [m.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    oa = [requests.post(f"{url}/v1/embeddings", json={"input": x, **opts}, timeout=120).json() for x in (texts, ids)]
    tei = [requests.post(f"{url}/embed", json={"inputs": x, **opts}, timeout=120).json() for x in (texts, ids)]
    for got in [kserve_http, *(np.array([d["embedding"] for d in r["data"]], np.float32) for r in oa),
                *(np.array(r, np.float32) for r in tei)]:
        assert_close(got, ref["EMBEDDING"])
    assert [r["usage"]["prompt_tokens"] for r in oa] == [int(ref["NUM_TOKENS"].sum())] * 2
    bad = requests.post(f"{url}/v1/embeddings", json={"input": texts, "long_text": "whole"}, timeout=30)
    assert bad.status_code == 400 and "one of truncate, error, chunk" in bad.json()["error"]["message"]
    bad = requests.post(f"{url}/embed", json={"inputs": ids, "long_text": "chunk", "chunk_overlap": 5000}, timeout=30)
    assert bad.status_code == 422 and "chunk_overlap 5000" in bad.json()["error"]


def test_egemma_embed_long_text_chunk(server, tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    import pyarrow.parquet as pq
    texts = [LONG[0], "short", LONG[1]]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    exe = Path(sys.executable).with_name("egemma-embed")
    r = subprocess.run([exe, src, "-o", tmp_path / "out.parquet", "--url", server.grpc_url, "--long-text", "chunk",
                        "--chunk-overlap", "32", "--progress", "none"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    t = pq.read_table(tmp_path / "out.parquet")
    ref = infer(server, texts, long_text="chunk", chunk_overlap=32)
    assert_close(np.array(t["embedding"].to_pylist(), np.float32), ref["EMBEDDING"])
    assert t["num_tokens"].to_pylist() == ref["NUM_TOKENS"].reshape(-1).tolist()
    bad = subprocess.run([exe, src, "-o", tmp_path / "bad.parquet", "--url", server.grpc_url, "--long-text", "all",
                          "--progress", "none"], capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "one of truncate, error, chunk" in bad.stderr


def test_real_checkpoint_chunk_parity(real_server, real_checkpoint):
    """google/embeddinggemma-300m: its prompts (ending in a space that joins the text's first word), its tokenizer."""
    m = st_model(real_checkpoint)
    texts = ["Mars, known for its reddish appearance, is often referred to as the Red Planet. Grüße 🚀 " * 180,
             "Which planet is known as the Red Planet?"]
    got = infer(real_server, texts, CHUNK_OUT, long_text="chunk", prompt_name="document", chunk_overlap=16,
                return_chunks=True)
    ws = [windows(m, t, m.prompts["document"], 16) for t in texts]
    assert len(ws[0][0]) >= 2
    assert_close(got["EMBEDDING"], np.stack([combined(m, w) for w, _ in ws]))
    assert_close(got["CHUNK_EMBEDDING"], st_embed_ids(m, [s for w, _ in ws for s in w]))
    assert got["CHUNK_SPAN"][:, :2].tolist() == [list(s) for _, sp in ws for s in sp]


def test_engine_chunked_texts_have_one_bit_pattern_in_any_batch(checkpoints):
    """deterministic=true: a long text's vector has the same bits alone and among other texts, in any order."""
    from egemma.engine import Engine, EngineConfig
    from egemma.engine.windows import cut, split
    e = Engine(EngineConfig(str(checkpoints["eos"]), deterministic=True))
    rng = np.random.default_rng(5)
    seqs = [np.concatenate([[2], rng.integers(4, e.cfg.vocab_size, n), [1]]).astype(np.int32)
            for n in (5000, 2046, 2047, 30, 9000)]
    texts = [split(cut(s, 0, 2048, 50)[0], 2048) for s in seqs]
    alone = np.concatenate([e.embed(w, [len(w)]) for w in texts])
    for order in ([0, 1, 2, 3, 4], [4, 3, 2, 1, 0], [3, 0, 3, 4]):
        got = e.embed([w for k in order for w in texts[k]], [len(texts[k]) for k in order])
        assert all(np.array_equal(got[j], alone[k]) for j, k in enumerate(order)), order


def test_egemma_embed_a_row_per_chunk(server, tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    import pyarrow.parquet as pq
    texts = [LONG[0], "", "short", LONG[1]]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": f"d{k}", "text": t}) + "\n" for k, t in enumerate(texts)))
    exe = Path(sys.executable).with_name("egemma-embed")
    r = subprocess.run([exe, src, "-o", tmp_path / "out.parquet", "--url", server.grpc_url, "--long-text", "chunk",
                        "--chunks", "--id-field", "id", "--batch", "2", "--progress", "none"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode in (0, 1), r.stderr  # the empty text may be a bad row
    t = pq.read_table(tmp_path / "out.parquet").to_pydict()
    ref = infer(server, texts, CHUNK_OUT, long_text="chunk", return_chunks=True)
    keep = [k for k, line in enumerate(ref["CHUNK_OF"].reshape(-1) + 1) if line in set(t["line"])]
    assert_close(np.array(t["embedding"], np.float32), ref["CHUNK_EMBEDDING"][keep])
    spans = ref["CHUNK_SPAN"][keep]
    assert [list(x) for x in zip(t["token_start"], t["token_end"], t["char_start"], t["char_end"])] == spans.tolist()
    of = ref["CHUNK_OF"].reshape(-1)[keep]
    assert t["id"] == [f"d{k}" for k in of] and t["line"] == (of + 1).tolist()
    assert t["chunk"] == [int((of[:j] == of[j]).sum()) for j in range(len(of))]
    got = {line: sum(n for n, ln in zip(t["num_tokens"], t["line"]) if ln == line) for line in set(t["line"])}
    assert got == {k + 1: int(ref["NUM_TOKENS"][k, 0]) for k in set(of.tolist())}
