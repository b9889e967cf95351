"""perf_analyzer over gRPC and Triton's own accounting: the --input-data JSON for a list of texts, one
perf_analyzer run read back from its CSV (retried with looser stability when no 3 windows agree), Triton's per-model
statistics and their difference over a window, and the models' own series (the stubs' metrics, Triton's counts
per model) with the models' own times derived from them. Used by perf/serving/bench_serve.py and the other serving
benchmarks."""
import csv
import re
import subprocess
import urllib.request
from pathlib import Path

from egemma.spec import TOKENIZER
from egemma.stub.metrics import STUB_FAMILIES, read_stats, render


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


def counters(server) -> dict[str, float]:
    """The models' own series of a running TritonServer: the stubs' (egemma.stub.metrics.STUB_FAMILIES, summed over
    the instances' files in its heartbeat directory, as the gateway's /metrics renders them) and Triton's
    nv_inference_count per model from its metrics port, keyed "nv_inference_count:<model>"."""
    out = {}
    for line in render(STUB_FAMILIES, read_stats(server.heartbeat_dir, STUB_FAMILIES)).splitlines():
        if not line.startswith("#") and "{" not in line:
            name, value = line.split()
            out[name] = float(value)
    with urllib.request.urlopen(f"http://{server.host}:{server.metrics_port}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("nv_inference_count{"):
                key = "nv_inference_count:" + re.search(r'model="([^"]*)"', line).group(1)
                out[key] = out.get(key, 0.0) + float(line.rsplit(None, 1)[1])
    return out


def _delta(cb: dict, ca: dict, name: str) -> float:
    return ca.get(name, 0.0) - cb.get(name, 0.0)


def tokenizer_ms_per_text(cb: dict, ca: dict) -> float | None:
    """The tokenizer model's own time in execute per text, ms, between two reads of `counters` (None: no tokenizer
    execute recorded: no texts, or the floor, whose models record nothing). Its texts are Triton's count of the
    tokenizer's inferences (TEXT is [texts, 1])."""
    if not _delta(cb, ca, "egemma_tokenize_duration_seconds_count"):
        return None
    texts = _delta(cb, ca, f"nv_inference_count:{TOKENIZER}")
    return 1e3 * _delta(cb, ca, "egemma_tokenize_duration_seconds_sum") / texts if texts else None


def model_times(cb: dict, ca: dict) -> dict:
    """Both models' own times between two reads of `counters`: the encoder's per execute that embedded something,
    ms, all of execute and the engine's embed in it (what Triton's compute_infer adds around execute is the stub's
    and the IPC's), and the tokenizer's execute per text."""
    n = _delta(cb, ca, "egemma_batch_size_count")
    if not n:  # no encoder execute recorded (the floor records nothing)
        return {}
    out = {"encoder_execute_ms": 1e3 * _delta(cb, ca, "egemma_encoder_seconds_total") / n,
           "encoder_embed_ms": 1e3 * _delta(cb, ca, "egemma_engine_duration_seconds_sum") / n}
    if (per_text := tokenizer_ms_per_text(cb, ca)) is not None:
        out["tokenizer_execute_ms_per_text"] = per_text
    return out
