"""perf_analyzer over gRPC and Triton's own accounting: the --input-data JSON for a list of texts, one
perf_analyzer run read back from its CSV (retried with looser stability when no 3 windows agree), Triton's per-model
statistics and their difference over a window, and the egemma_* counters on the metrics endpoint with the models'
own times derived from them. Used by perf/serving/bench_serve.py and the other serving benchmarks."""
import csv
import subprocess
import urllib.request
from pathlib import Path


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
