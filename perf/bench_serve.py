"""Serving benchmark through the real Triton, on the GPU host, side by side with a baseline repository that
serves sentence-transformers bf16 behind the same Triton (perf/baseline_repository).

  python perf/bench_serve.py CHECKPOINT --out DIR [--skip-baseline] [--suite full|short|sweep]
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
Hugging Face's tokenizer in place of kernels/bpe.c, the A/B of the tokenizer backend); each --floor-wait variant,
the floor whose encoder sleeps that long an execute as ours waits for its GPU, runs w2 and w3. Per-model split
(Triton's statistics) for w1 and w3 at c=128, and the GPU's
utilisation, SM clock and power during each. The size of the tokenizer's pieces: perf/tokenizer_pieces.py.
Writes CSV per perf_analyzer run, results.json, throughput/latency PNG, and prints a summary table."""
import argparse
import csv
import glob
import json
import random
import re
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from egemma.engine.config import ModelConfig
from egemma.ops.repository import ROOT
from egemma.ops.tritonserver import TritonServer, free_port
from egemma.engine.tokenizer import TextTokenizer, resolved_tokenizer_json

CONCURRENCY = [1, 16, 64, 128, 256]
W1_TEXTS = 128
MODELS = ("embeddinggemma_tokenizer", "embeddinggemma_encoder")


def prose() -> list[str]:
    """Words of real English text: the package descriptions installed on this machine."""
    words = []
    for f in sorted(glob.glob(f"{Path(np.__file__).parent.parent}/*.dist-info/METADATA"))[:400]:
        body = Path(f).read_text(errors="ignore").split("\n\n", 1)[-1]
        words += re.sub(r"[`*#<>\[\]()|=_]+", " ", body).split()
    return words


def code() -> str:
    """Real source code with its docstrings and indentation: numpy's own Python files."""
    return "\n".join(Path(f).read_text(errors="ignore") for f in sorted(glob.glob(f"{Path(np.__file__).parent}/**/*.py",
                                                                                     recursive=True))[:300])


def cjk(cjk_dir: Path | None, rng: random.Random) -> str:
    """Chinese, Japanese and Korean prose (CPython's cjkencodings test texts), sentences shuffled and repeated to
    ~200k characters; empty if none is found."""
    dirs = [cjk_dir] if cjk_dir else [Path(d) for d in glob.glob(f"{sys.base_prefix}/lib/python3*/test/cjkencodings")]
    sents = [x for d in dirs for f in sorted(d.glob("*-utf8.txt")) for x in re.split(r"(?<=[。．！？\n])", f.read_text())
             if x.strip()]
    out, n = [], 0
    while sents and n < 200_000:
        rng.shuffle(sents)
        out += sents
        n += sum(map(len, sents))
    return "".join(out)


def make_chars(tok: TextTokenizer, corpus: str, n_tokens: int, rng: random.Random) -> str:
    """The shortest slice of corpus from a random start that reaches n_tokens (specials included)."""
    start = rng.randrange(0, len(corpus) - 8 * n_tokens)
    lo, hi = 1, 8 * n_tokens
    while lo < hi:
        mid = (lo + hi) // 2
        if tok.untruncated_length(corpus[start:start + mid]) >= n_tokens:
            hi = mid
        else:
            lo = mid + 1
    return corpus[start:start + lo]


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


def perf_analyzer(url, model, data, out_csv, extra, log, window_ms=2000, stability=25, trials=6):
    cmd = ["perf_analyzer", "-m", model, "-i", "grpc", "-u", url, "--input-data", str(data), "-f", str(out_csv),
           "--measurement-interval", str(window_ms), "--stability-percentage", str(stability),
           "--max-trials", str(trials), *extra]
    Path(out_csv).unlink(missing_ok=True)
    r = subprocess.run(cmd, capture_output=True, text=True)
    log.write(f"$ {' '.join(cmd)}\n{r.stdout}\n{r.stderr}\n")
    log.flush()
    if (r.returncode != 0 or not Path(out_csv).exists()) and stability < 100:
        if "stable" in r.stdout + r.stderr:  # no 3 windows within `stability` %: report the last ones, marked
            res = perf_analyzer(url, model, data, out_csv, extra, log, window_ms, 100, 3)
            return res and {**res, "unstable": True}
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
    """Per model in a window: executions, inferences and queue / compute input / infer / output in ms per
    execution as Triton accounts them: each request adds its execution's duration, so with b requests per
    execution the value is b x one execution's duration (with one request per execution, the duration)."""
    out = {}
    for name, a in after.items():
        b = before.get(name, {})
        n = a["executions"] - b.get("executions", 0)
        if n:
            out[name] = {"executions": n, "inferences": a["inferences"] - b.get("inferences", 0),
                         **{k: (a[k] - b.get(k, 0)) / n / 1e6 for k in
                            ("queue", "compute_input", "compute_infer", "compute_output")}}
    return out


