"""Keep a tritonserver serving: restart it when a model stops answering.

Triton 2.51 does not restart a crashed Python backend stub, and /v2/health/ready keeps answering 200 after one
died, so readiness proves nothing. The watchdog instead checks, every `interval` seconds, the server process and
the stub processes it started, then sends a canary inference (one short text through the ensemble, so every model
is exercised). It restarts the server:
- at once if the server exited, a stub died, or a stub is stopped (SIGSTOP; with several instances of a model
  the canary would mostly be answered by the others, while the requests given to the stopped one wait);
- at once if one model instance has been in one execute for `hang_after` seconds while its stub used no CPU
  (each instance stamps its executes' start, end and tokens, egemma.stub.instance): hung, even while the other
  instances answer the canary; and if one instance has been in one execute for over `max_busy` seconds, times
  its tokens / TOKENS_PER_MAX_BUSY where more (the encoder's 256-row batches of 2048 tokens take ~100 s on two
  cores), while busy: spinning;
- at once if the canary timed out while the server and its stubs used almost no CPU (under a quarter of a core)
  and no request completed: a model is hung;
- if canaries keep timing out while the processes are busy and no request completes (Triton's statistics API:
  all models' success counts) for more than `max_busy` seconds: a model is spinning. While requests
  complete, or for less long, a timed-out canary is excused (a 64 x 2048-token batch takes ~25 s on two cores);
- after `failures` other canary failures (an error, a refused connection) in a row.
After every check the verdict (serving or why not) goes to `health_file` (egemma.gateway.common), which the
gateway's liveness route answers from: a watchdog that stops checking leaves a verdict that ages, and a restart
writes "restarting" first, so liveness fails only when restarts keep failing or the watchdog itself is stuck.
Restarting kills the server's process group (a graceful stop would wait out --exit-timeout-secs on the dead model),
removes its shared memory (TritonServer.kill) and starts it again on the same ports; requests in flight then fail,
later ones succeed."""
from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Callable

from egemma.ops.procfs import cpu_seconds, stopped, stub_pids
from egemma.gateway import common
from egemma.spec import EMBEDDING, ENSEMBLE, MAX_BATCH, TEXT
from egemma.stub.instance import read_heartbeats

TIMED_OUT = "canary timed out"
IDLE_CPU = 0.05  # of a core: a stub in execute using less is blocked (Python waiting on nothing uses ~0)
MAX_BUSY = 120.0  # seconds (--watchdog-max-busy): one execute, or a busy server that completes nothing, that long
# A full batch of 2048-token texts, ~25 s on two cores: one execute of more tokens may take max_busy x its share
TOKENS_PER_MAX_BUSY = MAX_BATCH * 2048


