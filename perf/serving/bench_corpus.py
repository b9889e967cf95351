"""Corpus throughput: `egemma-embed` end to end against the server's own saturation on the same docs,
in one run on one server.

  python -m perf.serving.bench_corpus CHECKPOINT --out DIR [--docs 100000] [--median 180] [--sigma 0.9]
                                      [--batch 32] [--inflight 16] [--pa-docs 32768] [--floor]

The corpus (DIR/corpus.jsonl, made once per --docs/--median/--sigma/--seed): document lengths lognormal in tokens
(median --median, sigma --sigma: mean ~1.5x the median, capped at 2048), slices of real English prose
(perf/lib/corpora.py's prose()), word counts from the checkpoint tokenizer's tokens per word on that prose; the
tokens each doc really has come from the server (NUM_TOKENS). Then, on one tritonserver with the repository's defaults:
  warm-up  the driver over the first 4096 docs (a quarter of fewer)
  driver   every doc once: perf/lib/loadgen.py's all_of over gRPC, --batch docs a request, --inflight in flight,
           requests built before the clock starts (saturation with nothing read or written)
  pa       perf_analyzer over gRPC, -b batch at concurrency inflight, over the first --pa-docs docs (if it runs here)
  cli      `python -m egemma.client.embed corpus.jsonl -o DIR/out.parquet --batch B --inflight I`: the process's
           wall clock (start, reading, requests, writing, assembling the file) and its own rate (its summary)
  driver2  the driver again (drift, e.g. a GPU at its power cap)
The CLI's output is checked: every line once in order, num_tokens equal to the driver's, the first 256 vectors
within cosine 0.999 of the driver's (bf16 on a GPU: a row's bits may depend on its batch). Prints docs/s and
tokens/s of each, the CLI's ratio to the best saturation figure (the bar: >= 0.9), writes DIR/corpus.json.
--floor serves bench_serve's floor repository (both models do nothing, zero vectors) instead: what the CLI and the
driver reach themselves, the server costing next to nothing (the vector check is skipped)."""
import argparse
import json
import math
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from egemma.engine.config import ModelConfig
from egemma.engine.tokenizer import TextTokenizer
from egemma.ops.repository import REPO, ROOT
from perf.lib.corpora import prose
from perf.lib.loadgen import Target, all_of
from perf.lib.pa import pa_data, perf_analyzer
from perf.lib.servers import triton
from perf.serving.floor import floor_repository

CHECKED = 256  # vectors compared between the CLI's output and the driver


def make_corpus(path: Path, checkpoint: Path, n: int, median: float, sigma: float, seed: int):
    """n JSONL docs {"id", "text"}; lengths lognormal in tokens, converted to words by the prose's tokens/word."""
    tok, rng, words = TextTokenizer(ModelConfig.load(checkpoint)), random.Random(seed), prose()
    tmp = path.with_suffix(".tmp")
    sample = [" ".join(words[s:s + 400]) for s in (rng.randrange(len(words) - 400) for _ in range(50))]
    per_word = sum(tok.untruncated_length(t) - 2 for t in sample) / (400 * len(sample))  # BOS + EOS apart
    with open(tmp, "w", encoding="utf-8") as f:  # renamed in when whole: a killed run leaves no short corpus
        for i in range(n):
            tokens = min(2048.0, max(4.0, rng.lognormvariate(math.log(median), sigma)))
            k = max(1, round((tokens - 2) / per_word))
            start = rng.randrange(len(words) - k)
            f.write(json.dumps({"id": i, "text": " ".join(words[start:start + k])}, ensure_ascii=False) + "\n")
    tmp.replace(path)
    print(f"corpus: {n} docs to {path} ({path.stat().st_size / 1e6:.1f} MB; {per_word:.2f} tokens a word)",
          flush=True)


def drive(url: str, docs: list[str], batch: int, inflight: int) -> dict:
    """Every doc once, `batch` a request, `inflight` requests at a time (perf/lib/loadgen.py's all_of); per-doc
    tokens and the first vectors."""
    tokens, first = np.zeros(len(docs), np.int64), {}

    def keep(i: int, r):
        s = i * batch
        tokens[s:s + batch] = r.as_numpy("NUM_TOKENS").reshape(-1)
        if s < CHECKED:
            first[s] = r.as_numpy("EMBEDDING")
    seconds, errors = all_of(Target("grpc", url, "embeddinggemma"),
                             [docs[s:s + batch] for s in range(0, len(docs), batch)], inflight, keep)
    if errors:
        raise RuntimeError(f"{errors} requests of the driver failed")
    vectors = np.concatenate([first[s] for s in sorted(first)])[:CHECKED]
    return {"docs": len(docs), "tokens": int(tokens.sum()), "seconds": seconds, "docs_per_s": len(docs) / seconds,
            "tokens_per_s": tokens.sum() / seconds, "per_doc": tokens, "vectors": vectors}


def pa_works() -> bool:
    """A perf_analyzer on PATH that starts (the pip wheel's lacks libb64 on hosts without it)."""
    exe = shutil.which("perf_analyzer")
    return bool(exe) and "error while loading" not in subprocess.run([exe, "--version"], capture_output=True,
                                                                      text=True).stderr


