"""The deterministic mode on the GPU host, one process: (1) batch invariance of the engine, deterministic and not: texts of 5 to
2046 tokens each alone and inside >= 20 compositions of 1-64 mixed rows, rows compared bit for bit; (2) its cost:
embed()'s wall time (synchronised) per workload, deterministic against not; (3) a real server with its default
encoder instances and a fresh cache directory: the tuning log lines (one instance tunes, the others read), one bit
pattern per text across instances and compositions, then a restart that reads the file; start times of both.

With --serve, the cost end to end through Triton over gRPC (perf_analyzer: w1 8 x 2048, one query, c=128 single
texts, a corpus mix of 32 documents a request at 16 in flight), deterministic against not; with --cache, Triton's
response cache (--response-cache-mb) off and on for a Zipf stream of 10k distinct queries (s = 1.1) at c=128.

  python -m perf.engine.determinism CHECKPOINT [--out results.json] [--skip-server] [--serve] [--cache]"""
import argparse
import concurrent.futures as cf
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from egemma.engine import Engine, EngineConfig

LENGTHS = [5, 16, 17, 100, 511, 777, 1500, 2046]


def seqs_of(lengths, vocab, rng):
    return [np.concatenate([[2], rng.integers(4, vocab, n - 2), [1]]).astype(np.int32) for n in lengths]


def compositions(rng, pool, count=24):
    sizes = [1, 2, 64, 63, 17, 32] + rng.integers(1, 65, count - 6).tolist()
    return [rng.choice(len(pool), size=s, replace=True).tolist() for s in sizes]


def invariance(eng, rng):
    probe = seqs_of(LENGTHS, eng.cfg.vocab_size, rng)
    pool = probe + seqs_of(np.clip(rng.lognormal(np.log(180), 0.9, 120), 3, 2048).astype(int), eng.cfg.vocab_size, rng)
    alone = np.concatenate([eng.embed([s]) for s in pool])
    equal = total = 0
    worst = 0.0
    for batch in compositions(rng, pool):
        got = eng.embed([pool[i] for i in batch])
        for j, i in enumerate(batch):
            total += 1
            equal += bool(np.array_equal(got[j], alone[i]))
            worst = max(worst, float(np.abs(got[j] - alone[i]).max()))
    return {"rows": total, "bitwise_equal": equal, "max_abs_diff": worst}


def cost(eng, rng, reps=30):
    v = eng.cfg.vocab_size
    work = {"w1 8x2048": seqs_of([2048] * 8, v, rng), "one query 1x16": seqs_of([16], v, rng),
            "c=128 batch 29x20": seqs_of([20] * 29, v, rng),
            "corpus 32 docs": seqs_of(np.clip(rng.lognormal(np.log(180), 0.9, 32), 3, 2048).astype(int), v, rng)}
    out = {}
    for name, s in work.items():
        for _ in range(3):
            eng.embed(s)
        ts = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            eng.embed(s)
            ts.append((time.perf_counter() - t0) * 1e3)
        out[name] = statistics.median(ts)
    return out


def server_check(checkpoint, rng):
    import tritonclient.grpc as grpcclient
    from perf.lib.servers import triton
    texts = [" ".join(rng.choice(["Mars", "is", "red", "kalo", "日本", "x", "the", "planet"], n)) for n in
             [3, 10, 50, 200, 700, 1500, 3000]] * 2
    cache = Path(tempfile.mkdtemp(prefix="egemma-cache-"))
    os.environ["EGEMMA_CACHE_DIR"] = str(cache)
    out = {}
    for start in ("first", "restart"):
        log = Path(tempfile.mkdtemp()) / "server.log"
        t0 = time.perf_counter()
        with triton(Path(checkpoint), log) as s:
            ready = time.perf_counter() - t0
            c = grpcclient.InferenceServerClient(s.grpc_url)

            def ask(rows):
                t = grpcclient.InferInput("TEXT", [len(rows), 1], "BYTES")
                t.set_data_from_numpy(np.array([[texts[i].encode()] for i in rows], dtype=object))
                return grpcclient.InferenceServerClient(s.grpc_url).infer("embeddinggemma", [t]).as_numpy("EMBEDDING")
            alone = np.concatenate([ask([i]) for i in range(len(texts))])
            jobs = [[i] for i in range(len(texts))] * 6 + compositions(rng, texts)
            with cf.ThreadPoolExecutor(16) as pool:
                outs = list(pool.map(ask, jobs))
            equal = sum(bool(np.array_equal(o[j], alone[i])) for b, o in zip(jobs, outs) for j, i in enumerate(b))
            rows = sum(len(b) for b in jobs)
            del c
        text = log.read_text(errors="replace")
        out[start] = {"ready_s": round(ready, 1), "tuned": text.count("tuning: tuned in"),
                      "read": text.count("tuning: read"), "rows": rows, "bitwise_equal": equal,
                      "choices": [ln.split("deterministic=")[-1][:300] for ln in text.splitlines()
                                  if "deterministic=" in ln][:1]}
    return out


