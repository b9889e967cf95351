"""Long documents: 16 documents of ~8k tokens sent whole with long_text=chunk, against the same tokens sent
as pre-split texts of one window each (what a client splitting them itself would send), on one tritonserver.

  python -m perf.serving.bench_long CHECKPOINT [--docs 16] [--tokens 8192] [--runs 5] [--out FILE.json]

The documents are slices of real English prose (perf.lib.corpora.prose()), each cut to --tokens text tokens with the
checkpoint's tokenizer. `split` sends each document as its windows' texts (egemma.engine.windows: the characters of
each window's tokens), so both arms embed the same windows; every document is one request, all --docs in flight at
once (the dynamic batcher packs them), timed from the first send to the last answer. The arms alternate for --runs
rounds after a warm-up of each; printed: docs/s and tokens/s (NUM_TOKENS: every window's tokens) of each arm's
median run, and chunk's cost against split (the issue's target: within 5%). First, in this process, what chunking adds
beyond the engine on the host, which a shared or busy machine cannot blur: tokenising the documents whole and cutting
and finding their windows (egemma.engine.windows.cut / split) against tokenising the pre-split texts, and combining
the windows' vectors (combine + normalisation); --host-only stops there."""
import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio

from egemma.engine.config import ModelConfig
from egemma.engine.tokenizer import TextTokenizer
from egemma.engine.windows import combine, cut, normalized, room, spans, split
from perf.lib.corpora import prose
from perf.lib.servers import triton


def documents(checkpoint: Path, n: int, tokens: int) -> tuple[list[str], list[list[str]]]:
    """(n documents of `tokens` text tokens, each document's windows as texts)."""
    cfg = ModelConfig.load(checkpoint)
    tok, words = TextTokenizer(cfg), prose()
    per = room(cfg.max_seq_length, 0, 0)
    docs, pieces = [], []
    for k in range(n):
        text = " ".join(words[k * 7000 % (len(words) - 7000):][:7000])
        ids, offs = tok.encode_offsets([text])[0]
        text = text[:offs[min(tokens, len(offs)) - 1, 1]]
        ids, offs = tok.encode_offsets([text])[0]
        docs.append(text)
        pieces.append([text[offs[a, 0]:offs[b - 1, 1]] for a, b in spans(len(offs), per)])
    return docs, pieces


def host(checkpoint: Path, docs: list[str], split_texts: list[list[str]], reps: int = 5) -> dict:
    """Best-of-reps ms of the host work of each arm (the engine's aside)."""
    cfg = ModelConfig.load(checkpoint)
    tok, n = TextTokenizer(cfg), cfg.max_seq_length

    def windows():
        return [w for s in tok.encode(docs, whole=True) for w in split(cut(s, 0, n)[0], n)]
    ws = windows()
    counts = [len(split(cut(s, 0, n)[0], n)) for s in tok.encode(docs, whole=True)]
    x = np.random.default_rng(0).standard_normal((len(ws), cfg.out_dim)).astype(np.float32)
    flat = [t for ts in split_texts for t in ts]
    jobs = {"chunk_tokenise_cut_split_ms": windows, "split_tokenise_ms": lambda: tok.encode(flat),
            "combine_normalise_ms": lambda: normalized(combine(x, [len(w) for w in ws], counts))}
    out = {}
    for k, f in jobs.items():
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            f()
            best = min(best, time.perf_counter() - t0)
        out[k] = round(best * 1e3, 3)
    return out


def request(texts: list[str]) -> list:
    i = grpcclient.InferInput("TEXT", [len(texts), 1], "BYTES")
    i.set_data_from_numpy(np.array([[t.encode()] for t in texts], dtype=np.object_))
    return [i]


async def arm(c, requests: list, params: dict) -> tuple[float, int]:
    """(seconds, tokens embedded) of every request in flight at once."""
    out = [grpcclient.InferRequestedOutput("EMBEDDING"), grpcclient.InferRequestedOutput("NUM_TOKENS")]
    t0 = time.perf_counter()
    rs = await asyncio.gather(*(c.infer("embeddinggemma", r, outputs=out, parameters=params or None,
                                        client_timeout=3600) for r in requests))
    return time.perf_counter() - t0, sum(int(r.as_numpy("NUM_TOKENS").sum()) for r in rs)


async def bench(url: str, docs, split_texts, runs: int) -> dict:
    c = grpcaio.InferenceServerClient(url)
    arms = {"chunk": ([request([d]) for d in docs], {"long_text": "chunk"}),
            "split": ([request(s) for s in split_texts], {})}
    times = {k: [] for k in arms}
    tokens = {}
    try:
        for k, (reqs, params) in arms.items():  # warm-up
            await arm(c, reqs, params)
        for _ in range(runs):
            for k, (reqs, params) in arms.items():
                s, tokens[k] = await arm(c, reqs, params)
                times[k].append(s)
                print(f"{k}: {s:.3f} s", flush=True)
    finally:
        await c.close()
    out = {}
    for k, ts in times.items():
        med = statistics.median(ts)
        out[k] = {"seconds": ts, "median_s": med, "docs_per_s": len(docs) / med, "tokens_per_s": tokens[k] / med,
                  "tokens": tokens[k]}
    out["chunk_cost"] = out["chunk"]["median_s"] / out["split"]["median_s"] - 1
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--docs", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=8192, help="text tokens a document")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", type=Path, help="also write the results here as JSON")
    ap.add_argument("--host-only", action="store_true", help="only the host work, no server")
    a = ap.parse_args()
    docs, split_texts = documents(a.checkpoint, a.docs, a.tokens)
    print(f"{len(docs)} documents, {sum(map(len, split_texts))} windows", flush=True)
    h = host(a.checkpoint, docs, split_texts)
    print(f"host: {h}", flush=True)
    if a.host_only:
        return 0
    log = (a.out or Path("bench_long.json")).with_suffix(".server.log")
    with triton(a.checkpoint, log) as s:
        r = asyncio.run(bench(s.grpc_url, docs, split_texts, a.runs))
    r["host"], r["settings"] = h, vars(a) | {"checkpoint": str(a.checkpoint), "out": str(a.out)}
    for k in ("chunk", "split"):
        print(f"{k}: {r[k]['docs_per_s']:.2f} docs/s, {r[k]['tokens_per_s']:.0f} tokens/s "
              f"({r[k]['tokens']} tokens)")
    print(f"chunk's cost against split: {100 * r['chunk_cost']:+.1f}%")
    if a.out:
        a.out.write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
