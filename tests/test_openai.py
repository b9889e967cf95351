"""The OpenAI-compatible gateway, driven by the `openai` Python client, against sentence-transformers."""
import base64
import threading

import numpy as np
import pytest

from helpers import assert_close, make_texts, reference

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def gateway(server, checkpoints):
    from egemma.serving.gateway import make_server
    from egemma.ops.tritonserver import free_port
    srv = make_server("127.0.0.1", free_port(), server.grpc_url, checkpoints["eos"],
                      str(server.run_dir / "tokenizer.json"))
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{srv.server_address[1]}/v1", api_key="unused", max_retries=0)
    srv.shutdown()


def test_list_input_float(gateway, checkpoints):
    texts = make_texts(70, 100, seed=9)  # over the ensemble's max batch: the gateway splits
    r = gateway.embeddings.create(input=texts, model="google/embeddinggemma-300m")
    got = np.array([d.embedding for d in r.data], dtype=np.float32)
    assert [d.index for d in r.data] == list(range(70))
    assert_close(got, reference(checkpoints["eos"], texts))
    assert r.usage.prompt_tokens > 70 * 2


def test_string_input_base64_dimensions_and_prompt(gateway, checkpoints):
    r = gateway.embeddings.create(input="what is the red planet", model="m", dimensions=32,
                                  encoding_format="base64", extra_body={"prompt_name": "query"})
    raw = r.data[0].embedding
    got = np.frombuffer(base64.b64decode(raw), dtype="<f4") if isinstance(raw, str) else np.array(raw, "<f4")
    m = reference(checkpoints["eos"], ["what is the red planet"], prompt_name="query")[0]
    ref = m[:32] / np.linalg.norm(m[:32])
    assert got.shape == (32,) and np.abs(got - ref).max() <= 1e-5


def test_errors_are_openai_style(gateway):
    with pytest.raises(openai.BadRequestError, match="Retrieval-query"):
        gateway.embeddings.create(input="x", model="m", extra_body={"prompt_name": "nope"})
    with pytest.raises(openai.BadRequestError, match="choose from"):
        gateway.embeddings.create(input="x", model="m", dimensions=20)
    with pytest.raises(openai.BadRequestError, match="input"):
        gateway.embeddings.create(input=[], model="m")
