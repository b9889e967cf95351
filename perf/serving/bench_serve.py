"""Serving benchmark through the real Triton, on the GPU host, side by side with a baseline repository that
serves sentence-transformers bf16 behind the same Triton (perf/serving/baseline_repository).

  python -m perf.serving.bench_serve CHECKPOINT --out DIR [--skip-baseline] [--suite full|short|sweep]
                            [--sweep MODEL=N,MODEL=N ...] [--floor] [--floor-wait US ...] [--tokenizers-too]

Workloads (gRPC, text built from real English prose, token counts measured with the checkpoint's tokenizer):
  w1  one request of 8 texts x ~2048 tokens, sequential       (perf_analyzer -b 8, cycling over 16 different
      requests), for three text families:
      prose (w1), source code (w1_code: numpy's own .py files) and CJK (w1_cjk: CPython's cjkencodings test
      texts, sentences shuffled and repeated; from --cjk-dir or this Python's test package; skipped if none)
  w2  one ~16-token query, concurrency 1                       (perf_analyzer)
  w3  single ~20-token texts, concurrency 1 .. 256             (perf_analyzer; throughput, latency)
  w4  80% queries of 10-40 tokens, 20% passages of 200-600, Poisson arrivals at 70% of the max rate
Each --sweep variant (instance counts; with --floor also the floor with those counts), and with --floor the repository
with do-nothing models, runs w1, w2 and w3 at c=128/256 (w2 and w3 only with --suite sweep) on its own server after
the suite on the repository's defaults (--tokenizers-too: ours with
Hugging Face's tokenizer in place of egemma/kernels/bpe.c, the A/B of the tokenizer backend); each --floor-wait variant,
the floor whose encoder sleeps that long an execute as ours waits for its GPU, runs w2 and w3. Per-model split
(Triton's statistics) for w1 and w3 at c=128, and the GPU's
utilisation, SM clock and power during each. The size of the tokenizer's pieces: perf/engine/tokenizer_pieces.py.
Writes CSV per perf_analyzer run, results.json, throughput/latency PNG, and prints a summary table."""
import argparse
import json
import random
import re
import statistics
import sys
import time
from pathlib import Path

import tritonclient.grpc as grpcclient

from egemma.engine.config import ModelConfig
from egemma.engine.tokenizer import TextTokenizer, resolved_tokenizer_json
from egemma.ops.repository import ROOT
from perf.lib.corpora import cjk, code, make_chars, make_text, prose
from perf.lib.gpumon import GpuMonitor, cpu_times
from perf.lib.pa import counters, model_stats, model_times, pa_data, perf_analyzer, stats_delta, tokenizer_ms_per_text
from perf.lib.servers import triton
from perf.serving.floor import floor_repository
from perf.serving.report import plot, summary

CONCURRENCY = [1, 16, 64, 128, 256]
W1_TEXTS = 128


def w1(url, server, model, data, out: Path, name, log):
    """One request of the 8 long texts at a time (perf_analyzer -b 8), with Triton's per-model split and the
    tokenizer model's own time in execute (its counters: what Triton's compute adds around it is the stub's)."""
    c = grpcclient.InferenceServerClient(url)
    before, cb = model_stats(c), counters(server)
    with GpuMonitor(out / f"{name}_gpu_w1.txt") as gpu:
        res = perf_analyzer(url, model, data, out / f"{name}_w1.csv", ["-b", "8", "--concurrency-range", "1"], log,
                            window_ms=4000)
    if not res:
        return None
    res["gpu"] = gpu.means
    if (per_text := tokenizer_ms_per_text(cb, counters(server))) is not None:
        res["tokenizer_execute_ms"] = 8 * per_text
    return {**res, "per_model_ms_per_execution": stats_delta(before, model_stats(c))}


def tokenizer_times(tok: TextTokenizer, checkpoint: Path, texts: dict) -> dict:
    """The tokenizer model's call (texts in pieces, int32 arrays out) with each backend, against one batched call of
    the checkpoint's tokenizer as transformers builds it, on this host's cores: 8 x 2048 tokens, 256 queries, one.
    "fresh": each of 16 different batches once (a word cache is no help on text it has not seen)."""
    from tokenizers import Tokenizer
    plain = Tokenizer.from_str(resolved_tokenizer_json(checkpoint))
    plain.enable_truncation(tok.max_length)
    hf = TextTokenizer(tok.cfg, backend="tokenizers")
    out = {}
    ours = (("ours", tok.encode), ("ours tokenizers", hf.encode), ("plain", plain.encode_batch_fast))
    runs = [(label, [batch[:8] if label.startswith("8x") else batch] * 22, name, f, 0.0) for label, batch in
            (("8x2048", texts["w1"]), ("8x2048 code", texts["w1_code"]), ("8x2048 cjk", texts.get("w1_cjk")),
             ("256x20", texts["w3"]), ("1x16", texts["w2"][:1])) if batch for name, f in ours]
    for k, label in (("w1", "8x2048"), ("w1_code", "8x2048 code"), ("w1_cjk", "8x2048 cjk")):
        if k in texts:
            batches = [texts[k][i:i + 8] for i in range(0, len(texts[k]), 8)]
            runs += [(label, batches[:1] * 2 + batches, f"{name} fresh", f, 0.0) for name, f in ours]
    # as in w1, where the tokenizer waits for the encoder's forward between requests: is it slower from cold?
    runs.append(("8x2048", [texts["w1"][:8]] * 22, "ours 20 ms apart", tok.encode, 0.02))
    for label, batches, name, f, gap in runs:
        ts = []
        for batch in batches:
            time.sleep(gap)
            t0 = time.perf_counter()
            f(batch)
            ts.append((time.perf_counter() - t0) * 1e3)
        out[f"{label} {name}"] = round(statistics.median(ts[2:]), 3)
    return out