def run_cli(url: str, corpus: Path, out: Path, batch: int, inflight: int, log) -> dict:
    summary = out.with_suffix(".summary.json")
    cmd = [sys.executable, "-m", "egemma.client.embed", str(corpus), "-o", str(out), "--url", url, "--id-field", "id",
           "--batch", str(batch), "--inflight", str(inflight), "--overwrite", "--progress", "log",
           "--summary-json", str(summary)]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"egemma-embed exited with {r.returncode}: see {log.name}")
    s = json.loads(summary.read_text())
    return {"wall_seconds": wall, "docs": s["rows"], "tokens": s["tokens"], "docs_per_s": s["rows"] / wall,
            "tokens_per_s": s["tokens"] / wall, "own_docs_per_s": s["docs_per_s"],
            "own_tokens_per_s": s["tokens_per_s"], "retries": s["retries"]}


def check_output(out: Path, driver: dict, vectors: bool):
    import pyarrow.parquet as pq
    t = pq.read_table(out)
    n = driver["docs"]
    assert t["line"].to_pylist() == list(range(1, n + 1)), "rows missing, repeated or out of order"
    assert t["id"].to_pylist() == list(range(n))
    assert np.array_equal(t["num_tokens"].to_numpy(), driver["per_doc"]), "num_tokens differ from the driver's"
    if not vectors:
        return None
    got = np.stack(t.slice(0, CHECKED)["embedding"].to_numpy(zero_copy_only=False))
    ref = driver["vectors"]
    cos = (got * ref).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() >= 0.999, f"vectors differ from the driver's: min cosine {cos.min()}"
    return float(cos.min())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--docs", type=int, default=100_000)
    ap.add_argument("--median", type=float, default=180.0, help="median doc length in tokens")
    ap.add_argument("--sigma", type=float, default=0.9, help="lognormal sigma of the doc lengths")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--inflight", type=int, default=16)
    ap.add_argument("--pa-docs", type=int, default=32768, help="docs perf_analyzer cycles over")
    ap.add_argument("--floor", action="store_true", help="serve do-nothing models: the clients' own ceilings")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    corpus = a.out / f"corpus_{a.docs}_{a.median:g}_{a.sigma:g}_{a.seed}.jsonl"
    if not corpus.exists():
        make_corpus(corpus, a.checkpoint, a.docs, a.median, a.sigma, a.seed)
    docs = [json.loads(line)["text"] for line in open(corpus, encoding="utf-8")]
    res: dict = {"docs": len(docs), "batch": a.batch, "inflight": a.inflight, "median": a.median, "sigma": a.sigma,
                 "floor": a.floor}
    repo = floor_repository(a.out / "floor_repository") if a.floor else REPO
    with open(a.out / "cli.log", "w") as clog, open(a.out / "perf_analyzer.log", "w") as plog, \
            triton(a.checkpoint, a.out / "tritonserver.log", run_dir=a.out / "run", repository=repo) as server:
        url = server.grpc_url
        drive(url, docs[:min(4096, len(docs) // 4 or 1)], a.batch, a.inflight)  # warm-up
        driver = drive(url, docs, a.batch, a.inflight)
        per_doc = driver["per_doc"]
        res["doc_tokens"] = {"median": float(np.median(per_doc)), "mean": float(per_doc.mean()),
                             "p99": float(np.percentile(per_doc, 99)), "max": int(per_doc.max())}
        print(f"docs: tokens {json.dumps(res['doc_tokens'])}", flush=True)
        res["driver"] = {k: v for k, v in driver.items() if k not in ("per_doc", "vectors")}
        if pa_works():
            sub = docs[:a.pa_docs]
            (a.out / "pa.json").write_text(json.dumps(pa_data(sub, False)))
            pa = perf_analyzer(url, "embeddinggemma", a.out / "pa.json", a.out / "pa.csv",
                               ["-b", str(a.batch), "--concurrency-range", str(a.inflight)], plog)
            if pa:
                mean = float(per_doc[:len(sub)].mean())
                res["pa"] = {"docs_per_s": pa["rps"], "tokens_per_s": pa["rps"] * mean, **pa}
        else:
            print("perf_analyzer: not on PATH or does not run here: the driver is the saturation figure", flush=True)
        res["cli"] = run_cli(url, corpus, a.out / "out.parquet", a.batch, a.inflight, clog)
        res["cli"]["min_cosine_vs_driver"] = check_output(a.out / "out.parquet", driver, not a.floor)
        driver2 = drive(url, docs, a.batch, a.inflight)
        res["driver2"] = {k: v for k, v in driver2.items() if k not in ("per_doc", "vectors")}
    best = max(res[k]["docs_per_s"] for k in ("driver", "pa", "driver2") if k in res)
    res["cli_ratio"] = res["cli"]["docs_per_s"] / best
    res["cli_own_ratio"] = res["cli"]["own_docs_per_s"] / best
    (a.out / "corpus.json").write_text(json.dumps(res, indent=1, default=float))
    print(f"{'':10} {'docs/s':>9} {'tokens/s':>11}")
    for k in ("driver", "pa", "cli", "driver2"):
        if k in res:
            print(f"{k:10} {res[k]['docs_per_s']:9,.1f} {res[k]['tokens_per_s']:11,.0f}")
    print(f"cli own    {res['cli']['own_docs_per_s']:9,.1f} {res['cli']['own_tokens_per_s']:11,.0f}  (its summary: "
          f"first request to last part written)")
    print(f"CLI end to end / best saturation: {res['cli_ratio']:.3f} (own rate: {res['cli_own_ratio']:.3f}); "
          f"{res['cli']['docs']:,} docs in {res['cli']['wall_seconds']:.1f} s wall, {res['cli']['retries']} retries, "
          f"output checked (min cosine vs driver: {res['cli']['min_cosine_vs_driver']})")


if __name__ == "__main__":
    main()
