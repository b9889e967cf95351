"""The peers' own published specifications run against the real gateway with schemathesis: TEI's docs/openapi.json
and the createEmbedding / listModels / retrieveModel operations of OpenAI's spec (tests/specs/README.md: sources and
commits). For each operation the spec describes and the gateway serves, schemathesis generates schema-valid and
schema-violating requests (a bounded number: EGEMMA_CONFORMANCE_EXAMPLES per operation and mode, derandomized so a
CI run is reproducible) and runs all of its checks on every answer: no server error, documented status codes and
content types, response bodies and headers in the spec's schemas, invalid requests refused, valid ones accepted, the
API key not ignored. Every failure either is a listed difference below (mirrored in README.md, "Differences from the
specifications", with the reason) or fails the test."""
import os
from pathlib import Path

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.core.failures import FailureGroup  # noqa: E402

from rawhttp import start_front  # noqa: E402

pytestmark = pytest.mark.usefixtures("still_serving")
SPECS = Path(__file__).parent / "specs"
EXAMPLES = int(os.environ.get("EGEMMA_CONFORMANCE_EXAMPLES", "25"))
KEY = "conformance-key"
# Operations of TEI's spec this server does not serve (404): one embedding model serves no reranking, classification,
# sparse embedding or similarity, and decodes no ids; TEI's own /v1/embeddings is checked against OpenAI's spec.
NOT_SERVED = {"POST /decode", "POST /embed_sparse", "POST /predict", "POST /rerank", "POST /similarity",
              "POST /v1/embeddings"}


def _error(r) -> str:
    """The error message of an answer in either protocol's shape ("" for anything else)."""
    try:
        e = r.json().get("error")
    except ValueError:
        return ""
    return (e.get("message") if isinstance(e, dict) else e) or ""


# (operation, schemathesis failure code, when, why) of every accepted failure. ST202: a schema-valid request rejected;
# ST201: a schema-violating one accepted; ST103: a status code the spec does not list; ST101: a 5xx. Each reason is
# in README.md too.
DIFFERENCES = [
    ("POST /embed", "ST202", "normalize=false is not supported",
     "the encoder's Normalize module always runs: unnormalised vectors cannot be given"),
    ("POST /embed", "ST202", "truncation_direction=left is honoured only",
     "the server cuts on the right (keeping EOS last); left is honoured for inputs that need no cut"),
    ("POST /embed", "ST202", "prompt_name applies to text inputs",
     "TEI decodes token ids and re-tokenises them with the prompt; this server embeds ids as given"),
    ("POST /embed", "ST202", "outside the vocabulary", "ids must be this model's (TEI's schema takes any u32)"),
    ("POST /embed", "ST202", "choose from",
     "dimensions: the Matryoshka sizes the checkpoint was trained for, not any integer"),
    ("POST /embed", "ST202", "unknown prompt_name", "TEI refuses an unknown prompt_name too (422)"),
    ("POST /embed", "ST202", "cannot be empty",
     "TEI's own rule: its schema allows an empty input, its tokenizer refuses it with 400 Empty"),
    ("POST /embed", "ST202", "maximum allowed batch size", "TEI's own rule: max_client_batch_size (here 2048)"),
    ("POST /embed", "ST202", "over the 2048-token limit", "TEI's own rule: truncate=false and a longer input"),
    ("POST /tokenize", "ST202", "cannot be empty", "TEI's own rule, as for /embed"),
    ("POST /tokenize", "ST202", "unknown prompt_name", "TEI refuses an unknown prompt_name too (422)"),
    ("POST /tokenize", "ST202", "maximum allowed batch size", "TEI's own rule: max_client_batch_size (here 2048)"),
    ("POST /embed_all", "ST101", "embed_all is not available",
     "501: per-token hidden states never leave the encoder's CUDA graph"),
    ("POST /embed_all", "ST103", "embed_all is not available", "501, as above: TEI's spec lists no 501"),
    ("POST /embeddings", "ST103", "",
     "OpenAI's spec lists only 200 and 429, though OpenAI answers 400, 401, 404 and 413 as this server does"),
    ("POST /embeddings", "ST202", "does not exist",
     "model: the served name or an alias (404 model_not_found, as OpenAI answers an unknown model)"),
    ("POST /embeddings", "ST202", "outside the vocabulary", "ids must be this model's tokenizer's"),
    ("POST /embeddings", "ST202", "choose from",
     "dimensions: the Matryoshka sizes the checkpoint was trained for, not any integer"),
    ("POST /embeddings", "ST202", "empty string", "OpenAI's own rule, in the spec's description: no empty string"),
    ("POST /embeddings", "ST201", lambda body, r: isinstance(body, dict) and "model" not in body,
     "model may be left out: the served model (OpenAI's schema requires it)"),
    ("GET /models/{model}", "ST103", "does not exist",
     "404 model_not_found for a model not served, as OpenAI answers; its spec lists only 200"),
    ("GET /models", "ST103", "API key", "401 without the key, as OpenAI answers; its spec lists only 200"),
    ("GET /models/{model}", "ST103", "API key", "401 without the key, as OpenAI answers; its spec lists only 200"),
]


def documented(op: str, code: str, case, r) -> bool:
    """Whether a failure is a listed difference: `when` is a fragment of the answer's error message, or a
    function of the request's body and the answer."""
    return any(op == o and code == c and (when in _error(r) if isinstance(when, str) else when(case.body, r))
               for o, c, when, _ in DIFFERENCES)


@pytest.fixture(scope="module")
def gateway(server, tmp_path_factory):
    """The real gateway with an API key (its own: Triton behind it has none, and ignores the one passed on)."""
    d = tmp_path_factory.mktemp("conformance")
    (d / "key").write_text(KEY)
    f = start_front(server, d / "gateway.log", "--workers=1", f"--api-key-file={d / 'key'}",
                    f"--triton-metrics={server.host}:{server.metrics_port}")
    yield f
    f.stop()


def _operations():
    out = []
    for spec, base in (("tei-openapi.json", ""), ("openai-embeddings.json", "/v1")):
        schema = schemathesis.openapi.from_path(SPECS / spec)
        for result in schema.get_all_operations():
            op = result.ok()
            if op.label not in NOT_SERVED:
                out.append(pytest.param(op, base, id=f"{spec.split('-')[0]} {op.label}"))
    return out


@pytest.mark.parametrize("op,base", _operations())
def test_the_spec_holds(gateway, op, base):
    failed = []
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
        @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
        @given(case=op.as_strategy(generation_mode=mode))
        def run(case):
            r = case.call(base_url=gateway.url + base, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
            try:
                case.validate_response(r)
            except FailureGroup as g:
                failed.extend(f"{mode.value} {op.label}: {f.code} {f.title}: {r.status_code} {r.text[:300]!r} "
                              f"for {str(case.body)[:300]!r}" for f in g.exceptions
                              if not documented(op.label, f.code, case, r))
        try:
            run()
        except Unsatisfiable:  # an operation without inputs (GET /health): no request violates its schema
            assert mode is GenerationMode.NEGATIVE
    assert not failed, "\n".join(failed[:20])
