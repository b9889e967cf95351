"""Side by side with the peers (issue #36): our server, sentence-transformers behind the same Triton, Infinity and
vLLM serving the same checkpoint, the same texts sent by the same client (perf/loadgen.py) on the same machine.

  python perf/peers.py CHECKPOINT --out DIR [--servers ours,st,infinity,vllm] [--peers-dir /tmp/peers] [--quick]
  python perf/peers.py --table RESULTS [RESULTS ...]   one table from several runs' results.json (or their folders)

Each server is started here with its documented best settings for an embedding model (SETTINGS: what and where it
is documented), one after the other, and stopped before the next; Infinity and vLLM from the folders that
perf/peers_stage.sh unpacks (PYTHONPATH of their own process only). Ours runs with its defaults
(`python -m egemma.ops.launcher`: gateway, watchdog, instance counts) and is called over the gateway's OpenAI route
(ours-http) and Triton's gRPC (ours-grpc). Workloads (texts: perf/corpora.py, prose within each stated length):
  w1      8 texts of <= 2048 tokens a request, one request at a time (16 different requests in turn): p50 / p99
  query   one text of <= 16 tokens a request, one at a time (64 different): p50 / p99
  c128    single texts of <= 20 tokens, 128 requests in flight: req/s and p99
  corpus  4096 documents, lognormal token counts (median 180, sigma 1, capped at 2048), 32 a request, 16 requests
          in flight: documents/s and tokens/s (our tokenizer's counts, specials included)
  fidelity 40 mixed texts (perf/corpora.py mixed) against sentence-transformers fp32 on the same weights: min cosine
--quick: small counts and short windows, for a CPU smoke run. Writes DIR/results.json and each server's log."""
import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from corpora import cjk, lognormal_docs, make_text, mixed, prose  # perf/ is on sys.path when run as a script
from loadgen import Target, all_of, closed_loop, embed, one_at_a_time
from egemma.engine.config import ModelConfig
from egemma.engine.tokenizer import TextTokenizer
from egemma.ops.repository import ROOT
from egemma.ops.tritonserver import TritonServer, free_port

NAME = "google/embeddinggemma-300m"
SETTINGS = {
    "ours": "defaults (python -m egemma.ops.launcher: encoder 3 / tokenizer instances by cores, CUDA graphs, FA3 "
            "where carried); README 'Two commands'",
    "st": "SentenceTransformer(...).to(bfloat16).encode of each dynamic batch (perf/baseline_repository)",
    "infinity": "v2 --engine torch --dtype bfloat16 --batch-size 128 --compile true, bettertransformer off "
                "(optimum's BetterTransformer has no Gemma3); `infinity_emb v2 --help`, "
                "https://michaelfeil.github.io/infinity (cli_v2)",
    "vllm": "--runner pooling --dtype bfloat16 --max-model-len 2048 --max-num-batched-tokens 16384 "
            "(8 x 2048 in one step; the H100-class default is 8192) --gpu-memory-utilization 0.5, torch.compile and "
            "CUDA graphs on (default); docs.vllm.ai models/pooling_models, configuration/optimization",
}


def workloads(ckpt: Path, quick: bool) -> dict:
    """Every server's texts, built once (seeded) so that all get the same."""
    tok, words, rng = TextTokenizer(ModelConfig.load(ckpt)), prose(), random.Random(0)
    n_docs, w1_len = (128, 256) if quick else (4096, 2048)
    docs = lognormal_docs(tok, words, n_docs, rng, cap=w1_len)
    w = {"w1": [[make_text(tok, words, w1_len, rng, within=True) for _ in range(8)] for _ in range(2 if quick else 16)],
         "query": [[make_text(tok, words, 16, rng, within=True)] for _ in range(64)],
         "c128": [make_text(tok, words, 20, rng, within=True) for _ in range(256)],
         "corpus": [docs[i:i + 32] for i in range(0, len(docs), 32)],
         "fidelity": mixed(tok, words, rng, cjk(None, rng))}
    w["corpus_tokens"] = sum(min(tok.untruncated_length(d), 2048) for d in docs)
    return w


def reference(ckpt: Path, texts: list[str]) -> np.ndarray:
    """sentence-transformers in fp32 (the GPU where there is one): what every server's vectors are compared to."""
    import torch
    from sentence_transformers import SentenceTransformer
    m = SentenceTransformer(str(ckpt), device="cuda" if torch.cuda.is_available() else "cpu")
    out = m.encode(texts, batch_size=8, convert_to_numpy=True, normalize_embeddings=True)
    del m
    torch.cuda.empty_cache()
    return out