def pa_data(texts: list[str], utf8: bool) -> dict:
    """perf_analyzer --input-data JSON, one text per entry (with -b N, a request takes N consecutive entries;
    UINT8 rows are zero-padded to one length so that they batch)."""
    if utf8:
        n = max(len(t.encode()) for t in texts)
        return {"data": [{"TEXT_UTF8": {"content": list(t.encode().ljust(n, b"\0")), "shape": [n]}} for t in texts]}
    return {"data": [{"TEXT": [t]} for t in texts]}


def counters(metrics_url) -> dict[str, float]:
    """The egemma_* counters on Triton's metrics endpoint, summed over instances (none for other models)."""
    out = {}
    with urllib.request.urlopen(f"http://{metrics_url}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("egemma_"):
                name, value = line.split("{")[0].split()[0], float(line.rsplit(None, 1)[1])
                out[name] = out.get(name, 0.0) + value
    return out


def w1(url, metrics_url, model, data, out: Path, name, log):
    """One request of the 8 long texts at a time (perf_analyzer -b 8), with Triton's per-model split and the
    tokenizer model's own time in execute (its counters: what Triton's compute adds around it is the stub's)."""
    c = grpcclient.InferenceServerClient(url)
    before, cb = model_stats(c), counters(metrics_url)
    with GpuMonitor(out / f"{name}_gpu_w1.txt") as gpu:
        res = perf_analyzer(url, model, data, out / f"{name}_w1.csv", ["-b", "8", "--concurrency-range", "1"], log,
                            window_ms=4000)
    if not res:
        return None
    res["gpu"] = gpu.means
    if (per_text := tokenizer_ms_per_text(cb, counters(metrics_url))) is not None:
        res["tokenizer_execute_ms"] = 8 * per_text
    return {**res, "per_model_ms_per_execution": stats_delta(before, model_stats(c))}


def tokenizer_ms_per_text(cb: dict, ca: dict) -> float | None:
    """The tokenizer model's own time in execute per text, ms, from its counters between two reads (None: no texts,
    or the floor, which has no counters). Both counters flush together, so their ratio is exact even with a flush
    pending."""
    texts = ca.get("egemma_texts_total", 0) - cb.get("egemma_texts_total", 0)
    if not texts:
        return None
    return 1e3 * (ca["egemma_tokenizer_seconds_total"] - cb.get("egemma_tokenizer_seconds_total", 0)) / texts


def model_times(cb: dict, ca: dict) -> dict:
    """Both models' own times from their counters between two reads: the encoder's per execute, ms, all of execute
    and the engine's embed in it (what Triton's compute_infer adds around execute is the stub's and the IPC's), and
    the tokenizer's execute per text."""
    n = ca.get("egemma_executes_total", 0) - cb.get("egemma_executes_total", 0)
    if not n or "egemma_encoder_seconds_total" not in ca:  # the floor has no counters
        return {}
    out = {f"encoder_{k}_ms": 1e3 * (ca[f"egemma_{s}_seconds_total"] - cb.get(f"egemma_{s}_seconds_total", 0)) / n
           for k, s in (("execute", "encoder"), ("embed", "embed"))}
    if (per_text := tokenizer_ms_per_text(cb, ca)) is not None:
        out["tokenizer_execute_ms_per_text"] = per_text
    return out


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
    # as in w1, where the tokenizer waits ~15 ms for the encoder between requests: is it slower from cold?
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


def cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of all cores so far, from /proc/stat."""
    v = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    return sum(v) - v[3] - v[4], sum(v)  # idle and iowait are not busy


class GpuMonitor:
    """nvidia-smi sampling the GPU's utilisation (%), SM clock (MHz) and board power (W) every 200 ms while open into
    path; `means` after ({} without nvidia-smi). Back to back the 8 x 2048 forward holds the H200 at its power cap
    (perf/RESULTS.md run 114): the clock says whether a workload ran there."""
    FIELDS = ("utilization.gpu", "clocks.sm", "power.draw")

    def __init__(self, path: Path):
        self.path, self.proc, self.means = path, None, {}

    def __enter__(self) -> "GpuMonitor":
        with open(self.path, "w") as log:  # the child keeps its own descriptor
            try:
                self.proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={','.join(self.FIELDS)}",
                                              "--format=csv,noheader,nounits", "-lms", "200"],
                                             stdout=log, stderr=subprocess.DEVNULL)
            except OSError:
                pass
        return self

    def __exit__(self, *exc):
        if self.proc is None:
            return
        self.proc.terminate()
        self.proc.wait()
        rows = []
        for line in open(self.path).read().splitlines():
            try:
                rows.append([float(v) for v in line.split(",")])
            except ValueError:  # [N/A] where the GPU does not report one
                continue
        rows = [r for r in rows if len(r) == len(self.FIELDS)]
        if rows:
            self.means = {f: statistics.mean(r[i] for r in rows) for i, f in enumerate(self.FIELDS)}


def run_suite(name, url, metrics_url, model, data, out: Path, log, suite: str):
    """suite: full (all workloads), short (w1, w2, w3 at c=128/256), sweep (w2, w3 at c=128/256).
    name: a file-name-safe tag for the CSV files."""
    families = [k for k in ("w1", "w1_code", "w1_cjk") if k in data] if suite != "sweep" else []
    res = {k: w1(url, metrics_url, model, data[k], out, f"{name}_{k[3:]}" if k != "w1" else name, log) for k in families}
    stats = grpcclient.InferenceServerClient(url)
    before, cb = model_stats(stats), counters(metrics_url)
    res["w2"] = perf_analyzer(url, model, data["w2"], out / f"{name}_w2.csv", ["--concurrency-range", "1"], log)
    if res["w2"]:  # where one query's time goes, per model (one request per execution: plain durations)
        res["w2"]["per_model_ms_per_execution"] = stats_delta(before, model_stats(stats))
        res["w2"].update(model_times(cb, counters(metrics_url)))
    res["w3"] = {}
    for c in {"full": CONCURRENCY, "short": [128, 256], "sweep": [128, 256]}[suite]:
        before, cpu0, cb = model_stats(stats), cpu_times(), counters(metrics_url)
        with GpuMonitor(out / f"{name}_gpu_c{c}.txt") as gpu:
            res["w3"][c] = perf_analyzer(url, model, data["w3"], out / f"{name}_w3_c{c}.csv",
                                         ["--concurrency-range", str(c)], log)
        if c == 128:
            res["w3_c128_encoder"] = model_times(cb, counters(metrics_url))
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


def floor_repository(dest: Path, wait_us: int = 0) -> Path:
    """model_repository (same configs, instance counts, ensemble) with both Python models replaced by
    perf/floor_model.py; wait_us: each encoder execute sleeps that long first."""
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(ROOT / "model_repository", dest, ignore=shutil.ignore_patterns("__pycache__"))
    for model in MODELS:
        shutil.copy(ROOT / "perf" / "floor_model.py", dest / model / "1" / "model.py")
    if wait_us:
        with open(dest / MODELS[1] / "config.pbtxt", "a") as f:
            f.write(f'parameters {{ key: "floor_wait_us" value: {{ string_value: "{wait_us}" }} }}\n')
    return dest


def plot(results, out: Path):
    try:
        import matplotlib
    except ImportError:
        print("no matplotlib: no plot")
        return
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
    ap.add_argument("--suite", choices=("full", "short", "sweep"), default="full", help="workloads for ours")
    ap.add_argument("--sweep", nargs="*", default=[], metavar="MODEL=N,MODEL=N",
                    help="instance-count variants, e.g. embeddinggemma_encoder=2,embeddinggemma_tokenizer=6")
    ap.add_argument("--cjk-dir", type=Path, help="a folder of *-utf8.txt CJK texts (default: this Python's "
                                                 "test/cjkencodings)")
    ap.add_argument("--tokenizers-too", action="store_true",
                    help="also serve ours with tokenizer_backend=tokenizers (Hugging Face's) in place of kernels/bpe.c")
    ap.add_argument("--gpu0", action="store_true",
                    help="also serve with the encoder placed by the launcher's --gpus 0 (KIND_GPU on GPU 0) instead of "
                         "the repository's KIND_MODEL: it must serve as the defaults do")
    ap.add_argument("--floor-wait", nargs="*", type=int, default=[], metavar="US",
                    help="also serve the floor with each encoder execute sleeping US microseconds first (w2, w3): "
                         "what a GPU wait of that length per batch costs the serial path, nothing else of ours in it")
    ap.add_argument("--floor", action="store_true",
                    help="also serve the repository with both models doing nothing (perf/floor_model.py): what "
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
        suites.append(("st_bf16", ROOT / "perf" / "baseline_repository", "st_bf16", "short", None,
                       str(Path(sys.executable).parent), None, None))
    for name, repo, model, suite, instances, stub_bin, gpus, params in suites:
        t0 = time.perf_counter()
        tag = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)  # for file names
        try:
            with open(a.out / f"server_{tag}.log", "w") as slog, \
                    TritonServer(a.checkpoint, http_port=free_port(), grpc_port=free_port(),
                                 metrics_port=free_port(), log_file=slog, repository=repo, instances=instances,
                                 stub_bin=stub_bin, gpus=gpus, params=params) as s:
                print(f"{name}: server ready in {time.perf_counter() - t0:.1f}s", flush=True)
                results[name] = run_suite(tag, s.grpc_url, f"{s.host}:{s.metrics_port}", model,
                                          data[stub_bin is not None], a.out, log, suite)
        except RuntimeError as e:
            errors = [ln for ln in open(slog.name) if ln.startswith("E")]
            print(f"{name}: server failed: {e}\n{''.join(errors)[:1500]}", flush=True)
            continue
        print(f"{name}: {json.dumps(results[name])}", flush=True)
    (a.out / "results.json").write_text(json.dumps({"tokenizer_ms": tok_ms, **results}, indent=2))
    plot(results, a.out)
    summary(results)


def summary(results):
    def f(v, k):
        return f"{v[k]:.2f}" if v and v.get(k) is not None else "-"

    def split(r, w="w1"):
        m = (r.get(w) or {}).get("per_model_ms_per_execution", {})
        return " / ".join(f"{m[k]['compute_infer']:.1f}" if k in m else "-" for k in MODELS)

    def serial(r):
        """Per request, the time its model instance spent on it, us, and the mean batch b: what caps one instance's
        throughput. stats_delta's values are b x an execution's duration (see there), so this is value / b^2."""
        m = r.get("w3_c128_per_model", {})

        def one(k):
            b = m[k]["inferences"] / m[k]["executions"]  # single-text requests: rows = requests
            t = sum(m[k][x] for x in ("compute_input", "compute_infer", "compute_output"))
            return f"{t * 1e3 / b / b:.0f} (b{b:.0f})"
        return " / ".join(one(k) if k in m else "-" for k in MODELS)
    rows = [(f"{k} 8x2048 p50 / p99 ms", lambda r, k=k: f"{f(r.get(k), 'p50_ms')} / {f(r.get(k), 'p99_ms')}")
            for k in ("w1", "w1_code", "w1_cjk")]
    rows += [
            *((f"{k} tokenizer / encoder infer ms", lambda r, k=k: split(r, k))
              for k in ("w1", "w1_code", "w1_cjk", "w2")),
            ("w1 tokenizer execute ms", lambda r: f((r.get("w1") or {}), "tokenizer_execute_ms")),
            *((f"{w} encoder execute / embed ms", lambda r, k=k: " / ".join(
                f(r.get(k) or {}, m) for m in ("encoder_execute_ms", "encoder_embed_ms")))
              for w, k in (("w2", "w2"), ("w3 c=128", "w3_c128_encoder"))),
            *((f"{w} tokenizer execute ms a text", lambda r, k=k: f(r.get(k) or {}, "tokenizer_execute_ms_per_text"))
              for w, k in (("w2", "w2"), ("w3 c=128", "w3_c128_encoder"))),
            ("w2 1 query p50 / p99 ms", lambda r: f"{f(r['w2'], 'p50_ms')} / {f(r['w2'], 'p99_ms')}")]
    for c in CONCURRENCY:
        rows.append((f"w3 c={c} req/s (p50 ms)", lambda r, c=c: f"{f(r['w3'].get(c), 'rps')} "
                                                                 f"({f(r['w3'].get(c), 'p50_ms')})"))
    rows.append(("w3 c=128 us/req tok / enc (batch)", serial))
    rows.append(("w1 GPU SM MHz / W (mean)", lambda r: " / ".join(
        f"{v:.0f}" if (v := (r.get("w1") or {}).get("gpu", {}).get(k)) is not None else "-"
        for k in ("clocks.sm", "power.draw"))))
    rows.append(("GPU / CPU util at c=128 %", lambda r: f"{r.get('gpu_util_c128') or 0:.0f} / "
                                                        f"{r.get('cpu_util_c128') or 0:.0f}"))
    rows.append(("w4 @70% max: p50 / p99 ms", lambda r: f"{f(r.get('w4'), 'p50_ms')} / {f(r.get('w4'), 'p99_ms')}"))
    rows.append(("w4 max req/s, rate", lambda r: f"{f(r.get('w4'), 'max_rps')}, {(r.get('w4') or {}).get('rate', '-')}"))
    width = max(24, *(len(n) + 2 for n in results))
    print(f"\n{'workload':<34}" + "".join(f"{n:>{width}}" for n in results))
    for label, fn in rows:
        print(f"{label:<34}" + "".join(f"{fn(r):>{width}}" for r in results.values()))


if __name__ == "__main__":
    sys.exit(main())