def run_suite(name, url, server, model, data, out: Path, log, suite: str):
    """suite: full (all workloads), short (w1, w2, w3 at c=128/256), sweep (w2, w3 at c=128/256).
    name: a file-name-safe tag for the CSV files."""
    families = [k for k in ("w1", "w1_code", "w1_cjk") if k in data] if suite != "sweep" else []
    res = {k: w1(url, server, model, data[k], out, f"{name}_{k[3:]}" if k != "w1" else name, log) for k in families}
    stats = grpcclient.InferenceServerClient(url)
    before, cb = model_stats(stats), counters(server)
    res["w2"] = perf_analyzer(url, model, data["w2"], out / f"{name}_w2.csv", ["--concurrency-range", "1"], log)
    if res["w2"]:  # where one query's time goes, per model (one request per execution: plain durations)
        res["w2"]["per_model_ms_per_execution"] = stats_delta(before, model_stats(stats))
        res["w2"].update(model_times(cb, counters(server)))
    res["w3"] = {}
    for c in {"full": CONCURRENCY, "short": [128, 256], "sweep": [128, 256]}[suite]:
        before, cpu0, cb = model_stats(stats), cpu_times(), counters(server)
        with GpuMonitor(out / f"{name}_gpu_c{c}.txt") as gpu:
            res["w3"][c] = perf_analyzer(url, model, data["w3"], out / f"{name}_w3_c{c}.csv",
                                         ["--concurrency-range", str(c)], log)
        if c == 128:
            res["w3_c128_encoder"] = model_times(cb, counters(server))
            res["gpu_c128"] = gpu.means
            res["gpu_util_c128"] = gpu.means.get("utilization.gpu")
            busy, total = (b - a for a, b in zip(cpu0, cpu_times()))
            res["cpu_util_c128"] = 100 * busy / total  # all cores, perf_analyzer included
            # perf_analyzer's warm-up and trials together; the split per execution is what matters
            res["w3_c128_per_model"] = stats_delta(before, model_stats(stats))
    if suite == "full":
        peak = perf_analyzer(url, model, data["w4"], out / f"{name}_w4_max.csv", ["--concurrency-range", "128"], log)
        if peak:
            rate = int(0.7 * peak["rps"])
            res["w4"] = perf_analyzer(url, model, data["w4"], out / f"{name}_w4.csv",
                                      ["--request-rate-range", str(rate), "--request-distribution", "poisson"], log)
            if res["w4"]:
                res["w4"]["rate"] = rate
                res["w4"]["max_rps"] = peak["rps"]
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--skip-baseline", action="store_true")
    ap.add_argument("--suite", choices=("full", "short", "sweep"), default="full", help="workloads for ours")
    ap.add_argument("--sweep", nargs="*", default=[], metavar="MODEL=N,MODEL=N",
                    help="instance-count variants, e.g. embeddinggemma_encoder=2,embeddinggemma_tokenizer=6")
    ap.add_argument("--cjk-dir", type=Path, help="a folder of *-utf8.txt CJK texts (default: this Python's "
                                                 "test/cjkencodings)")
    ap.add_argument("--tokenizers-too", action="store_true",
                    help="also serve ours with tokenizer_backend=tokenizers (Hugging Face's) in place of "
                         "egemma/kernels/bpe.c")
    ap.add_argument("--gpu0", action="store_true",
                    help="also serve with the encoder placed by the launcher's --gpus 0 (KIND_GPU on GPU 0) instead of "
                         "the repository's KIND_MODEL: it must serve as the defaults do")
    ap.add_argument("--floor-wait", nargs="*", type=int, default=[], metavar="US",
                    help="also serve the floor with each encoder execute sleeping US microseconds first (w2, w3): "
                         "what a GPU wait of that length per batch costs the serial path, nothing else of ours in it")
    ap.add_argument("--floor", action="store_true",
                    help="also serve the repository with both models doing nothing (perf/serving/floor_model.py): what "
                         "Triton, the ensemble and the Python backend cost on this host")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    tok = TextTokenizer(ModelConfig.load(a.checkpoint))
    words, rng = prose(), random.Random(0)
    # w1: 16 different requests of 8 texts, which perf_analyzer -b 8 cycles through (the same 8 texts on every
    # request would flatter any cache of the tokenizer's)
    texts = {"w1": [make_text(tok, words, 2047, rng) for _ in range(W1_TEXTS)],
             "w2": [make_text(tok, words, 16, rng) for _ in range(64)],
             "w3": [make_text(tok, words, 20, rng) for _ in range(256)],
             "w4": [make_text(tok, words, rng.randint(10, 40) if rng.random() < 0.8 else rng.randint(200, 600), rng)
                    for _ in range(500)],
             "w1_code": [make_chars(tok, code(), 2047, rng) for _ in range(W1_TEXTS)]}
    if len(corpus := cjk(a.cjk_dir, rng)) > 16 * 2048:
        texts["w1_cjk"] = [make_chars(tok, corpus, 2047, rng) for _ in range(W1_TEXTS)]
    data = {}
    for utf8 in (False, True):
        data[utf8] = {}
        for key in texts:
            path = a.out / f"{key}{'_utf8' if utf8 else ''}.json"
            path.write_text(json.dumps(pa_data(texts[key], utf8)))
            data[utf8][key] = path
    for k in (k for k in texts if k.startswith("w1")):
        n = [tok.untruncated_length(t) for t in texts[k]]
        print(f"{k}: {len(n)} texts of {min(n)}-{max(n)} tokens", flush=True)
    tok_ms = tokenizer_times(tok, a.checkpoint, texts)
    print("tokenizer alone, ms (median of 20):", json.dumps(tok_ms), flush=True)
    results = {}
    log = open(a.out / "perf_analyzer.log", "w")
    ours = ROOT / "model_repository"
    # (name, repository, model, suite, instance counts, stub Python: None = the default numpy<2 one, GPUs to place on,
    # model parameters)
    suites = [("ours", ours, "embeddinggemma", a.suite, None, None, None, None)]
    variant_suite = "sweep" if a.suite == "sweep" else "short"
    floor = floor_repository(a.out / "floor_repository") if a.floor else None
    if a.tokenizers_too:
        suites.append(("ours tokenizers", ours, "embeddinggemma", variant_suite, None, None, None,
                       {"tokenizer_backend": "tokenizers"}))
    for v in a.sweep:  # named like "ours tok6 enc3"; with --floor, the floor with the same counts beside it
        counts = {m: int(n) for m, n in (kv.split("=") for kv in v.split(","))}
        tag = " ".join(f"{m.rsplit('_', 1)[-1][:3]}{n}" for m, n in counts.items())
        suites.append((f"ours {tag}", ours, "embeddinggemma", variant_suite, counts, None, None, None))
        if floor:
            suites.append((f"floor {tag}", floor, "embeddinggemma", variant_suite, counts, None, None, None))
    if a.gpu0:
        suites.append(("ours gpus=0", ours, "embeddinggemma", variant_suite, None, None, [0], None))
    if floor:
        suites.append(("floor", floor, "embeddinggemma", "short", None, None, None, None))
    for us in a.floor_wait:
        suites.append((f"floor wait {us}us", floor_repository(a.out / f"floor_repository_{us}", us), "embeddinggemma",
                       "sweep", None, None, None, None))
    if not a.skip_baseline:  # sentence-transformers needs the host's numpy 2: its stub runs this Python
        suites.append(("st_bf16", ROOT / "perf" / "serving" / "baseline_repository", "st_bf16", "short", None,
                       str(Path(sys.executable).parent), None, None))
    for name, repo, model, suite, instances, stub_bin, gpus, params in suites:
        t0 = time.perf_counter()
        tag = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)  # for file names
        try:
            with triton(a.checkpoint, a.out / f"server_{tag}.log", repository=repo, instances=instances or {},
                        stub_bin=stub_bin, gpus=gpus or [], params=params or {}) as s:
                print(f"{name}: server ready in {time.perf_counter() - t0:.1f}s", flush=True)
                results[name] = run_suite(tag, s.grpc_url, s, model,
                                          data[stub_bin is not None], a.out, log, suite)
        except RuntimeError as e:
            errors = [ln for ln in open(a.out / f"server_{tag}.log") if ln.startswith("E")]
            print(f"{name}: server failed: {e}\n{''.join(errors)[:1500]}", flush=True)
            continue
        print(f"{name}: {json.dumps(results[name])}", flush=True)
    (a.out / "results.json").write_text(json.dumps({"tokenizer_ms": tok_ms, **results}, indent=2))
    plot(results, a.out)
    summary(results, CONCURRENCY)


if __name__ == "__main__":
    sys.exit(main())
