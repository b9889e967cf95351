"""Gateway throughput: single-text requests at one concurrency (64) through the gateway's OpenAI route against
the same texts over gRPC, to the same Triton in the same run.

  python -m perf.serving.bench_gateway CHECKPOINT --out DIR [--concurrency 64] [--seconds 15] [--workers 1 2 4]
                                       [--drivers 4] [--formats base64 float]

gRPC: perf_analyzer (C++, as perf/serving/bench_serve.py's w3) when it is on PATH, and perf/lib/loadgen.py's
closed loop. Gateway: `python -m egemma.gateway.app --workers W` for each W, driven by the same closed loop over its
OpenAI route. The Python driver runs in --drivers processes sharing the concurrency, which start together and count
completions in the same window after a warm-up. Every answer's status is checked; the first texts' gateway vectors
are compared with the gRPC path's (cosine: bf16 results may differ with the batch a request lands in). Prints a
table, writes results.json."""
import argparse
import json
import random
import shutil
import statistics
from pathlib import Path

import numpy as np

from egemma.engine.config import ModelConfig
from egemma.engine.tokenizer import TextTokenizer
from perf.lib.corpora import make_text, prose
from perf.lib.loadgen import Target, closed_loop, embed
from perf.lib.pa import pa_data, perf_analyzer
from perf.lib.servers import gateway, triton

NAME = "google/embeddinggemma-300m"
WARMUP = 3.0  # s before the counted window
SAMPLE = 8  # texts whose gateway vectors are compared with gRPC's


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4], help="gateway worker counts to measure")
    ap.add_argument("--drivers", type=int, default=4, help="load-driver processes (Python drivers)")
    ap.add_argument("--formats", nargs="+", default=["base64", "float"], choices=["base64", "float"])
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    tok, rng = TextTokenizer(ModelConfig.load(a.checkpoint)), random.Random(0)
    words = prose()
    texts = [make_text(tok, words, 20, rng) for _ in range(256)]  # ~20 tokens, as bench_serve's w3
    res: dict = {"concurrency": a.concurrency, "seconds": a.seconds, "drivers": a.drivers, "gateway": {}}
    with open(a.out / "perf_analyzer.log", "w") as plog, \
            triton(a.checkpoint, a.out / "tritonserver.log", run_dir=a.out / "run") as server:
        grpc = Target("grpc", server.grpc_url, "embeddinggemma")
        ref = embed(grpc, texts[:SAMPLE], per_request=1)
        if shutil.which("perf_analyzer"):
            (a.out / "w3.json").write_text(json.dumps(pa_data(texts, False)))
            res["grpc_perf_analyzer"] = perf_analyzer(server.grpc_url, "embeddinggemma", a.out / "w3.json",
                                                      a.out / "pa.csv", ["--concurrency-range", str(a.concurrency)],
                                                      plog)
        res["grpc_aio"] = closed_loop(grpc, texts, a.concurrency, a.drivers, WARMUP, a.seconds)
        print("grpc:", json.dumps({k: res[k] for k in ("grpc_perf_analyzer", "grpc_aio") if k in res}), flush=True)
        for w in a.workers:
            try:
                with gateway(server, a.out / f"gateway_{w}.log", "--workers", str(w)) as (port, _):
                    for fmt in a.formats:
                        http = Target("openai", f"http://127.0.0.1:{port}/v1/embeddings", NAME, encoding=fmt)
                        r = closed_loop(http, texts, a.concurrency, a.drivers, WARMUP, a.seconds)
                        got = embed(http, texts[:SAMPLE], per_request=1)
                        r["min_cosine_vs_grpc"] = float(min(np.sum(got * ref, 1) / np.linalg.norm(got, axis=1)
                                                            / np.linalg.norm(ref, axis=1)))
                        res["gateway"][f"{fmt} workers={w}"] = r
                        print(f"gateway {fmt} workers={w}:", json.dumps(r), flush=True)
            except RuntimeError as e:  # a gateway that did not come up: reported, the other worker counts measured
                res["gateway"][f"workers={w}"] = {"error": str(e)}
                print(f"gateway workers={w}: {e}", flush=True)
        # again after the gateway runs: a drift during the run (clocks, a busy host) shows, and the ratio takes
        # the higher gRPC rate
        res["grpc_aio_after"] = closed_loop(grpc, texts, a.concurrency, a.drivers, WARMUP, a.seconds)
    base = res["grpc_perf_analyzer"]["rps"] if res.get("grpc_perf_analyzer") else \
        max(res["grpc_aio"]["rps"], res["grpc_aio_after"]["rps"])
    runs = {k: v for k, v in res["gateway"].items() if "rps" in v}
    best = max((v["rps"] for k, v in runs.items() if k.startswith("base64")), default=0.0)
    res["best_base64_vs_grpc"] = best / base if base else None
    aio = max(res["grpc_aio"]["rps"], res["grpc_aio_after"]["rps"])
    res["best_base64_vs_grpc_aio"] = best / aio if aio else None
    (a.out / "results.json").write_text(json.dumps(res, indent=1))
    print(f"\n{'path':<32} {'req/s':>8} {'p50 ms':>7} {'p99 ms':>7} {'errors':>6}")
    rows = [(k, res[k]) for k in ("grpc_perf_analyzer", "grpc_aio", "grpc_aio_after") if res.get(k)]
    for name, r in rows + [(f"gateway {k}", v) for k, v in runs.items()]:
        print(f"{name:<32} {r['rps']:>8.0f} {r['p50_ms'] or 0:>7.2f} {r['p99_ms'] or 0:>7.2f} {r.get('errors', 0):>6}")
    print(f"best gateway (base64, the openai client's default) / gRPC: {res['best_base64_vs_grpc'] or 0:.2f} "
          f"(target >= 0.80; gRPC = {'perf_analyzer' if res.get('grpc_perf_analyzer') else 'aio driver'}); vs the "
          f"aio driver: {res['best_base64_vs_grpc_aio'] or 0:.2f}")
    if runs:
        print("median over gateway runs of min cosine vs gRPC:",
              statistics.median(v["min_cosine_vs_grpc"] for v in runs.values()))


if __name__ == "__main__":
    main()
