"""Soak on the GPU host: hours-of-load behaviour in minutes. The real server on CHECKPOINT takes perf_analyzer
load (w4's mix: 80% queries of 10-40 tokens, 20% passages of 200-600, at concurrency C) for SECONDS, while a
checker sends sampled requests of 1-16 texts and compares every answer with sentence-transformers (fp32 on the
GPU; bf16 serving must reach cosine >= 0.999), and a sampler records GPU memory and the stubs' RSS every 10 s.

  python -m perf.serving.soak_gpu CHECKPOINT --seconds 900 --out DIR [--concurrency 128]

Progress goes to stdout as it runs; DIR/soak.json (written last, so its presence means done) holds the
series and the verdict: zero errors, zero mismatches, GPU memory and stub RSS flat (within 2% / 10%) from
the end of the warm-up to the end."""
import argparse
import json
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch
import tritonclient.grpc as grpcclient

from egemma.engine.config import ModelConfig
from egemma.engine.tokenizer import TextTokenizer
from egemma.ops.procfs import rss_kb, stub_pids
from perf.lib.corpora import make_text, prose
from perf.lib.pa import model_stats, pa_data, perf_analyzer
from perf.lib.servers import triton

MODEL = "embeddinggemma"
MIN_COSINE = 0.999


def gpu_mem_mib() -> int:
    """Memory used on the first GPU (all processes), -1 without nvidia-smi."""
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True)
    except OSError:
        return -1
    return int(r.stdout.split()[0]) if r.returncode == 0 and r.stdout.strip() else -1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--seconds", type=float, default=900)
    ap.add_argument("--warmup", type=float, default=60)
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "soak.json").unlink(missing_ok=True)
    say = lambda msg: print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)  # noqa: E731

    tok = TextTokenizer(ModelConfig.load(a.checkpoint))
    words, rng = prose(), random.Random(1)
    mix = [make_text(tok, words, rng.randint(10, 40) if rng.random() < 0.8 else rng.randint(200, 600), rng)
           for _ in range(500)]
    (a.out / "load.json").write_text(json.dumps(pa_data(mix, utf8=False)))
    pool = mix[:64]
    from sentence_transformers import SentenceTransformer
    device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: smoke runs of this script
    ref = SentenceTransformer(str(a.checkpoint), device=device).encode(pool, batch_size=16, convert_to_numpy=True)
    say(f"reference: {len(pool)} texts embedded by sentence-transformers fp32")

    series, checks, stop = [], {"requests": 0, "errors": [], "mismatches": [], "min_cosine": 1.0}, threading.Event()
    with triton(a.checkpoint, a.out / "server.log") as s:
        say(f"server ready; load: perf_analyzer c={a.concurrency} for {a.seconds:.0f}s after a {a.warmup:.0f}s "
            "warm-up")
        client = grpcclient.InferenceServerClient(s.grpc_url)

        def checker():
            c, r = grpcclient.InferenceServerClient(s.grpc_url), random.Random(2)
            while not stop.wait(0.2):
                idx = [r.randrange(len(pool)) for _ in range(r.choice((1, 1, 2, 4, 8, 16)))]
                i = grpcclient.InferInput("TEXT", [len(idx), 1], "BYTES")
                i.set_data_from_numpy(np.array([[pool[k].encode()] for k in idx], dtype=object))
                try:
                    got = c.infer(MODEL, [i], client_timeout=30).as_numpy("EMBEDDING")
                except Exception as e:  # every error counts against the soak
                    checks["errors"].append(f"{time.strftime('%H:%M:%S')} {e}")
                    continue
                checks["requests"] += 1
                if got.shape != ref[idx].shape or not np.isfinite(got).all():
                    checks["mismatches"].append(f"texts {idx}: shape {got.shape} or not finite")
                    continue
                cos = (got * ref[idx]).sum(-1) / np.linalg.norm(ref[idx], axis=-1)
                if cos.min() < MIN_COSINE:
                    checks["mismatches"].append(f"texts {idx}: cosine {cos.min():.5f}")
                checks["min_cosine"] = min(checks["min_cosine"], float(cos.min()))

        def sampler():
            t0 = time.monotonic()
            while True:
                st = model_stats(client)
                series.append({"t": round(time.monotonic() - t0, 1), "gpu_mib": gpu_mem_mib(),
                               "server_rss_mib": rss_kb(s.proc.pid) >> 10,
                               "stub_rss_mib": {f"{Path(m).parent.parent.name}:{p}": rss_kb(p) >> 10
                                                for p, m in stub_pids(s.proc.pid).items()},
                               "inferences": st.get(MODEL, {}).get("inferences", 0)})
                if stop.wait(10):
                    return

        threads = [threading.Thread(target=f, daemon=True) for f in (checker, sampler)]
        for t in threads:
            t.start()
        runs, log = [], open(a.out / "perf_analyzer.log", "w")
        t_start = time.monotonic()
        deadline = t_start + a.warmup + a.seconds
        rps = 500.0
        while (left := deadline - time.monotonic()) > 5:  # back-to-back perf_analyzer runs of ~30 s
            n = int(rps * min(30.0, left))  # a request count, not time windows: no stability criterion to miss
            r = perf_analyzer(s.grpc_url, MODEL, a.out / "load.json", a.out / f"soak_{len(runs)}.csv",
                              ["--concurrency-range", str(a.concurrency), "--request-count", str(max(n, 100))], log)
            rps = r["rps"] if r else rps
            t = round(time.monotonic() - t_start)
            runs.append({"t": t, **(r or {"failed": True})})
            say(f"t={t}s load: " + (f"{r['rps']:.0f} req/s, p50 {r['p50_ms']:.2f} ms, p99 {r['p99_ms']:.2f} ms"
                                    if r else "perf_analyzer FAILED (see perf_analyzer.log)")
                + f"; checker {checks['requests']} ok, {len(checks['errors'])} errors, "
                  f"{len(checks['mismatches'])} mismatches; GPU {series[-1]['gpu_mib']} MiB")
        checker_alive = threads[0].is_alive()  # it ends only when stopped: dead now means it crashed
        stop.set()
        for t in threads:
            t.join(60)
    warm = next(x for x in series if x["t"] >= a.warmup)
    end = series[-1]
    stubs_flat = all(abs(end["stub_rss_mib"].get(k, -1) - v) <= 0.10 * v for k, v in warm["stub_rss_mib"].items())
    verdict = {"errors": len(checks["errors"]), "mismatches": len(checks["mismatches"]),
               "perf_analyzer_failures": sum("failed" in r for r in runs),
               "gpu_mib_after_warmup": warm["gpu_mib"], "gpu_mib_end": end["gpu_mib"],
               "gpu_mib_max": max(x["gpu_mib"] for x in series),
               "gpu_flat": abs(end["gpu_mib"] - warm["gpu_mib"]) <= 0.02 * warm["gpu_mib"] if warm["gpu_mib"] > 0
               else None, "stub_rss_flat": stubs_flat,
               "texts": end["inferences"] - warm["inferences"], "seconds": end["t"] - warm["t"],
               "checker_alive": checker_alive, "checked": checks["requests"]}
    verdict["passed"] = (not verdict["errors"] and not verdict["mismatches"] and not verdict["perf_analyzer_failures"]
                         and verdict["gpu_flat"] is not False and stubs_flat and checker_alive
                         and checks["requests"] >= a.seconds)  # the checker sends ~5 a second
    (a.out / "soak.json").write_text(json.dumps({"verdict": verdict, "checks": {
        **checks, "errors": checks["errors"][:50], "mismatches": checks["mismatches"][:50]},
        "runs": runs, "series": series}, indent=1))
    say(f"soak {'PASSED' if verdict['passed'] else 'FAILED'}: {json.dumps(verdict)}")
    return 0 if verdict["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
