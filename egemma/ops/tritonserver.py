"""The real `tritonserver` process: finding the binary (PATH, $TRITON_SERVER_DIR or the nvidia-pytriton wheel),
starting it on a rendered repository with the stub's Python environment first on PATH, readiness, a graceful stop,
and nothing of it left behind (no process of its group, no shared-memory region: egemma.ops.shm)."""
from __future__ import annotations

import functools
import os
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
from dataclasses import dataclass, field
from pathlib import Path

from egemma.engine.process import configured, usable_cores
from egemma.engine.tokenizer import cached_tokenizer_json, resolve_ahead
from egemma.ops.host import default_instances
from egemma.gateway.aioserver import exit_with_parent
from egemma.ops import shm
from egemma.ops.procfs import end_group, wait_exit, wait_up
from egemma.ops.repository import REPO, path_env, render_repository
from egemma.stub.instance import HEARTBEAT_DIR

# Admin-only APIs: with them a client could read the repository layout, map shared memory, or redirect traces
# and logs to files. Inference, health, metadata, config and statistics stay open.
ADMIN_APIS = "model-repository,shared-memory,trace,logging"
ADMIN_HEADER = "admin-key"
# With an API key, Triton's `inference` category (infer, generate, streams) needs it too: HTTP header `api-key`,
# gRPC metadata `triton-grpc-protocol-api-key` (Triton prefixes the name). Triton 2.51 refuses HTTP with a 403 and
# gRPC with UNAVAILABLE ("This protocol is restricted, expecting header ..."); health and metadata stay open.
API_HEADER = "api-key"
# Triton's stop logs this once every request has been answered and it starts to unload the models. The unload
# is the slow part, and no request needs it: Triton 2.51's Python backend finalizes a model's instances one after
# the other, each after a fixed 1 s wait for the stub's health flag, and Triton polls its models once a second: on
# CPU an idle server with 3 tokenizer instances took 4.9 s to exit (2.9 s with 1), so 2 s is out of reach that way.
# stop() ends the server's group there instead (no stub has anything to finalize; kill() removes what they leave).
DRAINED = b"All models are stopped, unloading models"
# Without a GPU: no pinned-memory or CUDA pool, no GPU metrics, so Triton probes neither CUDA, NVML nor DCGM. What no
# flag stops, Triton 2.51's CUDA block manager and an ensemble's CUDA stream failing, is dropped from the log there.
CPU_ARGS = ("--pinned-memory-pool-byte-size=0", "--cuda-memory-pool-byte-size=0:0", "--allow-gpu-metrics=false")
CPU_NOISE = (b'"CudaDriverHelper has not been initialized."', b'"unable to create stream for ')
# Triton's OpenTelemetry exporter logs two lines per batch of spans it fails to send (--otlp-endpoint unreachable):
# the first one is passed on, the rest dropped; spans are lost, requests are not.
OTLP_ERROR = b"[OTLP HTTP Client]"
HEARTBEATS = "heartbeat"  # the run directory's folder of the instances' heartbeats and stats (egemma.stub)


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


_GIVEN: set[int] = set()


