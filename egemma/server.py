"""Start the real `tritonserver` on this repository's model_repository for a given checkpoint.

  python -m egemma.server [--model DIR] [--host 127.0.0.1] [--http-port 8000] [--grpc-port 8001]
                          [--metrics-port 8002] [--admin-key KEY] [--exit-timeout-secs 30] [--no-watchdog]
                          [--watchdog-max-busy 120]
                          [--openai-port 8080] [--param KEY=VALUE ...] [--instances MODEL=N ...]

The model repository is rendered into a run directory with the checkpoint path written into the configs
(the source tree is never modified), the server is started with this Python environment first on PATH (the
Python backend stub follows PATH), readiness is awaited, and the endpoints are printed.

Safe defaults: loopback only unless --host; no model loading/unloading through the API (model control mode
none); the model-repository, shared-memory, trace and logging APIs answer only requests with the HTTP header
`admin-key: KEY` (gRPC: metadata `triton-grpc-protocol-admin-key: KEY`; KEY is printed at start); SIGTERM
drains in-flight requests for up to --exit-timeout-secs; a watchdog (egemma.watchdog) restarts the server when
a model stops answering, since Triton does not restart a crashed Python backend stub and keeps reporting
ready."""
from __future__ import annotations

import argparse
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from egemma.tokenizer import resolved_tokenizer_json

ROOT = Path(__file__).resolve().parent.parent
REPO = ROOT / "model_repository"
DEMO = ROOT / ".cache" / "demo-checkpoint"
# Admin-only APIs: with them a client could read the repository layout, map shared memory, or redirect traces
# and logs to files. Inference, health, metadata, config and statistics stay open.
ADMIN_APIS = "model-repository,shared-memory,trace,logging"
ADMIN_HEADER = "admin-key"
# Instance counts without a GPU (TritonServer): each encoder instance is a CPU forward of its own.
CPU_INSTANCES = {"embeddinggemma_encoder": 1, "embeddinggemma_tokenizer": 2}


def gpu_host() -> bool:
    """Whether this machine has an NVIDIA GPU (without importing torch)."""
    return os.path.exists("/dev/nvidiactl")


def find_tritonserver() -> tuple[Path, Path]:
    """(tritonserver binary, backend directory): $TRITON_SERVER_DIR, a `tritonserver` on PATH, or the one in
    the nvidia-pytriton wheel (with the Python backend stub for this interpreter copied in place)."""
    if os.environ.get("TRITON_SERVER_DIR"):
        d = Path(os.environ["TRITON_SERVER_DIR"])
        return d / "bin" / "tritonserver", d / "backends"
    on_path = shutil.which("tritonserver")
    if on_path:
        d = Path(on_path).resolve().parent.parent
        return Path(on_path), d / "backends"
    try:
        import pytriton
    except ImportError:
        raise SystemExit("no tritonserver: none on PATH and nvidia-pytriton is not installed (run scripts/setup.sh)")
    d = Path(pytriton.__file__).parent / "tritonserver"
    stub = d / "backends" / "python" / "triton_python_backend_stub"
    src = d / "python_backend_stubs" / f"{sys.version_info.major}.{sys.version_info.minor}" / stub.name
    if not stub.exists():
        if not src.exists():
            raise SystemExit(f"nvidia-pytriton has no Python backend stub for Python {sys.version_info[:2]}")
        shutil.copy2(src, stub)
    return d / "bin" / "tritonserver", d / "backends"


def resolve_checkpoint(model: str | None) -> Path:
    """--model, else $EMBEDDINGGEMMA_PATH, else google/embeddinggemma-300m from the HF cache/hub, else (loudly)
    a generated demo checkpoint with random weights so the server always comes up."""
    for cand in (model, os.environ.get("EMBEDDINGGEMMA_PATH")):
        if cand:
            if not Path(cand).expanduser().is_dir():
                raise SystemExit(f"checkpoint directory {cand} does not exist")
            return Path(cand).expanduser().resolve()
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download("google/embeddinggemma-300m"))
    except Exception as e:  # offline, gated, not logged in: all end in the demo checkpoint
        why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    print(f"\n*** WARNING: google/embeddinggemma-300m is not available ({why}).\n"
          f"*** Serving a DEMO checkpoint with RANDOM weights from {DEMO}; its embeddings mean nothing.\n"
          "*** Pass --model DIR or set EMBEDDINGGEMMA_PATH for real embeddings.\n", file=sys.stderr)
    if not (DEMO / "model.safetensors").exists():
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_checkpoint.py"), str(DEMO)], check=True,
                       stdout=subprocess.DEVNULL)
    return DEMO


