"""Start the real `tritonserver` on this repository's model_repository for a given checkpoint.

  scripts/serve.sh [FLAG ...]   (or egemma-serve, python -m egemma.ops.launcher); --help lists the flags by group,
  docs/configuration.md has each with its default.

The model repository is rendered into a run directory with the checkpoint path written into the configs
(the source tree is never modified), the server is started with this Python environment first on PATH (the
Python backend stub follows PATH), readiness is awaited, and the endpoints are printed.

Safe defaults: loopback only unless --host; no model loading/unloading through the API (model control mode
none); the model-repository, shared-memory, trace and logging APIs answer only requests with the HTTP header
`admin-key: KEY` (gRPC: metadata `triton-grpc-protocol-admin-key: KEY`; KEY is printed at start); a watchdog
(egemma.ops.watchdog) restarts the server when a model stops answering, since Triton does not restart a crashed
Python backend stub and keeps reporting ready.

Stop (SIGTERM or SIGINT): readiness answers 503 at once and the gateway closes its connections to Triton's HTTP
(Front.drain; Triton 2.51 would wait for them until its exit timeout), Triton refuses new requests, finishes those
in flight (for up to --exit-timeout-secs) and exits, its stubs finalize, then the gateway stops; nothing of the
server is left (egemma.ops.shm). A second SIGTERM / SIGINT ends it all at once, cleaned up the same way; one
during boot stops the start. Exit code 0, or 1 after a second signal.

Cache (--cache-dir, egemma.ops.cachedir) and API key (--api-key, never printed): docs/operations.md.

HTTP: the user-facing HTTP port (and --openai-port, a second port of the same process) is the gateway
(egemma.gateway.app), which checks every request and proxies KServe v2 to Triton's own HTTP on a loopback-only
port: one request can crash Triton 2.51's HTTP. The gateway is restarted when it dies and stopped after Triton
drained. gRPC and metrics are Triton's own (its gRPC takes any size up to 2 GiB, so large batches go there); the
gateway's GET /metrics serves Triton's and its own (egemma.gateway.metrics). --otlp-endpoint: traces
(egemma.gateway.tracing, docs/observability.md)."""

import argparse
import os
import secrets
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from egemma.engine.config import ModelConfig
from egemma.engine.process import cache_dir, usable_cores
from egemma.ops import cachedir
from egemma.ops.host import (CORES_PER_TOKENIZER, CPU_INSTANCES, ENCODERS_PER_GPU, TOKENIZERS_PER_GPU, parse_gpus,
                             visible_gpus)
from egemma.ops.procfs import Cancelled, connections_to
from egemma.ops.repository import ROOT, path_env, resolve_checkpoint
from egemma.ops.front import Front
from egemma.ops.tritonserver import (ADMIN_APIS, ADMIN_HEADER, API_HEADER, HEARTBEATS, ServerConfig, TritonServer,
                                     free_port, gpu_host)
from egemma.ops.watchdog import MAX_BUSY, TOKENS_PER_MAX_BUSY, Watchdog
from egemma.gateway import tracing
from egemma.spec import EMBEDDING, ENCODER, ENSEMBLE, HUB_ID, TEXT, TOKENIZER
from egemma.stub import budget
from egemma.gateway.app import DEFAULT_MAX_BODY, read_key


def prog() -> str:
    """The command the user typed: scripts/serve.sh sets EGEMMA_PROG; the console script is egemma-serve."""
    name = os.environ.get("EGEMMA_PROG") or Path(sys.argv[0]).name
    return "python -m egemma.ops.launcher" if name in ("launcher.py", "__main__.py", "-c") else name


