"""Serving benchmark through the real Triton, on the GPU host, side by side with a baseline repository that
serves sentence-transformers bf16 behind the same Triton (perf/baseline_repository).

  python perf/bench_serve.py CHECKPOINT --out DIR [--skip-baseline]

Workloads (gRPC, text built from real English prose, token counts measured with the checkpoint's tokenizer):
  w1  one request of 8 texts x ~2048 tokens, sequential       (python client, p50/p99)
  w2  one ~16-token query, concurrency 1                       (perf_analyzer)
  w3  single ~20-token texts, concurrency 1 .. 256             (perf_analyzer; throughput, latency)
  w4  80% queries of 10-40 tokens, 20% passages of 200-600, Poisson arrivals at 70% of the max rate
Writes CSV per perf_analyzer run, results.json, throughput/latency PNG, and prints a summary table."""
import argparse
import csv
import glob
import json
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from egemma.config import ModelConfig
from egemma.server import ROOT, TritonServer, free_port
from egemma.tokenizer import TextTokenizer

CONCURRENCY = [1, 16, 64, 128, 256]


def prose() -> list[str]:
    """Words of real English text: the package descriptions installed on this machine."""
    words = []
    for f in sorted(glob.glob(f"{Path(np.__file__).parent.parent}/*.dist-info/METADATA"))[:400]:
        body = Path(f).read_text(errors="ignore").split("\n\n", 1)[-1]
        words += re.sub(r"[`*#<>\[\]()|=_]+", " ", body).split()
    return words


def make_text(tok: TextTokenizer, words: list[str], n_tokens: int, rng: random.Random) -> str:
    start = rng.randrange(0, len(words) - 4 * n_tokens)
    lo, hi = 1, 4 * n_tokens
    while lo < hi:  # fewest words reaching n_tokens (specials included)
        mid = (lo + hi) // 2
        if tok.untruncated_length(" ".join(words[start:start + mid])) >= n_tokens:
            hi = mid
        else:
            lo = mid + 1
    return " ".join(words[start:start + lo])


def perf_analyzer(url, model, data, out_csv, extra, log):
    cmd = ["perf_analyzer", "-m", model, "-i", "grpc", "-u", url, "--input-data", str(data), "-f", str(out_csv),
           "--measurement-interval", "2000", "--stability-percentage", "25", "--max-trials", "6", *extra]
    r = subprocess.run(cmd, capture_output=True, text=True)
    log.write(f"$ {' '.join(cmd)}\n{r.stdout}\n{r.stderr}\n")
    log.flush()
    if r.returncode != 0 or not Path(out_csv).exists():
        return None
    row = next(csv.DictReader(open(out_csv)))
    return {"rps": float(row["Inferences/Second"]), "p50_ms": float(row["p50 latency"]) / 1e3,
            "p99_ms": float(row["p99 latency"]) / 1e3, "queue_ms": float(row["Server Queue"]) / 1e3,
            "compute_ms": float(row["Server Compute Infer"]) / 1e3}


def model_stats(c) -> dict:
    """Cumulative per-model counts and times (ns) from Triton's statistics API."""
    out = {}
    for m in c.get_inference_statistics(as_json=True).get("model_stats", []):
        st = m.get("inference_stats", {})
        out[m["name"]] = {"inferences": int(m.get("inference_count", 0)), "executions": int(m.get("execution_count", 0)),
                          **{k: int(st.get(k, {}).get("ns", 0)) for k in
                             ("queue", "compute_input", "compute_infer", "compute_output")}}
    return out


def stats_delta(before, after) -> dict:
    """Per model: executions and ms per execution of queue / compute input / infer / output in a window."""
    out = {}
    for name, a in after.items():
        b = before.get(name, {})
        n = a["executions"] - b.get("executions", 0)
        if n:
            out[name] = {"executions": n, "inferences": a["inferences"] - b.get("inferences", 0),
                         **{k: (a[k] - b.get(k, 0)) / n / 1e6 for k in
                            ("queue", "compute_input", "compute_infer", "compute_output")}}
    return out


def w1(url, model, texts, reps=40):
    c = grpcclient.InferenceServerClient(url)
    i = grpcclient.InferInput("TEXT", [len(texts), 1], "BYTES")
    i.set_data_from_numpy(np.array([[t.encode()] for t in texts], dtype=object))
    for _ in range(5):
        c.infer(model, [i])
    ts = []
    before = model_stats(c)
    for _ in range(reps):
        t0 = time.perf_counter()
        c.infer(model, [i])
        ts.append((time.perf_counter() - t0) * 1e3)
    ts.sort()
    return {"p50_ms": statistics.median(ts), "p99_ms": ts[int(0.99 * (len(ts) - 1))],
            "per_model_ms_per_execution": stats_delta(before, model_stats(c))}


def gpu_util(seconds_log):
    try:
        return subprocess.Popen(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                                 "-lms", "200"], stdout=open(seconds_log, "w"), stderr=subprocess.DEVNULL)
    except OSError:
        return None