def measure(t: Target, w: dict, ref: np.ndarray, quick: bool) -> dict:
    """The five workloads against one server, in the module docstring's order."""
    r = {"w1": one_at_a_time(t, w["w1"], warmup=3, max_n=20 if quick else 200, seconds=5 if quick else 20)}
    r["query"] = one_at_a_time(t, w["query"], warmup=10, max_n=50 if quick else 1000, seconds=5 if quick else 10)
    conc = 8 if quick else 128
    r["c128"] = {"concurrency": conc, **closed_loop(t, w["c128"], conc, procs=2 if quick else 8,
                                                    warmup=1 if quick else 2, seconds=2 if quick else 8)}
    secs, errors = all_of(t, w["corpus"], 16)
    n_docs = sum(map(len, w["corpus"]))
    r["corpus"] = {"docs_per_s": n_docs / secs, "tokens_per_s": w["corpus_tokens"] / secs, "seconds": secs,
                   "errors": errors}
    v = embed(t, w["fidelity"])
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    r["fidelity_min_cos"] = float(np.min(np.sum(v * ref, axis=1)))
    return r


def _wait(url: str, proc: subprocess.Popen, timeout: float, log: Path):
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
            raise RuntimeError(f"{url} not answering (exit {proc.poll()}, {timeout:.0f} s); {log}:\n{tail}")
        time.sleep(1)  # polling the server's port; the condition is checked above


@contextmanager
def process(cmd: list[str], ready_url: str, log: Path, timeout: float, env: dict | None = None):
    """A server process in its own session, ready when ready_url answers 200; SIGTERM to its whole group after
    (vLLM's engine runs in a child process), SIGKILL if it has not gone within 30 s."""
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                             start_new_session=True, cwd=ROOT)
    try:
        _wait(ready_url, p, timeout, log)
        yield p
    finally:
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(p.pid, sig)
                p.wait(wait)
                break
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue


@contextmanager
def ours(ckpt: Path, out: Path, a):
    http, grpc, metrics = free_port(), free_port(), free_port()
    cmd = [sys.executable, "-m", "egemma.ops.launcher", "--model", str(ckpt), "--http-port", str(http),
           "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--run-dir", str(out / "ours-run")]
    with process(cmd, f"http://127.0.0.1:{http}/v2/health/ready", out / "server_ours.log", 600):
        yield {"ours-http": Target("openai", f"http://127.0.0.1:{http}/v1/embeddings", NAME),
               "ours-grpc": Target("grpc", f"127.0.0.1:{grpc}", "embeddinggemma")}


@contextmanager
def st(ckpt: Path, out: Path, a):
    # sentence-transformers needs the host's numpy 2: its stub runs this Python (as in perf/bench_serve.py)
    with open(out / "server_st.log", "w") as log, \
            TritonServer(ckpt, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(), log_file=log,
                         repository=ROOT / "perf" / "baseline_repository", stub_bin=str(Path(sys.executable).parent),
                         ready_timeout=600) as s:
        yield {"st": Target("grpc", s.grpc_url, "st_bf16", "TEXT_UTF8")}


@contextmanager
def infinity(ckpt: Path, out: Path, a):
    import torch
    port, gpu = free_port(), torch.cuda.is_available()
    cmd = [a.peer_python, "-m", "infinity_emb.cli", "v2", "--model-id", str(ckpt), "--served-model-name", NAME,
           "--engine", "torch", "--device", "cuda" if gpu else "cpu", "--port", str(port), "--host", "127.0.0.1"]
    if gpu:
        cmd += ["--dtype", "bfloat16", "--batch-size", "128", "--compile", "true"]
    env = {"PYTHONPATH": str(a.peers_dir / "infinity"), "INFINITY_ANONYMOUS_USAGE_STATS": "0",
           "INFINITY_BETTERTRANSFORMER": "false", "HF_HUB_OFFLINE": "1"}
    with process(cmd, f"http://127.0.0.1:{port}/models", out / "server_infinity.log", 600, env):
        yield {"infinity": Target("openai", f"http://127.0.0.1:{port}/embeddings", NAME)}


