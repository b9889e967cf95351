"""One text, one vector: the same bits whatever else is in the batch, whichever encoder instance serves it, through
every protocol (KServe gRPC and HTTP, OpenAI float and base64, TEI), and for token ids as for their text. On CPU the
engine pads its tokens to a multiple of 16 and pools each sequence alone (egemma.engine.engine.forward_eager); on the
GPU the kernel choices do it (egemma.engine.tuning). Every comparison is np.array_equal."""
import base64
import concurrent.futures as cf

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from helpers import make_texts, text_input

LENGTHS_WORDS = [1, 2, 5, 30, 200, 900, 3000]  # the last is cut to 2048 tokens


@pytest.fixture(scope="module")
def texts():
    rng = np.random.default_rng(7)
    return [t for n in LENGTHS_WORDS for t in make_texts(2, n, seed=n)] + make_texts(40, 60, seed=1) \
        + [" ".join(rng.choice(["kalo", "Mars", "red", "日本", "x"], int(k))) for k in rng.integers(1, 400, 10)]


def compositions(n: int, count: int = 24):
    """count batches of 1-64 row indices out of n, mixed lengths, each row at other positions and neighbours."""
    rng = np.random.default_rng(3)
    sizes = [1, 2, 3, 64, 63, 17] + rng.integers(1, 65, count - 6).tolist()
    return [rng.choice(n, size=min(s, n), replace=s > n).tolist() for s in sizes]


def test_engine_rows_have_one_bit_pattern_in_any_batch(checkpoints):
    """In process, no server: >= 20 compositions of 1-64 sequences up to 2048 tokens against each alone."""
    from egemma.engine import Engine, EngineConfig
    e = Engine(EngineConfig(str(checkpoints["eos"]), deterministic=True))
    rng = np.random.default_rng(0)
    lengths = [2, 3, 5, 15, 16, 17, 33, 300, 2047, 2048] + rng.integers(2, 1200, 30).tolist()
    seqs = [np.concatenate([[2], rng.integers(4, e.cfg.vocab_size, n - 2), [1]]).astype(np.int32) for n in lengths]
    alone = np.concatenate([e.embed([s]) for s in seqs])
    for batch in compositions(len(seqs)):
        got = e.embed([seqs[i] for i in batch])
        bad = [i for j, i in enumerate(batch) if not np.array_equal(got[j], alone[i])]
        assert not bad, (batch, bad)


def test_server_rows_one_bit_pattern_across_compositions_and_instances(start_server, texts):
    """Two encoder instances; every composition sent several times at once (the instances and Triton's dynamic
    batcher mix them further), every row equal to the text sent alone."""
    s = start_server(instances={"embeddinggemma_encoder": 2}, params={"deterministic": "true"})
    c = grpcclient.InferenceServerClient(s.grpc_url)
    alone = np.concatenate([c.infer("embeddinggemma", [text_input([t])]).as_numpy("EMBEDDING") for t in texts])
    batches = compositions(len(texts)) * 2
    with cf.ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda b: grpcclient.InferenceServerClient(s.grpc_url).infer(
            "embeddinggemma", [text_input([texts[i] for i in b])]).as_numpy("EMBEDDING"), batches))
    for b, got in zip(batches, outs):
        assert all(np.array_equal(got[j], alone[i]) for j, i in enumerate(b)), b
    from egemma.stub.instance import read_heartbeats
    served = [n for n, (started, *_) in read_heartbeats(s.heartbeat_dir).items() if "encoder" in n and started]
    assert len(served) == 2, served  # both instances answered some of them


def test_every_protocol_gives_the_same_bits(server, api_gateway, texts, checkpoints):
    """KServe gRPC / HTTP (binary tensors through the gateway's fast lane), OpenAI float and base64, TEI /embed,
    and each text's token ids (from TEI /tokenize) through OpenAI and TEI: one bit pattern a text and option set."""
    sample = [t for t in texts if t][::5][:8]  # OpenAI refuses empty strings (its spec); KServe embeds them
    for params in ({}, {"prompt_name": "query", "dimensions": 32}):
        g = grpcclient.InferenceServerClient(server.grpc_url).infer(
            "embeddinggemma", [text_input(sample)], parameters=params or None).as_numpy("EMBEDDING")
        h = httpclient.InferenceServerClient(api_gateway.url.split("//")[1]).infer(
            "embeddinggemma", [text_input(sample, httpclient)], parameters=params or None,
            outputs=[httpclient.InferRequestedOutput("EMBEDDING", binary_data=True)]).as_numpy("EMBEDDING")
        extra = {k: v for k, v in params.items()}
        o = requests.post(f"{api_gateway.url}/v1/embeddings", json={"input": sample, **extra}, timeout=120).json()
        assert "data" in o, (params, o)
        of = np.array([d["embedding"] for d in o["data"]], dtype=np.float32)
        ob = requests.post(f"{api_gateway.url}/v1/embeddings", timeout=120,
                           json={"input": sample, "encoding_format": "base64", **extra}).json()
        o64 = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in ob["data"]])
        t = np.array(requests.post(f"{api_gateway.url}/embed", json={"inputs": sample, **extra}, timeout=120).json(),
                     dtype=np.float32)
        for name, got in {"kserve-http": h, "openai-float": of, "openai-base64": o64, "tei": t}.items():
            assert np.array_equal(got, g), (name, params)
        if not params.get("prompt_name"):  # ids embed as their text (prompts apply to text only)
            toks = requests.post(f"{api_gateway.url}/tokenize", json={"inputs": sample}, timeout=120).json()
            ids = [[x["id"] for x in row] for row in toks]
            oi = requests.post(f"{api_gateway.url}/v1/embeddings", json={"input": ids, **extra}, timeout=120).json()
            ti = requests.post(f"{api_gateway.url}/embed", json={"inputs": ids, **extra}, timeout=120).json()
            assert np.array_equal(np.array([d["embedding"] for d in oi["data"]], dtype=np.float32), g)
            assert np.array_equal(np.array(ti, dtype=np.float32), g)
