"""OpenAI-compatible `POST /v1/embeddings` in front of Triton's gRPC endpoint.

Body: {"input": str | [str], "model": any, "dimensions": int, "encoding_format": "float" | "base64",
       "prompt_name": str, "prompt": str, "truncate": bool}   (the last three are extensions)
Started by `scripts/serve.sh --openai-port N`, or alone: python -m egemma.openai_gateway --help."""
from __future__ import annotations

import argparse
import base64
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from egemma.engine.config import ModelConfig
from egemma.engine.tokenizer import TextTokenizer

MAX_BATCH = 64  # the ensemble's max_batch_size
MAX_BODY = 64 << 20


class ApiError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def embed(client, body: dict, tok: TextTokenizer | None, model_name: str) -> dict:
    texts = body.get("input")
    if isinstance(texts, str):
        texts = [texts]
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise ApiError(400, "input must be a non-empty string or list of strings")
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise ApiError(400, f"encoding_format must be 'float' or 'base64', got {fmt!r}")
    params = {k: body[k] for k in ("dimensions", "prompt_name", "prompt", "truncate") if body.get(k) is not None}
    out = []
    for a in range(0, len(texts), MAX_BATCH):
        chunk = texts[a:a + MAX_BATCH]
        i = grpcclient.InferInput("TEXT", [len(chunk), 1], "BYTES")
        i.set_data_from_numpy(np.array([[t.encode()] for t in chunk], dtype=object))
        try:
            out.append(client.infer("embeddinggemma", [i], parameters=params).as_numpy("EMBEDDING"))
        except InferenceServerException as e:
            raise ApiError(400 if "INVALID_ARG" in str(e.status()) else 502, e.message()) from None
    emb = np.concatenate(out).astype("<f4")
    tokens = 0
    if tok is not None:
        prefix = tok.prefix(params.get("prompt_name"), params.get("prompt"))
        tokens = sum(len(s) for s in tok.encode([prefix + t for t in texts]))
    data = [{"object": "embedding", "index": k,
             "embedding": base64.b64encode(e.tobytes()).decode() if fmt == "base64" else e.tolist()}
            for k, e in enumerate(emb)]
    return {"object": "list", "data": data, "model": model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def make_server(host: str, port: int, grpc_url: str, checkpoint=None, tokenizer_json=None,
                model_name="google/embeddinggemma-300m") -> ThreadingHTTPServer:
    tok = TextTokenizer(ModelConfig.load(checkpoint), tokenizer_json) if checkpoint else None
    client = grpcclient.InferenceServerClient(grpc_url)

    class Handler(BaseHTTPRequestHandler):
        def _send(self, status: int, obj: dict):
            raw = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_GET(self):
            if self.path.rstrip("/") == "/v1/models":
                return self._send(200, {"object": "list", "data": [{"id": model_name, "object": "model"}]})
            self._send(404, {"error": {"message": f"no route {self.path}", "type": "invalid_request_error"}})

        def do_POST(self):
            try:
                if self.path.rstrip("/") != "/v1/embeddings":
                    raise ApiError(404, f"no route {self.path}")
                n = int(self.headers.get("Content-Length", 0))
                if n > MAX_BODY:
                    raise ApiError(413, f"request body over {MAX_BODY} bytes")
                try:
                    body = json.loads(self.rfile.read(n))
                except json.JSONDecodeError as e:
                    raise ApiError(400, f"body is not JSON: {e}") from None
                self._send(200, embed(client, body, tok, model_name))
            except ApiError as e:
                kind = "invalid_request_error" if e.status < 500 else "server_error"
                self._send(e.status, {"error": {"message": str(e), "type": kind}})

        def log_message(self, *args):  # quiet: Triton logs the inferences
            pass

    return ThreadingHTTPServer((host, port), Handler)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--grpc-url", default="127.0.0.1:8001", help="Triton gRPC endpoint")
    ap.add_argument("--model", help="checkpoint directory, for token counts in `usage` (optional)")
    a = ap.parse_args()
    srv = make_server(a.host, a.port, a.grpc_url, a.model)
    print(f"OpenAI-compatible embeddings at http://{a.host}:{a.port}/v1/embeddings -> {a.grpc_url}", flush=True)
    srv.serve_forever()


if __name__ == "__main__":
    main()
