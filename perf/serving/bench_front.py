"""What the HTTP front (egemma.gateway.app) costs, on the GPU host: one ~16-token query over HTTP, direct to
Triton's own HTTP, through a bare Python byte pipe (perf/serving/proxy_floor.py: the hop alone), through the
gateway's fast lane and through its aiohttp path (a percent-escape in the query string, which the lane hands over),
interleaved on one server (a keep-alive http.client connection each);
and the largest request the server takes (64 texts x 1 MB, over gRPC: over HTTP it is a 413) with its time split
across the models (Triton's statistics).

  python -m perf.serving.bench_front CHECKPOINT [--out DIR] [--n 2000] [--workers 1] [--big-rows 64]
                                     [--big-bytes MAX_TEXT_BYTES] [--api-key]

--api-key: Triton and the gateway with an API key, as `--api-key` serves: direct queries send Triton's `api-key`
header, the gateway's `Authorization: Bearer` (the lane checks it and adds Triton's header: its most work).

Prints a table and writes front.json. Needs tritonclient.grpc, aiohttp (the gateway) and this repository; no
tritonclient.http (the GPU host has none)."""
import argparse
import http.client
import json
import random
import secrets
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from egemma.engine.config import ModelConfig
from egemma.engine.tokenizer import TextTokenizer
from egemma.ops.front import Front
from egemma.ops.tritonserver import free_port
from egemma.spec import MAX_TEXT_BYTES
from perf.lib.corpora import make_text, prose
from perf.lib.pa import model_stats, stats_delta
from perf.lib.servers import triton

INFER = "/v2/models/embeddinggemma/infer"


def cpu_s(pid: int) -> float:
    """CPU seconds of pid's main thread (the gateway's event loop), to the nanosecond (schedstat)."""
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0]) / 1e9


def one_query(conn: http.client.HTTPConnection, body: bytes, target: str = INFER, headers=None) -> float:
    t0 = time.perf_counter()
    conn.request("POST", target, body, {"Content-Type": "application/json", **(headers or {})})
    r = conn.getresponse()
    data = r.read()
    dt = time.perf_counter() - t0
    assert r.status == 200 and b"EMBEDDING" in data, (r.status, data[:200])
    return dt


def ms(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"p50_ms": 1e3 * xs[len(xs) // 2], "p99_ms": 1e3 * xs[int(len(xs) * 0.99)],
            "mean_ms": 1e3 * statistics.fmean(xs), "n": len(xs)}


def query_latency(server, front, pipe, query: str, n: int, key: str | None = None) -> dict:
    """pipe: the byte pipe's process (perf/serving/proxy_floor.py) and port."""
    body = json.dumps({"inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": [query]}]}).encode()
    conns = {"direct": http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60),
             "pipe": http.client.HTTPConnection("127.0.0.1", pipe[1], timeout=60),
             "gateway": http.client.HTTPConnection("127.0.0.1", front.port, timeout=60),
             "aiohttp": http.client.HTTPConnection("127.0.0.1", front.port, timeout=60)}
    targets = {"direct": INFER, "pipe": INFER, "gateway": INFER, "aiohttp": INFER + "?via=%61iohttp"}
    headers = {k: {} if key is None else {"api-key": key} if k in ("direct", "pipe")
               else {"Authorization": f"Bearer {key}"} for k in conns}
    pids = {"pipe": pipe[0].pid, "gateway": front.proc.pid, "aiohttp": front.proc.pid}
    for k, c in conns.items():  # warm-up: connections, the gateway's pool, the models
        for _ in range(min(200, n)):  # fewer for a short run: an idle connection must not time out
            one_query(c, body, targets[k], headers[k])
    times, cpu = {k: [] for k in conns}, {k: 0.0 for k in pids}
    order = list(conns)
    for i in range(n):
        for k in order[i % len(order):] + order[:i % len(order)]:
            c0 = cpu_s(pids[k]) if k in cpu else 0.0
            times[k].append(one_query(conns[k], body, targets[k], headers[k]))
            if k in cpu:
                cpu[k] += cpu_s(pids[k]) - c0
    out = {k: ms(v) for k, v in times.items()}
    for k in cpu:
        out[f"{k}_added_p50_ms"] = out[k]["p50_ms"] - out["direct"]["p50_ms"]
        out[f"{k}_cpu_ms_per_request"] = 1e3 * cpu[k] / n
    return out


