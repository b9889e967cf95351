"""What tracing costs the gateway (egemma.gateway.tracing), on CPU: one tritonserver on a generated checkpoint, one
gateway process per setting (tracing off; on with --otlp-sample-ratio 0, spans made but none sampled; on with every
request sampled and sent to a local OTLP/HTTP receiver), the same sequential requests through each (KServe fast
lane and OpenAI route), p50 latency and the gateway's CPU per request. Off, the request path's added work is an
`is None` test per hook, timed here too.

  python -m perf.serving.bench_tracing [--requests 400] [--checkpoint DIR]"""
import argparse
import http.server
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import timeit
from pathlib import Path

import psutil
import requests

from egemma.ops.repository import ROOT
from perf.lib.servers import gateway, triton

INFER = "/v2/models/embeddinggemma/infer"
BODY = b'{"inputs":[{"name":"TEXT","shape":[1,1],"datatype":"BYTES","data":["a short query text"]}]}'


class Sink(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *a):
        pass


def cpu_seconds(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def run(server, extra: list[str], n: int, log: Path) -> dict:
    s, out = requests.Session(), {}
    with gateway(server, log, *extra) as (port, proc):
        for name, path, kw in (("kserve", INFER, {"data": BODY}), ("openai", "/v1/embeddings",
                                                                    {"json": {"input": "a short query text"}})):
            for _ in range(20):  # warm: connections, the OpenAI route's first call
                s.post(f"http://127.0.0.1:{port}{path}", timeout=60, **kw).raise_for_status()
            c0, lat = cpu_seconds(proc.pid), []
            for _ in range(n):
                t = time.perf_counter()
                s.post(f"http://127.0.0.1:{port}{path}", timeout=60, **kw).raise_for_status()
                lat.append(time.perf_counter() - t)
            out[name] = (1e3 * statistics.median(lat), 1e6 * (cpu_seconds(proc.pid) - c0) / n)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--checkpoint", type=Path)
    a = ap.parse_args()
    from egemma.gateway.common import Gateway
    gw = Gateway(triton_http="x:1", triton_grpc="x:2")
    hook = timeit.timeit("gw.tracing is None", globals={"gw": gw}, number=1_000_000) * 1e3  # ns per test
    sink = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    threading.Thread(target=sink.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{sink.server_address[1]}"
    ckpt = a.checkpoint
    if ckpt is None:
        ckpt = Path(tempfile.mkdtemp()) / "ckpt"
        subprocess.run([sys.executable, str(ROOT / "scripts/make_checkpoint.py"), str(ckpt)], check=True,
                       stdout=subprocess.DEVNULL)
    logs = Path(tempfile.mkdtemp())
    with triton(ckpt, logs / "tritonserver.log") as server:
        rows = [(name, run(server, extra, a.requests, logs / f"gateway{i}.log")) for i, (name, extra) in enumerate((
            ("off", []), ("on, ratio 0", [f"--otlp-endpoint={url}", "--otlp-sample-ratio=0"]),
            ("on, ratio 1", [f"--otlp-endpoint={url}"])))]
    print(f"hook when off: {hook:.0f} ns per `is None` (3 per OpenAI request, 2 per KServe request)")
    print("| tracing | KServe p50 ms | KServe gateway CPU us/req | OpenAI p50 ms | OpenAI gateway CPU us/req |")
    print("|---|---|---|---|---|")
    for name, r in rows:
        print(f"| {name} | {r['kserve'][0]:.2f} | {r['kserve'][1]:.0f} | {r['openai'][0]:.2f} | {r['openai'][1]:.0f} |")


if __name__ == "__main__":
    main()