WORDS = ("the planet mars is red because iron oxide dust covers its surface water ice sits at the poles "
         "rovers measure wind dust storms and seasons 日本 語 kalo code def return").split()


def words(rng, n: int) -> str:
    return " ".join(rng.choice(WORDS, int(n)))


def serving(checkpoint, tmp: Path, variants: dict, workloads: dict) -> dict:
    """{variant: {workload: perf_analyzer's result}}, one server a variant (ServerConfig fields), the same data."""
    from perf.lib.pa import pa_data, perf_analyzer
    from perf.lib.servers import triton
    log, out = open(tmp / "perf_analyzer.log", "w"), {}
    files = {}
    for name, (texts, _) in workloads.items():
        files[name] = tmp / f"{name}.json"
        files[name].write_text(json.dumps(pa_data(texts, False)))
    for variant, kw in variants.items():
        with triton(Path(checkpoint), tmp / f"{variant}.log", **kw) as s:
            out[variant] = {name: perf_analyzer(s.grpc_url, "embeddinggemma", files[name], tmp / f"{variant}-{name}.csv",
                                                extra, log) for name, (_, extra) in workloads.items()}
        print(variant, json.dumps(out[variant]), flush=True)
    return out


def serve_cost(checkpoint, rng) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="egemma-serve-"))
    corpus = [words(rng, n) for n in np.clip(rng.lognormal(np.log(140), 0.9, 4096), 2, 1600)]
    work = {"w1": ([words(rng, 2100) for _ in range(16)], ["-b", "8", "--concurrency-range", "1"]),
            "one_query": ([words(rng, 12)], ["--concurrency-range", "1"]),
            "c128": ([words(rng, 15) for _ in range(512)], ["--concurrency-range", "128"]),
            "corpus": (corpus, ["-b", "32", "--concurrency-range", "16"])}
    return serving(checkpoint, tmp, {f"deterministic={d}": {"params": {"deterministic": d}} for d in ("false", "true")},
                   work)


def cache_bench(checkpoint, rng) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="egemma-cache-bench-"))
    distinct = [f"{words(rng, rng.integers(4, 16))} {i}" for i in range(10_000)]
    stream = [distinct[i] for i in (rng.zipf(1.1, 60_000) - 1) % len(distinct)]
    work = {"zipf_c128": (stream, ["--concurrency-range", "128"])}
    return serving(checkpoint, tmp, {"cache off": {}, "cache 512 MiB": {"response_cache_mb": 512}}, work)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("--out")
    ap.add_argument("--skip-server", action="store_true")
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--serve", action="store_true")
    ap.add_argument("--cache", action="store_true")
    a = ap.parse_args()
    res = {}
    os.environ["EGEMMA_CACHE_DIR"] = tempfile.mkdtemp(prefix="egemma-cache-")
    for det in () if a.skip_engine else (True, False):
        rng = np.random.default_rng(0)
        t0 = time.perf_counter()
        eng = Engine(EngineConfig(a.checkpoint, deterministic=det))
        r = {"load_s": round(time.perf_counter() - t0, 1), "choices": eng.choices.summary(),
             "invariance": invariance(eng, rng), "cost_ms": cost(eng, rng)}
        res["deterministic" if det else "per-bucket"] = r
        print(f"deterministic={det}: load {r['load_s']}s, {r['choices']}\n  invariance {r['invariance']}", flush=True)
        del eng
        torch.cuda.empty_cache()
    if not a.skip_engine:
        d, p = res["deterministic"]["cost_ms"], res["per-bucket"]["cost_ms"]
        print(f"{'workload':<20}{'per-bucket ms':>14}{'deterministic ms':>18}{'cost':>8}")
        for k in d:
            print(f"{k:<20}{p[k]:>14.3f}{d[k]:>18.3f}{(d[k] / p[k] - 1) * 100:>7.1f}%")
    if a.serve:
        res["serve"] = serve_cost(a.checkpoint, np.random.default_rng(2))
    if a.cache:
        res["cache"] = cache_bench(a.checkpoint, np.random.default_rng(3))
    if not a.skip_server:
        res["server"] = server_check(a.checkpoint, np.random.default_rng(1))
        print("server:", json.dumps(res["server"]))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