def render_repository(dest: Path, checkpoint: Path, params: dict[str, str] | None = None, src: Path = REPO,
                      optional=(), instances: dict[str, int] | None = None) -> Path:
    """Copy a model repository to dest with the checkpoint, and any other parameters, written into every model
    config that declares them, and with `instances` ({model: count}) replacing those models' instance counts.
    A parameter no config declares, or a model not in the repository, is an error (parameters in optional
    excepted)."""
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("__pycache__"))
    params = {"checkpoint": str(checkpoint), **(params or {})}
    for model, count in (instances or {}).items():
        cfg = dest / model / "config.pbtxt"
        if not cfg.exists() or count < 1:
            raise ValueError(f"cannot give model {model!r} {count} instances (models: "
                             f"{sorted(c.parent.name for c in dest.glob('*/config.pbtxt'))})")
        text, n = re.subn(r"(instance_group \[ \{ count: )\d+", rf"\g<1>{count}", cfg.read_text())
        if n != 1:
            raise ValueError(f"{cfg}: no single 'instance_group [ {{ count: N' to set")
        cfg.write_text(text)
    used = set()
    for cfg in sorted(dest.glob("*/config.pbtxt")):
        text = cfg.read_text()
        for key, value in params.items():
            pat = re.compile(r'(parameters \{ key: "%s" value: \{ string_value: )"[^"]*"' % re.escape(key))
            if pat.search(text):
                text = pat.sub(lambda m: m.group(1) + '"%s"' % value, text)
                used.add(key)
        cfg.write_text(text)
    if set(params) - used - set(optional):
        raise ValueError(f"no model in {src} takes parameters {sorted(set(params) - used - set(optional))}")
    return dest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TritonServer:
    """A running tritonserver; `with TritonServer(...) as s:` waits until it is ready and stops it after."""

    def __init__(self, checkpoint: Path, host="127.0.0.1", http_port=8000, grpc_port=8001, metrics_port=8002,
                 run_dir: Path | None = None, params: dict[str, str] | None = None, log_file=None,
                 extra_args=(), ready_timeout=600.0, repository: Path = REPO, admin_key: str | None = None,
                 exit_timeout_secs: int = 30, instances: dict[str, int] | None = None, stub_bin: str | None = None):
        """instances: {model: count} over the repository's counts (without a GPU, over CPU_INSTANCES first: the
        repository's are for a GPU host, and on CPU each encoder instance is a forward competing for the cores).
        stub_bin: the bin directory of the Python environment the stubs run (default $TRITON_STUB_PATH, else
        this interpreter's)."""
        self.host, self.http_port, self.grpc_port, self.metrics_port = host, http_port, grpc_port, metrics_port
        # No key given: a random one, so the admin APIs are never open by accident.
        self.admin_key = admin_key or secrets.token_urlsafe(16)
        self.exit_timeout_secs = exit_timeout_secs
        self.run_dir = Path(run_dir or tempfile.mkdtemp(prefix="egemma-run-"))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        tokenizer_json = self.run_dir / "tokenizer.json"
        tokenizer_json.write_text(resolved_tokenizer_json(checkpoint))
        params = {"tokenizer_json": str(tokenizer_json), **(params or {})}
        if not gpu_host() and repository == REPO:
            instances = {**CPU_INSTANCES, **(instances or {})}
        self.repo = render_repository(self.run_dir / "model_repository", checkpoint, params, repository,
                                      optional=("tokenizer_json",), instances=instances)
        binary, backends = find_tritonserver()
        self.cmd = [str(binary), f"--model-repository={self.repo}", f"--backend-directory={backends}",
                    "--model-control-mode=none", "--exit-on-error=true", "--strict-readiness=true",
                    f"--http-address={host}", f"--http-port={http_port}", f"--grpc-address={host}",
                    f"--grpc-port={grpc_port}", f"--metrics-address={host}", f"--metrics-port={metrics_port}",
                    f"--http-restricted-api={ADMIN_APIS}:{ADMIN_HEADER}={self.admin_key}",
                    f"--grpc-restricted-protocol={ADMIN_APIS}:{ADMIN_HEADER}={self.admin_key}",
                    f"--exit-timeout-secs={exit_timeout_secs}", *extra_args]
        env = dict(os.environ)
        # The stub runs the Python whose bin is first on PATH: this one, or $TRITON_STUB_PATH (a numpy<2 venv).
        stub_bin = stub_bin or os.environ.get("TRITON_STUB_PATH") or str(Path(sys.executable).parent)
        env["PATH"] = f"{stub_bin}{os.pathsep}{env.get('PATH', '')}"
        # The stub links libpython dynamically; let it find this interpreter's own (its lib-dynload modules
        # need the matching patch release, not whatever the system ships).
        libdir = sysconfig.get_config_var("LIBDIR")
        if libdir and list(Path(libdir).glob("libpython3*.so*")):
            env["LD_LIBRARY_PATH"] = f"{libdir}{os.pathsep}{env.get('LD_LIBRARY_PATH', '')}".rstrip(os.pathsep)
        self.log_file = log_file
        self.proc = subprocess.Popen(self.cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.wait_ready(ready_timeout)

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def wait_ready(self, timeout: float):
        deadline = time.monotonic() + timeout
        while not self.ready():
            if self.proc.poll() is not None:
                raise RuntimeError(f"tritonserver exited with {self.proc.returncode} before becoming ready; "
                                   f"command: {' '.join(self.cmd)}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"tritonserver not ready after {timeout:.0f}s")
            time.sleep(0.2)  # readiness polling; the condition itself is checked above

    def stop(self, timeout: float | None = None):
        """SIGTERM (Triton stops taking requests and finishes those in flight for up to exit_timeout_secs), then
        SIGKILL for the whole process group if it is still running after timeout (default: that plus 30 s)."""
        timeout = self.exit_timeout_secs + 30 if timeout is None else timeout
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint directory (default: $EMBEDDINGGEMMA_PATH, then the HF hub)")
    ap.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    ap.add_argument("--http-port", type=int, default=8000)
    ap.add_argument("--grpc-port", type=int, default=8001)
    ap.add_argument("--metrics-port", type=int, default=8002)
    ap.add_argument("--run-dir", type=Path, default=ROOT / ".run", help="where the rendered repository goes")
    ap.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                    help="model parameter, e.g. attention_backend=fa2 (repeatable)")
    ap.add_argument("--instances", action="append", default=[], metavar="MODEL=N",
                    help="instance count of a model, e.g. embeddinggemma_encoder=2 (repeatable; default: "
                         "model_repository's configs on a GPU host, encoder 1 / tokenizer 2 without a GPU)")
    ap.add_argument("--admin-key", default=os.environ.get("EGEMMA_ADMIN_KEY"),
                    help=f"value of the '{ADMIN_HEADER}' header that the {ADMIN_APIS} APIs require "
                         "(default: $EGEMMA_ADMIN_KEY, else random, printed at start)")
    ap.add_argument("--exit-timeout-secs", type=int, default=30,
                    help="on SIGTERM, how long in-flight requests may take to finish (default 30)")
    ap.add_argument("--openai-port", type=int, help="also serve an OpenAI-compatible POST /v1/embeddings here")
    ap.add_argument("--watchdog", action=argparse.BooleanOptionalAction, default=True,
                    help="restart the server when a canary inference fails or a model process dies (default on)")
    ap.add_argument("--watchdog-max-busy", type=float, default=120.0, metavar="SECONDS",
                    help="restart when canaries time out while the server is busy and no request completes for "
                         "this long: a model is spinning (default 120)")
    a = ap.parse_args(argv)
    ckpt = resolve_checkpoint(a.model)
    params = dict(p.split("=", 1) for p in a.param)
    instances = {m: int(n) for m, n in (p.split("=", 1) for p in a.instances)}
    key = a.admin_key or secrets.token_urlsafe(16)

    def start():
        return TritonServer(ckpt, a.host, a.http_port, a.grpc_port, a.metrics_port, a.run_dir, params,
                            admin_key=key, exit_timeout_secs=a.exit_timeout_secs, instances=instances)

    # The handler only flags (set before starting, so an early SIGTERM is not lost); the main loop stops the
    # server, which waits for in-flight requests, something a signal handler should not do.
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    print(f"starting tritonserver for {ckpt} ...", flush=True)
    if a.watchdog:
        from egemma.watchdog import Watchdog
        supervisor = Watchdog(start, max_busy=a.watchdog_max_busy).start()
    else:
        supervisor = start()
    h = "127.0.0.1" if a.host in ("0.0.0.0", "::") else a.host
    gateway = None
    if a.openai_port:
        from egemma.openai_gateway import make_server
        gateway = make_server(a.host, a.openai_port, f"{h}:{a.grpc_port}", ckpt, str(a.run_dir / "tokenizer.json"))
        threading.Thread(target=gateway.serve_forever, daemon=True).start()
    print(f"""
ready: model 'embeddinggemma' (checkpoint {ckpt})
  HTTP    http://{h}:{a.http_port}
  gRPC    {h}:{a.grpc_port}
  metrics http://{h}:{a.metrics_port}/metrics
  admin   the {ADMIN_APIS} APIs need HTTP header '{ADMIN_HEADER}: {key}'
          (gRPC metadata 'triton-grpc-protocol-{ADMIN_HEADER}: {key}')
  watchdog {'on' if a.watchdog else 'off'}; SIGTERM drains in-flight requests for up to {a.exit_timeout_secs}s
  openai  {f'http://{h}:{a.openai_port}/v1/embeddings' if gateway else 'off (--openai-port N)'}

  curl -s http://{h}:{a.http_port}/v2/models/embeddinggemma/infer -d \\
    '{{"inputs":[{{"name":"TEXT","shape":[1,1],"datatype":"BYTES","data":["hello world"]}}]}}'

  python -c "import numpy as np, tritonclient.grpc as g; c = g.InferenceServerClient('{h}:{a.grpc_port}'); \\
i = g.InferInput('TEXT', [1, 1], 'BYTES'); i.set_data_from_numpy(np.array([[b'hello world']], dtype=object)); \\
print(c.infer('embeddinggemma', [i]).as_numpy('EMBEDDING'))"
""", flush=True)
    rc = 0
    try:
        while not done.wait(0.5):
            if not a.watchdog and supervisor.proc.poll() is not None:  # unsupervised, a dead server ends it all
                rc = supervisor.proc.returncode
                break
    except KeyboardInterrupt:
        pass
    if gateway:
        gateway.shutdown()
    supervisor.stop()
    sys.exit(rc)


if __name__ == "__main__":
    main()