def free_port(avoid=()) -> int:
    """A port free now, not in avoid and not given out before by this process: bind(0) can return the same port
    twice while neither caller has bound it yet."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _GIVEN and port not in avoid:
            _GIVEN.add(port)
            return port


@dataclass
class ServerConfig:
    """What a tritonserver is started with; each default is defined here (the launcher's flags read them).
    instances: {model: count} over default_instances (egemma.ops.host) for this repository, else over the
    repository's own counts. gpus: device ids to place the encoder's instances on (KIND_GPU, its count per GPU);
    empty: KIND_MODEL as in the repository (cuda:0, or the CPU). stub_bin: the bin directory of the Python
    environment the stubs run (default $TRITON_STUB_PATH, else this interpreter's). http_host: the address of
    Triton's own HTTP (default host; the launcher keeps it on loopback behind egemma.gateway.app, since one request
    can crash it). admin_key: ADMIN_HEADER's value (None: a random one, so the admin APIs are never open by
    accident). api_key: what inference requires (API_HEADER), on both of Triton's ports; None: open.
    response_cache_mb: Triton's response cache of that many MiB for the encoder
    (egemma.ops.repository.render_repository). run_dir: None: a new temporary directory."""
    checkpoint: Path
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    run_dir: Path | None = None
    params: dict[str, str] = field(default_factory=dict)
    extra_args: tuple[str, ...] = ()
    ready_timeout: float = 600.0
    repository: Path = REPO
    admin_key: str | None = None
    exit_timeout_secs: int = 30
    instances: dict[str, int] = field(default_factory=dict)
    stub_bin: str | None = None
    gpus: list[int] = field(default_factory=list)
    http_host: str | None = None
    api_key: str | None = None
    response_cache_mb: int = 0


class TritonServer:
    """A running tritonserver; `with TritonServer(ServerConfig(...)) as s:` waits until it is ready and stops it
    after."""

    def __init__(self, config: ServerConfig, log_file=None, cancel=None):
        """log_file: where Triton's output goes (default: this process's stdout). cancel: an event that, set while
        the server boots, ends it (egemma.ops.procfs.Cancelled): a SIGTERM during boot."""
        cfg = self.config = config
        checkpoint, api_key, host = cfg.checkpoint, cfg.api_key, cfg.host
        self.host, self.http_port, self.grpc_port = host, cfg.http_port, cfg.grpc_port
        self.metrics_port = cfg.metrics_port
        self.http_host = cfg.http_host or cfg.host
        self.admin_key = cfg.admin_key or secrets.token_urlsafe(16)
        self.api_key = api_key
        self.exit_timeout_secs = cfg.exit_timeout_secs
        self.run_dir = Path(cfg.run_dir or tempfile.mkdtemp(prefix="egemma-run-"))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        shm.reap(self.run_dir)  # a server left by an owner killed with SIGKILL, and its shared memory
        tokenizer_json = self.run_dir / "tokenizer.json"
        tokenizer_json.unlink(missing_ok=True)
        # With a cache directory, a miss is resolved into it on a thread of this process while the models load, not
        # ahead of the whole boot, which it delayed by seconds (perf/RESULTS.md, "Boot"); the tokenizer model waits
        # for it and writes the file.
        if (text := cached_tokenizer_json(checkpoint, resolve=configured() is None)) is not None:
            tokenizer_json.write_text(text)
        else:
            resolve_ahead(checkpoint)
        self.path_env = path_env(checkpoint, self.run_dir)
        params = {"checkpoint": "", **cfg.params}  # paths go in the environment, not the served configs
        instances = cfg.instances
        if cfg.repository == REPO:
            instances = {**default_instances(gpu_host(), usable_cores(), len(cfg.gpus)), **instances}
        self.repo = render_repository(self.run_dir / "model_repository", checkpoint, params, cfg.repository,
                                      instances=instances, gpus=cfg.gpus, response_cache=cfg.response_cache_mb > 0)
        # Every model instance stamps its executes here (egemma.stub.instance); the watchdog reads them.
        self.heartbeat_dir = self.run_dir / HEARTBEATS
        shutil.rmtree(self.heartbeat_dir, ignore_errors=True)
        self.heartbeat_dir.mkdir()
        binary, backends = find_tritonserver()
        self.shm_prefix = shm.new_prefix()
        self.cmd = [str(binary), f"--model-repository={self.repo}", f"--backend-directory={backends}",
                    "--model-control-mode=none", "--exit-on-error=true", "--strict-readiness=true",
                    # the configs are complete: without this the Python backend first runs a stub per model just
                    # to ask model.py for a config, importing torch for the encoder, before any instance starts
                    "--disable-auto-complete-config",
                    f"--http-address={self.http_host}", f"--http-port={self.http_port}", f"--grpc-address={host}",
                    f"--grpc-port={self.grpc_port}", f"--metrics-address={host}", f"--metrics-port={self.metrics_port}",
                    f"--http-restricted-api={ADMIN_APIS}:{ADMIN_HEADER}={self.admin_key}",
                    f"--grpc-restricted-protocol={ADMIN_APIS}:{ADMIN_HEADER}={self.admin_key}",
                    *([f"--http-restricted-api=inference:{API_HEADER}={api_key}",
                       f"--grpc-restricted-protocol=inference:{API_HEADER}={api_key}"] if api_key else []),
                    f"--exit-timeout-secs={cfg.exit_timeout_secs}", shm.prefix_arg(self.shm_prefix),
                    *(() if gpu_host() else CPU_ARGS),
                    *(self._cache_args(cfg.response_cache_mb, Path(backends).parent)
                      if cfg.response_cache_mb > 0 else []),
                    *cfg.extra_args]
        env = {**os.environ, **self.path_env, HEARTBEAT_DIR: str(self.heartbeat_dir)}
        # The stub runs the Python whose bin is first on PATH: this one, or $TRITON_STUB_PATH (a numpy<2 venv).
        stub_bin = cfg.stub_bin or os.environ.get("TRITON_STUB_PATH") or str(Path(sys.executable).parent)
        env["PATH"] = f"{stub_bin}{os.pathsep}{env.get('PATH', '')}"
        # The stub links libpython dynamically; let it find this interpreter's own (its lib-dynload modules
        # need the matching patch release, not whatever the system ships).
        libdir = sysconfig.get_config_var("LIBDIR")
        if libdir and list(Path(libdir).glob("libpython3*.so*")):
            env["LD_LIBRARY_PATH"] = f"{libdir}{os.pathsep}{env.get('LD_LIBRARY_PATH', '')}".rstrip(os.pathsep)
        self.log_file = log_file
        self.drained = threading.Event()  # Triton logged DRAINED: every request is answered
        # No orphans: the server gets SIGKILL when its owner dies without stopping it (a test session killed, a
        # script under `timeout`), and a guard then ends its stubs and removes its shared memory (egemma.ops.shm)
        self.proc = subprocess.Popen(self.cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True,
                                     preexec_fn=functools.partial(exit_with_parent, os.getpid(), signal.SIGKILL))
        self.guard = shm.guard(self.proc.pid, self.shm_prefix)
        threading.Thread(target=self._pump, name="tritonserver-log", daemon=True).start()
        shm.record(self.run_dir, self.proc.pid, self.shm_prefix)
        try:
            wait_up(self.proc, self.ready, cfg.ready_timeout, "tritonserver", " ".join(self.cmd), lambda: None,
                    poll=0.2, cancel=cancel)
        except BaseException:  # not ready, exited, or cancelled: nothing of it may stay
            self.kill()
            raise

    def _pump(self):
        """Triton's output (its stubs' too) on to log_file (default: this process's stdout), watched for DRAINED; a
        failure to export spans said once (OTLP_ERROR), CPU_NOISE dropped on a CPU host."""
        sink, otlp_said = self.log_file or sys.stdout, False
        noise = () if gpu_host() else CPU_NOISE
        for line in iter(self.proc.stdout.readline, b""):
            if DRAINED in line:
                self.drained.set()
            if any(n in line for n in noise):
                continue
            if OTLP_ERROR in line:
                if otlp_said:
                    continue
                otlp_said, line = True, line.rstrip(b"\n") + b" (said once: its spans are lost, requests are not)\n"
            try:
                sink.write(line.decode(errors="replace") if hasattr(sink, "encoding") else line)
                sink.flush()
            except (OSError, ValueError):  # the sink is closed: keep reading, or Triton would block on its pipe
                pass

    @staticmethod
    def _cache_args(mb: int, root: Path) -> list[str]:
        """Triton's local response cache of mb MiB; its library sits beside the backends in a bundled tritonserver
        (an image's is in Triton's default /opt/tritonserver/caches)."""
        where = [f"--cache-directory={root / 'caches'}"] if (root / "caches").is_dir() else []
        return [*where, f"--cache-config=local,size={mb << 20}"]

    @property
    def http_url(self) -> str:
        return f"{self.http_host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self, timeout: float | None = None, hurry=None):
        """SIGTERM (Triton stops taking requests and answers those in flight, for up to exit_timeout_secs), then
        kill() once it has answered them all (DRAINED), or after timeout (default: that plus 30 s), or at once when
        the event hurry is set (a second SIGTERM): SIGKILL for what is left of the group, the shared memory
        removed."""
        timeout = self.exit_timeout_secs + 30 if timeout is None else timeout
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while not (wait_exit(self.proc, 0.05) or self.drained.is_set() or time.monotonic() > deadline
                       or hurry is not None and hurry.is_set()):
                pass
        self.kill()

    def kill(self, timeout: float = 30.0):
        """SIGKILL the server's process group, also when the server itself already exited (its stubs may outlive
        it, holding memory and a CUDA context), wait until none of it is left, then remove its shared-memory
        regions (egemma.ops.shm)."""
        if left := end_group(self.proc, signal.SIGKILL, timeout, timeout):
            print(f"egemma: processes {left} of tritonserver {self.proc.pid}'s group outlived SIGKILL for "
                  f"{timeout:g}s; its shared memory stays", file=sys.stderr, flush=True)
            return
        shm.remove(self.shm_prefix)
        shm.reap_guard(self.guard, timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
