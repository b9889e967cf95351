"""Side by side with the peers: our server, sentence-transformers behind the same Triton, Infinity and
vLLM serving the same checkpoint, the same texts sent by the same client (perf/lib/loadgen.py) on the same machine.

  python -m perf.peers.peers CHECKPOINT --out DIR [--servers ours,st,infinity,vllm] [--peers-dir /tmp/peers]
                             [--quick]
  python -m perf.peers.peers --table RESULTS [RESULTS ...]
      one table from several runs' results.json (or their folders)

Each server is started here, one after the other, with its documented best settings for an embedding model
(SETTINGS says which and where documented); Infinity and vLLM from perf/peers/peers_stage.sh's folders (PYTHONPATH
of their own process only); ours with its defaults (egemma.ops.launcher), called over the gateway's OpenAI route (ours-http)
and Triton's gRPC (ours-grpc). Workloads (texts: perf/lib/corpora.py, prose within each stated length):
  w1      8 texts of <= 2048 tokens a request, one request at a time (16 different requests in turn): p50 / p99
  query   one text of <= 16 tokens a request, one at a time (64 different): p50 / p99
  c128    single texts of <= 20 tokens, 128 requests in flight: req/s and p99
  corpus  4096 documents, lognormal token counts (median 180, sigma 1, capped at 2048), 32 a request, 16 requests
          in flight: documents/s and tokens/s (our tokenizer's counts, specials included)
  fidelity 40 mixed texts (perf/lib/corpora.py mixed) against sentence-transformers fp32 on the same weights: min cosine
--quick: small counts and short windows, for a CPU smoke run. Writes DIR/results.json and each server's log."""
import argparse
import json
import random
import sys
import time
from pathlib import Path

import numpy as np

from perf.lib.corpora import cjk, lognormal_docs, make_text, mixed, prose
from perf.lib.loadgen import Target, all_of, closed_loop, embed, one_at_a_time
from perf.peers.peer_servers import SETTINGS, STARTERS
from egemma.engine.config import ModelConfig
from egemma.engine.tokenizer import TextTokenizer

def workloads(ckpt: Path, quick: bool) -> dict:
    """Every server's texts, built once (seeded) so that all get the same."""
    tok, words, rng = TextTokenizer(ModelConfig.load(ckpt)), prose(), random.Random(0)
    n_docs, w1_len = (128, 256) if quick else (4096, 2048)
    docs = lognormal_docs(tok, words, n_docs, rng, cap=w1_len)
    w = {"w1": [[make_text(tok, words, w1_len, rng, within=True) for _ in range(8)] for _ in range(2 if quick else 16)],
         "query": [[make_text(tok, words, 16, rng, within=True)] for _ in range(64)],
         "c128": [make_text(tok, words, 20, rng, within=True) for _ in range(256)],
         "corpus": [docs[i:i + 32] for i in range(0, len(docs), 32)],
         "fidelity": mixed(tok, words, rng, cjk(None, rng))}
    w["corpus_tokens"] = sum(min(tok.untruncated_length(d), 2048) for d in docs)
    return w


def reference(ckpt: Path, texts: list[str]) -> np.ndarray:
    """sentence-transformers in fp32 (the GPU where there is one): what every server's vectors are compared to."""
    import torch
    from sentence_transformers import SentenceTransformer
    m = SentenceTransformer(str(ckpt), device="cuda" if torch.cuda.is_available() else "cpu")
    out = m.encode(texts, batch_size=8, convert_to_numpy=True, normalize_embeddings=True)
    del m
    torch.cuda.empty_cache()
    return out


def measure(t: Target, w: dict, ref: np.ndarray, quick: bool) -> dict:
    """The five workloads against one server, in the module docstring's order."""
    r = {"w1": one_at_a_time(t, w["w1"], warmup=3, max_n=20 if quick else 200, seconds=5 if quick else 20)}
    r["query"] = one_at_a_time(t, w["query"], warmup=10, max_n=50 if quick else 1000, seconds=5 if quick else 10)
    conc = 8 if quick else 128
    r["c128"] = {"concurrency": conc, **closed_loop(t, w["c128"], conc, procs=2 if quick else 8,
                                                    warmup=1 if quick else 2, seconds=2 if quick else 8)}
    secs, errors = all_of(t, w["corpus"], 16)
    n_docs = sum(map(len, w["corpus"]))
    r["corpus"] = {"docs_per_s": n_docs / secs, "tokens_per_s": w["corpus_tokens"] / secs, "seconds": secs,
                   "errors": errors}
    v = embed(t, w["fidelity"])
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    r["fidelity_min_cos"] = float(np.min(np.sum(v * ref, axis=1)))
    return r