def largest_request(server, texts: list[str], runs: int) -> dict:
    c = grpcclient.InferenceServerClient(server.grpc_url)
    meta = {"triton-grpc-protocol-api-key": server.api_key} if server.api_key else None
    t = grpcclient.InferInput("TEXT", [len(texts), 1], "BYTES")
    t.set_data_from_numpy(np.array([[s.encode()] for s in texts], dtype=object))
    c.infer("embeddinggemma", [t], client_timeout=600, headers=meta)  # warm-up
    before, wall = model_stats(c), []
    for _ in range(runs):
        t0 = time.perf_counter()
        emb = c.infer("embeddinggemma", [t], client_timeout=600, headers=meta).as_numpy("EMBEDDING")
        wall.append(time.perf_counter() - t0)
        assert emb.shape[0] == len(texts) and np.isfinite(emb).all()
    return {"rows": len(texts), "bytes_per_row": len(texts[0].encode()), "wall_s": [round(w, 3) for w in wall],
            "median_s": statistics.median(wall), "per_model_ms_per_execution": stats_delta(before, model_stats(c))}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--out", type=Path, default=Path("/tmp/front"))
    ap.add_argument("--n", type=int, default=2000, help="queries each way")
    ap.add_argument("--workers", type=int, default=1, help="gateway processes")
    ap.add_argument("--big-rows", type=int, default=64)
    ap.add_argument("--big-bytes", type=int, default=MAX_TEXT_BYTES, help="bytes per row (max_text_bytes)")
    ap.add_argument("--big-runs", type=int, default=3, help="0: no largest request")
    ap.add_argument("--api-key", action="store_true", help="serve and query with an API key")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    tok, words, rng = TextTokenizer(ModelConfig.load(a.checkpoint)), prose(), random.Random(0)
    query = make_text(tok, words, 16, rng)
    big = []
    for k in range(a.big_rows):  # real prose, each row its own stretch, exactly big_bytes long
        start, row, n = rng.randrange(len(words)), [], 0
        while n < a.big_bytes:
            row.append(words[(start + len(row)) % len(words)])
            n += len(row[-1]) + 1
        b = " ".join(row).encode()[:a.big_bytes].decode(errors="ignore").encode()  # no cut character
        big.append((b + b" " * (a.big_bytes - len(b))).decode())
    key = secrets.token_urlsafe(24) if a.api_key else None
    (a.out / "api-key").write_text(key or "")
    res = {"query_tokens": tok.untruncated_length(query), "api_key": key is not None}
    with triton(a.checkpoint, a.out / "server.log", api_key=key) as s:
        port = free_port()
        front = Front([f"--port={port}", f"--triton-http={s.http_url}", f"--triton-grpc={s.grpc_url}",
                       f"--workers={a.workers}", *([f"--api-key-file={a.out / 'api-key'}"] if key else [])],
                      f"http://127.0.0.1:{port}")
        front.port = port
        front.start()
        pipe_port = free_port()
        pipe = subprocess.Popen([sys.executable, str(Path(__file__).with_name("proxy_floor.py")), str(pipe_port),
                                 f"127.0.0.1:{s.http_port}"], stdout=subprocess.PIPE, text=True)
        assert pipe.stdout.readline().strip() == "listening"
        apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory",
                               "--format=csv,noheader"], capture_output=True, text=True).stdout.strip() \
            if shutil.which("nvidia-smi") else "(no nvidia-smi)"
        res["gpu_memory_per_process"] = apps.splitlines()  # each encoder stub's share of the memory budget
        print("GPU memory per process:\n  " + apps.replace("\n", "\n  "))
        try:
            res["query"] = query_latency(s, front, (pipe, pipe_port), query, a.n, key)
            q = res["query"]
            print(f"one {res['query_tokens']}-token query over HTTP, {a.n} each, interleaved:")
            for k in ("direct", "pipe", "gateway", "aiohttp"):
                added = f"  added p50 {q[f'{k}_added_p50_ms']:+.3f} ms, its CPU " \
                        f"{q[f'{k}_cpu_ms_per_request']:.3f} ms per request" if k != "direct" else ""
                print(f"  {k:8s} p50 {q[k]['p50_ms']:.3f} ms  p99 {q[k]['p99_ms']:.3f} ms  mean {q[k]['mean_ms']:.3f} ms"
                      + added, flush=True)
        finally:
            front.stop()
            pipe.kill()
            pipe.wait()
        if a.big_runs > 0:
            res["largest"] = big_res = largest_request(s, big, a.big_runs)
            print(f"largest request ({a.big_rows} x {a.big_bytes} bytes over gRPC): median "
                  f"{big_res['median_s']:.2f} s of {big_res['wall_s']}")
            for m, st in big_res["per_model_ms_per_execution"].items():
                split = "  ".join(f"{k} {v:.1f}" for k, v in st.items() if k.startswith(("queue", "compute")))
                print(f"  {m:26s} {split} ms per execution")
    (a.out / "front.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
