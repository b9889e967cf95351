"""The one way a benchmark starts a server: our tritonserver on free ports with its log in a file (`triton`), and
any other server process (`process`: the launcher, the gateway, a peer), ready once its URL answers 200, its whole
process group ended after. Each is a context manager."""
import os
import signal
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from egemma.ops.repository import ROOT
from egemma.ops.tritonserver import ServerConfig, TritonServer, free_port


@contextmanager
def triton(checkpoint: Path, log: Path, **kw):
    """Our tritonserver (egemma.ops.tritonserver.TritonServer, kw as ServerConfig's) on free HTTP, gRPC and metrics
    ports, its output to log; yields the server (http_url, grpc_url, metrics_url, proc)."""
    config = ServerConfig(checkpoint, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(), **kw)
    with open(log, "w") as f, TritonServer(config, log_file=f) as s:
        yield s


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
        time.sleep(0.2)  # polling the server's port; the condition is checked above


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
def gateway(server, log: Path, *args: str, timeout: float = 60):
    """Our HTTP gateway (python -m egemma.gateway.app, args added) in front of a running tritonserver; yields its
    port and its process."""
    port = free_port()
    cmd = [sys.executable, "-m", "egemma.gateway.app", "--port", str(port), "--triton-http", server.http_url,
           "--triton-grpc", server.grpc_url, *args]
    with process(cmd, f"http://127.0.0.1:{port}/v1/models", log, timeout) as proc:
        yield port, proc