def parser() -> argparse.ArgumentParser:
    """Every flag of the launcher, in groups; docs/configuration.md's table lists each (tests/test_docs.py)."""
    ap = argparse.ArgumentParser(
        prog=prog(), formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Serve google/embeddinggemma-300m on Triton: KServe v2 (HTTP, gRPC), OpenAI and TEI routes.\n"
                    "Without --model: $EMBEDDINGGEMMA_PATH, else the Hugging Face cache/hub, else a demo checkpoint "
                    "with random weights.",
        epilog="Every flag, its default and the environment variables: docs/configuration.md. Operations (stop, cache, "
               "watchdog, API key): docs/operations.md.")
    g = ap.add_argument_group("model")
    g.add_argument("--model", metavar="DIR|HUB_ID", help="checkpoint directory or hub id such as google/embeddinggemma-300m (gated: set "
                                   "HF_TOKEN) (default: $EMBEDDINGGEMMA_PATH, then the HF cache/hub, then the demo)")
    g.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="model parameter, e.g. attention_backend=fa2 (repeatable; docs/configuration.md)")
    g.add_argument("--instances", action="append", default=[], metavar="MODEL=N",
                   help="instance count of a model, e.g. embeddinggemma_encoder=2, per GPU for the encoder "
                        f"(repeatable; default: encoder {ENCODERS_PER_GPU} per GPU and tokenizer one per "
                        f"{CORES_PER_TOKENIZER} cores, at most {TOKENIZERS_PER_GPU} per GPU, on a GPU host; encoder "
                        f"{CPU_INSTANCES[ENCODER]} / tokenizer "
                        f"{CPU_INSTANCES[TOKENIZER]} without a GPU)")
    g.add_argument("--gpus", default="all", metavar="all|IDS", help="GPUs to place encoder instances on: 'all' visible ones (default; "
                                                 "none on a CPU host) or device ids such as 0,1")
    g.add_argument("--response-cache-mb", type=int, default=0, metavar="MB",
                   help="Triton's response cache for the encoder, that many MiB (default 0: off; docs/api.md)")
    g.add_argument("--max-request-tokens", type=int, default=budget.DEFAULT, metavar="N",
                   help=f"tokens one request may have embedded, all its inputs together; over it a request is "
                        f"refused at once (default {budget.DEFAULT}; docs/limits.md)")
    g.add_argument("--cache-dir", type=Path, default=cache_dir(), metavar="DIR",
                   help="what a later start reuses: Triton-lang's kernels, the tuning file, the fused weights "
                        "(default: $EGEMMA_CACHE_DIR, else ~/.cache/egemma); unwritable: served without caching")
    g = ap.add_argument_group("network")
    g.add_argument("--host", default=ServerConfig.host, metavar="ADDR",
                   help=f"bind address (default {ServerConfig.host}: loopback only)")
    g.add_argument("--http-port", type=int, default=ServerConfig.http_port, metavar="N",
                   help=f"the HTTP gateway: KServe v2, OpenAI, TEI (default {ServerConfig.http_port})")
    g.add_argument("--grpc-port", type=int, default=ServerConfig.grpc_port, metavar="N",
                   help=f"Triton's gRPC (default {ServerConfig.grpc_port})")
    g.add_argument("--metrics-port", type=int, default=ServerConfig.metrics_port, metavar="N",
                   help=f"Triton's Prometheus metrics (default {ServerConfig.metrics_port})")
    g.add_argument("--openai-port", type=int, metavar="N", help="a second port of the gateway (OpenAI, TEI and KServe routes)")
    g.add_argument("--triton-http-port", type=int, default=0, metavar="N",
                   help="Triton's own HTTP port, on 127.0.0.1 behind the gateway (default: a free one)")
    g = ap.add_argument_group("gateway (HTTP)")
    g.add_argument("--served-model-name", default=HUB_ID, metavar="NAME",
                   help="the model name the OpenAI and TEI routes answer to and report")
    g.add_argument("--alias", action="append", default=[], metavar="NAME",
                   help="another model name the OpenAI route accepts (repeatable)")
    g.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_BODY, metavar="BYTES",
                   help=f"largest HTTP request body (default {DEFAULT_MAX_BODY}: Triton 2.51's HTTP crashes at "
                        "4 MiB); larger batches go over gRPC")
    g.add_argument("--gateway-workers", type=int, default=max(1, min(4, usable_cores() // 4)), metavar="K",
                   help="gateway processes (default: a quarter of the usable cores, a pod's CPU quota included; "
                        "1 to 4)")
    g = ap.add_argument_group("security")
    g.add_argument("--admin-key", default=os.environ.get("EGEMMA_ADMIN_KEY"), metavar="KEY",
                   help=f"value of the '{ADMIN_HEADER}' header that the {ADMIN_APIS} APIs require "
                        "(default: $EGEMMA_ADMIN_KEY, else random, printed at start)")
    key_arg = g.add_mutually_exclusive_group()
    key_arg.add_argument("--api-key", metavar="KEY", help="the key inference requires on every port (default: none, open)")
    key_arg.add_argument("--api-key-file", type=Path, metavar="PATH", help="a file holding it (e.g. a mounted k8s Secret)")
    g = ap.add_argument_group("lifecycle")
    g.add_argument("--run-dir", type=Path, default=ROOT / ".run", metavar="DIR",
                   help="where the rendered repository, the server's state and the watchdog's verdict go "
                        "(default: .run in the repository)")
    g.add_argument("--exit-timeout-secs", type=int, default=ServerConfig.exit_timeout_secs, metavar="SECONDS",
                   help=f"on SIGTERM, how long in-flight requests may take to finish "
                        f"(default {ServerConfig.exit_timeout_secs})")
    g.add_argument("--watchdog", action=argparse.BooleanOptionalAction, default=True,
                   help="restart the server when a canary inference fails or a model process dies (default on)")
    g.add_argument("--watchdog-max-busy", type=float, default=MAX_BUSY, metavar="SECONDS",
                   help="restart when one model instance is busy in one execute for this long (scaled up for "
                        f"batches over {TOKENS_PER_MAX_BUSY} tokens), or canaries time out while the server is busy "
                        f"and no request completes for this long: a model is spinning (default {MAX_BUSY:g})")
    tracing.add_flags(ap.add_argument_group("observability"), triton=True)
    return ap


def main(argv=None):
    a = parse(argv)
    run = start(a)
    report(run)
    # everything is stopped and cleaned up: no interpreter teardown (with torch imported for the tokenizer's
    # resolution it took seconds, which a stop should not)
    os._exit(stop(run))


@dataclass
class Running:
    """What start() brought up, for report() and stop()."""
    a: argparse.Namespace
    checkpoint: Path
    demo: bool
    admin_key: str
    api_key: str | None
    internal: int  # Triton's own HTTP port, behind the gateway
    host: str  # the address clients reach the ports on (loopback for a wildcard bind)
    front: Front
    supervisor: object  # the Watchdog, or the TritonServer itself with --no-watchdog
    stopping: threading.Event  # a first SIGTERM / SIGINT
    hurry: threading.Event  # a second one


def parse(argv=None) -> argparse.Namespace:
    """The flags, with --gpus, --param and --instances parsed (an error names the flag and exits 2)."""
    ap = parser()
    a = ap.parse_args(argv)
    try:
        a.gpus = parse_gpus(a.gpus, visible_gpus())
    except ValueError as e:
        ap.error(str(e))
    if a.otlp_triton_spans and not a.otlp_endpoint:
        ap.error("--otlp-triton-spans needs --otlp-endpoint (the collector Triton's spans go to)")
    a.param = {budget.PARAMETER: str(a.max_request_tokens), **dict(p.split("=", 1) for p in a.param)}
    a.instances = {m: int(n) for m, n in (p.split("=", 1) for p in a.instances)}
    return a


def start(a: argparse.Namespace) -> Running:
    """The gateway and Triton (under the watchdog unless --no-watchdog), ready; a signal during boot stops it all
    and exits 0."""
    # The handler only flags (set before anything starts, so an early signal is not lost): a first SIGTERM /
    # SIGINT stops (cancelling a boot), a second hurries the stop; the main thread does the waiting.
    stopping, hurry = threading.Event(), threading.Event()

    def on_signal(*_):
        (hurry if stopping.is_set() else stopping).set()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    ckpt = resolve_checkpoint(a.model)
    demo = ModelConfig.load(ckpt).demo
    if demo:
        print(f"DEMO: {ckpt} is a generated checkpoint with random weights: the answers have the real shapes, the "
              "embeddings mean nothing", file=sys.stderr, flush=True)
    if not gpu_host():  # Triton gets CPU_ARGS (egemma.ops.tritonserver): no CUDA, NVML or DCGM probes
        print("no GPU: serving on CPU", flush=True)
    key = a.admin_key or secrets.token_urlsafe(16)
    api_key_file = _api_key_file(a)
    api_key = read_key(api_key_file).decode() if api_key_file else None
    # one port for every restart (the gateway's upstream), none of those asked for
    internal = a.triton_http_port or free_port(avoid={a.http_port, a.grpc_port, a.metrics_port, a.openai_port})

    config = ServerConfig(ckpt, a.host, internal, a.grpc_port, a.metrics_port, a.run_dir, a.param,
                          tuple(tracing.triton_args(a.otlp_endpoint if a.otlp_triton_spans else None)), admin_key=key,
                          exit_timeout_secs=a.exit_timeout_secs, instances=a.instances, gpus=a.gpus,
                          http_host="127.0.0.1", api_key=api_key, response_cache_mb=a.response_cache_mb)

    def server():
        return TritonServer(config, cancel=stopping)

    a.run_dir.mkdir(parents=True, exist_ok=True)
    cachedir.prepare(a.cache_dir, a.run_dir, log=lambda m: print(m, file=sys.stderr, flush=True))
    health_file = a.run_dir / "health.json"  # the watchdog's verdict (egemma.gateway.common) for the gateway
    h = "127.0.0.1" if a.host in ("0.0.0.0", "::") else a.host
    ports = [a.http_port] + ([a.openai_port] if a.openai_port else [])
    front = Front([*(f"--port={p}" for p in ports), f"--host={a.host}", f"--triton-http=127.0.0.1:{internal}",
                   f"--triton-grpc={h}:{a.grpc_port}", f"--triton-metrics={h}:{a.metrics_port}",
                   f"--stats-dir={a.run_dir / HEARTBEATS}",
                   *([f"--otlp-endpoint={a.otlp_endpoint}", f"--otlp-sample-ratio={a.otlp_sample_ratio}"]
                     if a.otlp_endpoint else []),
                   f"--max-request-bytes={a.max_request_bytes}", f"--workers={a.gateway_workers}",
                   f"--model-name={a.served_model_name}", *(f"--alias={n}" for n in a.alias),
                   *([f"--health-file={health_file}"] if a.watchdog else []),
                   *([f"--api-key-file={api_key_file}"] if api_key_file else [])], f"http://{h}:{a.http_port}",
                  env=path_env(ckpt, a.run_dir))
    print(f"starting tritonserver for {ckpt} (cache {a.cache_dir}) ...", flush=True)
    front.launch()  # its start (imports, workers) overlaps Triton's boot; it answers 503 until Triton is ready
    supervisor = None
    try:
        if a.watchdog:
            supervisor = Watchdog(server, max_busy=a.watchdog_max_busy, health_file=health_file).start()
        else:
            supervisor = server()
        front.wait(cancel=stopping)
    except (RuntimeError, TimeoutError, Cancelled) as e:
        front.kill()
        if supervisor is not None:
            supervisor.stop(hurry=hurry)
        if isinstance(e, Cancelled):
            print("stopped during boot", flush=True)
            sys.exit(0)
        raise
    cachedir.seal(a.cache_dir)
    return Running(a, ckpt, demo, key, api_key, internal, h, front, supervisor, stopping, hurry)


def report(r: Running):
    """The ready banner: endpoints, keys, what is on, and two requests to copy."""
    a, h, key = r.a, r.host, r.admin_key
    demo_banner = "\n  DEMO    random weights: the embeddings mean nothing (docs/operations.md)" if r.demo else ""
    traces = (f"\n  traces  to {a.otlp_endpoint} (sampled {a.otlp_sample_ratio:g}"
              f"{', with Triton spans' if a.otlp_triton_spans else ''})" if a.otlp_endpoint else "")
    print(f"""
ready: model '{ENSEMBLE}' (checkpoint {r.checkpoint}){demo_banner}
  HTTP    http://{h}:{a.http_port}  (gateway: KServe v2, OpenAI, TEI; bodies up to {a.max_request_bytes} bytes)
  gRPC    {h}:{a.grpc_port}
  metrics http://{h}:{a.http_port}/metrics  (Triton's, port {a.metrics_port}, and the gateway's){traces}
  admin   the {ADMIN_APIS} APIs need HTTP header '{ADMIN_HEADER}: {key}'
          (gRPC metadata 'triton-grpc-protocol-{ADMIN_HEADER}: {key}')
  api key {f"required for inference (HTTP 'Authorization: Bearer KEY', KServe also '{API_HEADER}: KEY'; gRPC "
           f"metadata 'triton-grpc-protocol-{API_HEADER}: KEY')" if r.api_key else 'none: inference is open to anyone'}
  watchdog {'on' if a.watchdog else 'off'}; SIGTERM drains in-flight requests for up to {a.exit_timeout_secs}s
  cache   {a.cache_dir}
  openai  {f'http://{h}:{a.openai_port}/v1/embeddings' if a.openai_port else f'http://{h}:{a.http_port}/v1/embeddings'}

  curl -s http://{h}:{a.http_port}/v2/models/{ENSEMBLE}/infer -d \\
    '{{"inputs":[{{"name":"{TEXT}","shape":[1,1],"datatype":"BYTES","data":["hello world"]}}]}}'

  python -c "import numpy as np, tritonclient.grpc as g; c = g.InferenceServerClient('{h}:{a.grpc_port}'); \\
i = g.InferInput('{TEXT}', [1, 1], 'BYTES'); i.set_data_from_numpy(np.array([[b'hello world']], dtype=object)); \\
print(c.infer('{ENSEMBLE}', [i]).as_numpy('{EMBEDDING}'))"
""", flush=True)


def stop(r: Running) -> int:
    """Serve until a SIGTERM / SIGINT (or, unsupervised, the server's death), then stop in order: readiness 503 and
    the gateway's connections to Triton closed, Triton drained, the gateway stopped, the cache sealed. The exit
    code: the dead server's, else 1 after a second signal, else 0."""
    a, rc = r.a, 0
    while not r.stopping.wait(0.5):
        r.front.check()
        if not a.watchdog and r.supervisor.proc.poll() is not None:  # unsupervised, a dead server ends it all
            rc = r.supervisor.proc.returncode
            break
    t0 = time.monotonic()
    print("stopping: readiness 503, draining the requests in flight ...", flush=True)
    r.front.drain()
    # Triton polls its open HTTP connections once a second while stopping: give the gateway's idle ones the moment
    # they take to close (busy ones close after their answer, which Triton waits for anyway)
    deadline = time.monotonic() + 0.5
    while connections_to(r.internal) and time.monotonic() < deadline and not r.hurry.wait(0.02):
        pass
    r.supervisor.stop(hurry=r.hurry)
    r.front.stop(hurry=r.hurry)
    if not r.hurry.is_set():
        cachedir.seal(a.cache_dir)
    print(f"stopped in {time.monotonic() - t0:.1f}s{' (at once: second signal)' if r.hurry.is_set() else ''}",
          flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    return rc or int(r.hurry.is_set())


def _api_key_file(a) -> Path | None:
    """Where the gateway reads the API key: --api-key-file as given, or --api-key written to a file only this user
    reads (a key on the gateway's command line would show in `ps`)."""
    if a.api_key is None:
        return a.api_key_file
    a.run_dir.mkdir(parents=True, exist_ok=True)
    path = a.run_dir / "api-key"
    path.unlink(missing_ok=True)  # created anew: its mode is ours
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(a.api_key)
    return path


if __name__ == "__main__":
    main()