@contextmanager
def vllm(ckpt: Path, out: Path, a):
    port = free_port()
    cmd = [a.peer_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(ckpt), "--served-model-name",
           NAME, "--runner", "pooling", "--dtype", "bfloat16", "--max-model-len", "2048",
           "--max-num-batched-tokens", "16384", "--gpu-memory-utilization", "0.5", "--host", "127.0.0.1",
           "--port", str(port)]
    env = {"PYTHONPATH": str(a.peers_dir / "vllm"), "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}
    with process(cmd, f"http://127.0.0.1:{port}/health", out / "server_vllm.log", 600, env):
        yield {"vllm": Target("openai", f"http://127.0.0.1:{port}/v1/embeddings", NAME)}


STARTERS = {"ours": ours, "st": st, "infinity": infinity, "vllm": vllm}
COLUMNS = (("w1 p50 / p99 ms", lambda r: f"{r['w1']['p50_ms']:.2f} / {r['w1']['p99_ms']:.2f}"),
           ("query p50 / p99 ms", lambda r: f"{r['query']['p50_ms']:.2f} / {r['query']['p99_ms']:.2f}"),
           ("c=128 req/s (p99 ms)", lambda r: f"{r['c128']['rps']:,.0f} ({r['c128']['p99_ms']:.1f})"),
           ("corpus docs/s (k tok/s)", lambda r: f"{r['corpus']['docs_per_s']:,.0f} "
                                                 f"({r['corpus']['tokens_per_s'] / 1e3:,.0f})"),
           ("min cos vs ST fp32", lambda r: f"{r['fidelity_min_cos']:.5f}"))


def table(results: dict) -> str:
    """One row per server (a failed one with its error), then ours-http's ratio to each peer: >1 means ours is
    better (their latency / ours, our throughput / theirs)."""
    rows = ["| server | " + " | ".join(c for c, _ in COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for name, r in results.items():
        cells = [f(r) if "error" not in r else "-" for _, f in COLUMNS]
        rows.append(f"| {name} | " + " | ".join(cells) + " |" + (f" {r['error'][:120]}" if "error" in r else ""))
    base = results.get("ours-http", {})
    if "error" not in base and base:
        for name, r in results.items():
            if name.startswith("ours") or "error" in r:
                continue
            ratio = [r["w1"]["p50_ms"] / base["w1"]["p50_ms"], r["query"]["p50_ms"] / base["query"]["p50_ms"],
                     base["c128"]["rps"] / r["c128"]["rps"], base["corpus"]["docs_per_s"] / r["corpus"]["docs_per_s"]]
            rows.append(f"| ours-http vs {name} | " + " | ".join(f"{x:.1f}x" for x in ratio) + " | |")
    return "\n".join(rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path, nargs="?")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--servers", default="ours,st,infinity,vllm", help=f"comma-separated, of {','.join(STARTERS)}")
    ap.add_argument("--peers-dir", type=Path, default=Path("/tmp/peers"), help="perf/peers_stage.sh's folders")
    ap.add_argument("--peer-python", default=sys.executable, help="the Python that runs Infinity and vLLM (default "
                                                                   "this one; their folders are built for 3.12)")
    ap.add_argument("--quick", action="store_true", help="small counts and windows: a CPU smoke run")
    ap.add_argument("--table", type=Path, nargs="+", metavar="RESULTS",
                    help="print one table from these runs' results.json files (or folders holding one)")
    a = ap.parse_args()
    if a.table:
        files = [p / "results.json" if p.is_dir() else p for p in a.table]
        merged = {k: v for f in files for k, v in json.loads(f.read_text())["servers"].items()}
        print(table(merged))
        return
    if not a.checkpoint or not a.out or not set(a.servers.split(",")) <= set(STARTERS):
        ap.error(f"CHECKPOINT and --out are needed, --servers of {','.join(STARTERS)}")
    a.checkpoint, a.out = a.checkpoint.resolve(), a.out.resolve()  # the servers run in the repository's root
    a.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    w = workloads(a.checkpoint, a.quick)
    ref = reference(a.checkpoint, w["fidelity"])
    print(f"workloads and the fp32 reference in {time.perf_counter() - t0:.0f} s; corpus "
          f"{sum(map(len, w['corpus']))} docs, {w['corpus_tokens']} tokens", flush=True)
    results = {}
    for server in a.servers.split(","):
        t0 = time.perf_counter()
        try:
            with STARTERS[server](a.checkpoint, a.out, a) as targets:
                print(f"{server}: ready in {time.perf_counter() - t0:.0f} s", flush=True)
                for name, t in targets.items():
                    results[name] = {"settings": SETTINGS[server], **measure(t, w, ref, a.quick)}
                    print(f"{name}: {json.dumps(results[name])}", flush=True)
        except Exception as e:  # a peer that does not start or answer: its row says why, the others still run
            results[server] = {"settings": SETTINGS[server], "error": f"{type(e).__name__}: {e}"}
            print(f"{server}: FAILED {str(e)[-2000:]}", flush=True)
        print(f"{server}: {time.perf_counter() - t0:.0f} s", flush=True)
    (a.out / "results.json").write_text(json.dumps({"servers": results, "quick": a.quick}, indent=2))
    print(table(results))


if __name__ == "__main__":
    sys.exit(main())