def canary(http_url: str, model: str = ENSEMBLE, timeout: float = 5.0,
           api_key: str | None = None) -> str | None:
    """None if one short text embeds to a finite, non-empty vector within timeout, else why not. api_key: the
    server's (egemma.ops.tritonserver.API_HEADER), where inference needs one."""
    body = json.dumps({"inputs": [{"name": TEXT, "shape": [1, 1], "datatype": "BYTES",
                                   "data": ["watchdog canary"]}]}).encode()
    req = urllib.request.Request(f"http://{http_url}/v2/models/{model}/infer", data=body,
                                 headers={"Content-Type": "application/json",
                                          **({"api-key": api_key} if api_key else {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            out = {o["name"]: o for o in json.load(r)["outputs"]}
        data = out[EMBEDDING]["data"]
        if not data or not all(math.isfinite(v) for v in data):
            return "canary embedding is empty or not finite"
        return None
    except TimeoutError:
        return TIMED_OUT
    except urllib.error.HTTPError as e:  # the server's own error message says most
        return f"canary failed: {e}: {e.read().decode(errors='replace')[:300]}"
    except urllib.error.URLError as e:
        return TIMED_OUT if isinstance(e.reason, TimeoutError) else f"canary failed: {e}"
    except Exception as e:  # refused, reset, malformed answer: all mean "not serving"
        return f"canary failed: {type(e).__name__}: {e}"


def completed(http_url: str, timeout: float = 1.0) -> int | None:
    """Requests all models have answered successfully so far (Triton's statistics API; direct calls of the
    encoder count too), None if unknown."""
    try:
        with urllib.request.urlopen(f"http://{http_url}/v2/models/stats", timeout=timeout) as r:
            return sum(int(m["inference_stats"]["success"]["count"]) for m in json.load(r)["model_stats"])
    except Exception:  # unreachable or malformed: no evidence of progress
        return None


class Watchdog:
    """Runs `start()` (which returns a ready egemma.ops.tritonserver.TritonServer) and keeps it serving.
    `events` records (time.monotonic() when noticed, reason, seconds until serving again or None if the restart
    failed) for every restart; `busy` counts canary timeouts excused because the server was computing."""

    def __init__(self, start: Callable[[], object], interval: float = 2.0, timeout: float = 5.0, failures: int = 2,
                 max_busy: float = MAX_BUSY, hang_after: float = 3.0, health_file=None,
                 log=lambda msg: print(f"watchdog: {msg}", file=sys.stderr, flush=True)):
        self._start, self.interval, self.timeout, self.failures, self.log = start, interval, timeout, failures, log
        self.max_busy, self.hang_after, self.health_file = max_busy, hang_after, health_file
        self._executing: dict[tuple[int, float], tuple[float, float]] = {}  # (pid, begin): (seen at, its CPU then)
        self.server = None
        self._progress = 0.0  # time.monotonic() when the server last answered a request
        self.events: list[tuple[float, str, float | None]] = []
        self.busy = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()  # a restart and stop() never interleave
        self._thread = threading.Thread(target=self._run, name="egemma-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        self.server = self._start()
        self.n_stubs = len(stub_pids(self.server.proc.pid))
        self._progress = time.monotonic()
        self._verdict(None)
        self._thread.start()
        return self

    def _verdict(self, why: str | None):
        if self.health_file is not None:
            common.write_verdict(self.health_file, why is None, why, restarts=len(self.events))

    def _url(self) -> str:
        host = self.server.http_host  # Triton's own HTTP, behind the gateway
        return f"{'127.0.0.1' if host in ('0.0.0.0', '::', '') else host}:{self.server.http_port}"

    def check(self, failed_before: int) -> tuple[str | None, bool]:
        """(why the server is not serving or None, whether that alone warrants a restart)."""
        if self.server is None:
            return "no server (last start failed)", True
        if self.server.proc.poll() is not None:
            return f"tritonserver exited with {self.server.proc.returncode}", True
        stubs = stub_pids(self.server.proc.pid)
        if len(stubs) < self.n_stubs:
            return f"{self.n_stubs - len(stubs)} of {self.n_stubs} Python backend stubs died", True
        frozen = [f"{os.path.basename(os.path.dirname(os.path.dirname(m)))} (pid {p})" for p, m in stubs.items()
                  if stopped(p)]
        if frozen:
            return f"stopped Python backend stub of {', '.join(frozen)}", True
        stuck = self.stuck_instance(stubs)
        if stuck:
            return stuck, True
        url, pid = self._url(), self.server.proc.pid
        done, cpu = completed(url), cpu_seconds(pid) or 0.0  # None: exited meanwhile, seen by the next check
        why = canary(url, timeout=self.timeout, api_key=self.server.api_key)
        now, idle = time.monotonic(), (cpu_seconds(pid) or 0.0) - cpu < 0.25 * self.timeout
        if why is None:
            self._progress = now
        if why != TIMED_OUT:
            return why, why is not None and failed_before + 1 >= self.failures
        if done is not None and completed(url) not in (None, done):
            self._progress = now  # busy and answering requests
        elif idle:
            return f"canary timed out after {self.timeout:g}s with the server idle: a model is hung", True
        elif now - self._progress > self.max_busy:
            return (f"canaries time out and no request completed for {now - self._progress:.0f}s while the server "
                    f"is busy (over max_busy {self.max_busy:g}s): a model is spinning"), True
        self.busy += 1
        return None, False  # busy, not hung

    def stuck_instance(self, stubs: dict[int, str]) -> str | None:
        """Why one model instance is hung or spinning, from the heartbeats its stub stamps (None if none is)."""
        now, seen = time.monotonic(), {}
        for name, (begin, end, pid, tokens) in read_heartbeats(self.server.heartbeat_dir).items():
            if pid not in stubs or end >= begin:  # another server's, or not in an execute
                continue
            cpu = cpu_seconds(pid, with_children=False)
            if cpu is None:
                continue
            first = seen[(pid, begin)] = self._executing.get((pid, begin), (now, cpu))
            age, watched = now - begin, now - first[0]
            if age >= self.hang_after and watched >= 1.0 and cpu - first[1] < IDLE_CPU * watched:
                return (f"model instance {name} (pid {pid}) has been in one execute for {age:.1f}s using no CPU: "
                        "it is hung")
            allowed = self.max_busy * max(1.0, tokens / TOKENS_PER_MAX_BUSY)
            if age > allowed:
                return (f"model instance {name} (pid {pid}) has been in one execute of {tokens} tokens for {age:.1f}s "
                        f"while busy (over {allowed:g}s: max_busy {self.max_busy:g}s, scaled for batches over "
                        f"{TOKENS_PER_MAX_BUSY} tokens): it is spinning")
        self._executing = seen
        return None

    def _run(self):
        failed = 0
        while not self._stop.wait(self.interval):
            why, restart = self.check(failed)
            self._verdict(why)
            failed = failed + 1 if why else 0
            if restart and not self._stop.is_set():
                self.restart(why)
                failed = 0

    def restart(self, why: str):
        with self._lock:
            if self._stop.is_set():
                return
            noticed = time.monotonic()
            self.log(f"restarting tritonserver: {why}")
            self._verdict(f"restarting: {why}")
            self._kill()
            try:
                self.server = self._start()
                self.n_stubs = len(stub_pids(self.server.proc.pid))
                self._progress = time.monotonic()
                took = time.monotonic() - noticed
                self.log(f"tritonserver serving again after {took:.1f}s")
                self._verdict(None)
            except Exception as e:  # e.g. a port still taken: try again on the next check
                self.server, took = None, None
                self.log(f"restart failed: {type(e).__name__}: {e}")
                self._verdict(f"restart failed: {type(e).__name__}: {e}")
            self.events.append((noticed, why, took))

    def _kill(self):
        """The old server's whole process group, its stubs with it, and its shared memory (TritonServer.kill)."""
        if self.server is not None:
            self.server.kill()

    def stop(self, timeout: float | None = None, hurry=None):
        """Stop watching, then stop the server gracefully (SIGTERM drains in-flight requests; TritonServer.stop;
        at once when the event hurry is set)."""
        self._stop.set()
        with self._lock:
            if self.server is not None:
                self.server.stop(timeout, hurry)
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(self.timeout + 5)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