COLUMNS = (("w1 p50 / p99 ms", lambda r: f"{r['w1']['p50_ms']:.2f} / {r['w1']['p99_ms']:.2f}"),
           ("query p50 / p99 ms", lambda r: f"{r['query']['p50_ms']:.2f} / {r['query']['p99_ms']:.2f}"),
           ("c=128 req/s (p99 ms)", lambda r: f"{r['c128']['rps']:,.0f} ({r['c128']['p99_ms']:.1f})"),
           ("corpus docs/s (k tok/s)", lambda r: f"{r['corpus']['docs_per_s']:,.0f} "
                                                 f"({r['corpus']['tokens_per_s'] / 1e3:,.0f})"),
           ("min cos vs ST fp32", lambda r: f"{r['fidelity_min_cos']:.5f}"))


def _cell(f, *args) -> str:
    try:
        return f(*args)
    except (KeyError, TypeError, ZeroDivisionError):  # a workload with no successful request
        return "-"


def table(results: dict) -> str:
    """One row per server (a failed one with its error), then ours-http's ratio to each peer: >1 means ours is
    better (their latency / ours, our throughput / theirs)."""
    rows = ["| server | " + " | ".join(c for c, _ in COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for name, r in results.items():
        cells = [_cell(f, r) for _, f in COLUMNS]
        rows.append(f"| {name} | " + " | ".join(cells) + " |" + (f" {r['error'][:120]}" if "error" in r else ""))
    base = results.get("ours-http", {})
    if "error" not in base and base:
        for name, r in results.items():
            if name.startswith("ours") or "error" in r:
                continue
            ratio = (lambda: r["w1"]["p50_ms"] / base["w1"]["p50_ms"],
                     lambda: r["query"]["p50_ms"] / base["query"]["p50_ms"],
                     lambda: base["c128"]["rps"] / r["c128"]["rps"],
                     lambda: base["corpus"]["docs_per_s"] / r["corpus"]["docs_per_s"])
            rows.append(f"| ours-http vs {name} | " + " | ".join(_cell(lambda x: f"{x():.1f}x", x) for x in ratio)
                        + " | |")
    return "\n".join(rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path, nargs="?")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--servers", default="ours,st,infinity,vllm", help=f"comma-separated, of {','.join(STARTERS)}")
    ap.add_argument("--peers-dir", type=Path, default=Path("/tmp/peers"), help="perf/peers/peers_stage.sh's folders")
    ap.add_argument("--peer-python", default=sys.executable, help="the Python that runs Infinity and vLLM (default "
                                                                   "this one; their folders are built for 3.12)")
    ap.add_argument("--results", type=Path, help="where results.json goes (default: in --out)")
    ap.add_argument("--quick", action="store_true", help="small counts and windows: a CPU smoke run")
    ap.add_argument("--table", type=Path, nargs="+", metavar="RESULTS",
                    help="print one table from these runs' results.json files (or folders holding one)")
    a = ap.parse_args()
    if a.table:
        files = [p / "results.json" if p.is_dir() else p for p in a.table]
        merged = {k: v for f in files for k, v in json.loads(f.read_text())["servers"].items()}
        print(table(merged))
        return
    if not a.checkpoint or not a.out or not set(a.servers.split(",")) <= set(STARTERS):
        ap.error(f"CHECKPOINT and --out are needed, --servers of {','.join(STARTERS)}")
    a.checkpoint, a.out = a.checkpoint.resolve(), a.out.resolve()  # the servers run in the repository's root
    a.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    w = workloads(a.checkpoint, a.quick)
    ref = reference(a.checkpoint, w["fidelity"])
    print(f"workloads and the fp32 reference in {time.perf_counter() - t0:.0f} s; corpus "
          f"{sum(map(len, w['corpus']))} docs, {w['corpus_tokens']} tokens", flush=True)
    results = {}
    servers = a.servers.split(",")
    for server in servers:
        t0 = time.perf_counter()
        try:
            with STARTERS[server](a.checkpoint, a.out, a) as targets:
                print(f"{server}: ready in {time.perf_counter() - t0:.0f} s", flush=True)
                for name, t in targets.items():
                    results[name] = {"settings": SETTINGS[server], **measure(t, w, ref, a.quick)}
                    print(f"{name}: {json.dumps(results[name])}", flush=True)
        except Exception as e:  # a peer that does not start or answer: its row says why, the others still run
            results[server] = {"settings": SETTINGS[server], "error": f"{type(e).__name__}: {e}"}
            print(f"{server}: FAILED {str(e)[-2000:]}", flush=True)
            if server == "infinity" and "infinity-eager" not in servers:  # said in its own row, never silent
                servers.append("infinity-eager")
        print(f"{server}: {time.perf_counter() - t0:.0f} s", flush=True)
        # after each server: a call cut short at its time limit keeps the rows it has
        (a.results or a.out / "results.json").write_text(json.dumps({"servers": results, "quick": a.quick}, indent=2))
    print(table(results))


if __name__ == "__main__":
    sys.exit(main())