def run_suite(name, url, model, data, out: Path, log, full: bool):
    res = {"w1": w1(url, model, data["w1"])}
    res["w2"] = perf_analyzer(url, model, data["w2"], out / f"{name}_w2.csv", ["--concurrency-range", "1"], log)
    res["w3"] = {}
    for c in (CONCURRENCY if full else [1, 128]):
        mon = gpu_util(out / f"{name}_gpu_c{c}.txt") if c == 128 else None
        res["w3"][c] = perf_analyzer(url, model, data["w3"], out / f"{name}_w3_c{c}.csv",
                                     ["--concurrency-range", str(c)], log)
        if mon:
            mon.terminate()
            vals = [float(x) for x in open(out / f"{name}_gpu_c{c}.txt").read().split() if x.strip()]
            res["gpu_util_c128"] = statistics.mean(vals) if vals else None
    if full:
        peak = perf_analyzer(url, model, data["w4"], out / f"{name}_w4_max.csv", ["--concurrency-range", "128"], log)
        if peak:
            rate = int(0.7 * peak["rps"])
            res["w4"] = perf_analyzer(url, model, data["w4"], out / f"{name}_w4.csv",
                                      ["--request-rate-range", str(rate), "--request-distribution", "poisson"], log)
            if res["w4"]:
                res["w4"]["rate"] = rate
                res["w4"]["max_rps"] = peak["rps"]
    return res


def plot(results, out: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name, r in results.items():
        pts = sorted((int(c), v) for c, v in r["w3"].items() if v)
        if not pts:
            continue
        cs = [c for c, _ in pts]
        a.plot(cs, [v["rps"] for _, v in pts], marker="o", label=name)
        b.plot(cs, [v["p50_ms"] for _, v in pts], marker="o", label=f"{name} p50")
        b.plot(cs, [v["p99_ms"] for _, v in pts], marker="x", linestyle="--", label=f"{name} p99")
    for ax, t in ((a, "throughput (req/s), ~20-token texts"), (b, "latency (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_title(t)
        ax.legend()
        ax.grid(alpha=0.3)
    b.set_yscale("log")
    fig.tight_layout()
    fig.savefig(out / "serve_w3.png", dpi=110)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--skip-baseline", action="store_true")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    tok = TextTokenizer(ModelConfig.load(a.checkpoint))
    words, rng = prose(), random.Random(0)
    data = {"w1": [make_text(tok, words, 2047, rng) for _ in range(8)]}
    for key, texts in {"w2": [make_text(tok, words, 16, rng) for _ in range(64)],
                       "w3": [make_text(tok, words, 20, rng) for _ in range(256)],
                       "w4": [make_text(tok, words, rng.randint(10, 40) if rng.random() < 0.8
                                        else rng.randint(200, 600), rng) for _ in range(500)]}.items():
        path = a.out / f"{key}.json"
        path.write_text(json.dumps({"data": [{"TEXT": [t]} for t in texts]}))
        data[key] = path
    print("w1 token counts:", [tok.untruncated_length(t) for t in data["w1"]], flush=True)
    results = {}
    log = open(a.out / "perf_analyzer.log", "w")
    suites = [("ours", ROOT / "model_repository", "embeddinggemma", True)]
    if not a.skip_baseline:
        suites.append(("st_bf16", ROOT / "perf" / "baseline_repository", "st_bf16", False))
    for name, repo, model, full in suites:
        t0 = time.perf_counter()
        try:
            with open(a.out / f"server_{name}.log", "w") as slog, \
                    TritonServer(a.checkpoint, http_port=free_port(), grpc_port=free_port(),
                                 metrics_port=free_port(), log_file=slog, repository=repo) as s:
                print(f"{name}: server ready in {time.perf_counter() - t0:.1f}s", flush=True)
                results[name] = run_suite(name, s.grpc_url, model, data, a.out, log, full)
        except RuntimeError as e:
            errors = [ln for ln in open(a.out / f"server_{name}.log") if ln.startswith("E")]
            print(f"{name}: server failed: {e}\n{''.join(errors)[:1500]}", flush=True)
            continue
        print(f"{name}: {json.dumps(results[name])}", flush=True)
    (a.out / "results.json").write_text(json.dumps(results, indent=2))
    plot(results, a.out)
    summary(results)


def summary(results):
    def f(v, k):
        return f"{v[k]:.2f}" if v and v.get(k) is not None else "-"
    print(f"\n{'workload':<34}" + "".join(f"{n:>22}" for n in results))
    rows = [("w1 8x2048 p50 / p99 ms", lambda r: f"{f(r['w1'], 'p50_ms')} / {f(r['w1'], 'p99_ms')}"),
            ("w2 1 query p50 / p99 ms", lambda r: f"{f(r['w2'], 'p50_ms')} / {f(r['w2'], 'p99_ms')}")]
    def split(r):
        m = r["w1"].get("per_model_ms_per_execution", {})
        return " / ".join(f"{m[k]['compute_infer']:.1f}" if k in m else "-"
                          for k in ("embeddinggemma_tokenizer", "embeddinggemma_encoder"))
    rows.append(("w1 tokenizer / encoder infer ms", split))
    for c in CONCURRENCY:
        rows.append((f"w3 c={c} req/s (p50 ms)", lambda r, c=c: f"{f(r['w3'].get(c), 'rps')} "
                                                                 f"({f(r['w3'].get(c), 'p50_ms')})"))
    rows.append(("w3 c=128 queue / compute ms", lambda r: f"{f(r['w3'].get(128), 'queue_ms')} / "
                                                           f"{f(r['w3'].get(128), 'compute_ms')}"))
    rows.append(("GPU util at c=128 %", lambda r: f"{r.get('gpu_util_c128') or 0:.0f}"))
    rows.append(("w4 @70% max: p50 / p99 ms", lambda r: f"{f(r.get('w4'), 'p50_ms')} / {f(r.get('w4'), 'p99_ms')}"))
    rows.append(("w4 max req/s, rate", lambda r: f"{f(r.get('w4'), 'max_rps')}, {(r.get('w4') or {}).get('rate', '-')}"))
    for label, fn in rows:
        print(f"{label:<34}" + "".join(f"{fn(r):>22}" for r in results.values()))


if __name__ == "__main__":
    sys.exit(main())
