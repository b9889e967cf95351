"""Lifecycle of a real tritonserver: SIGTERM drains the request in flight, and the launcher (`python -m
egemma.ops.launcher`) serves on loopback only, behind the admin key, and recovers after its encoder is killed."""
import os
import queue
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from egemma.ops.procfs import gone, stub_pids
from helpers import GOOD, Launcher, assert_close, fire_concurrently, model_stats, reference, text_input, wait_for

LONG = "kalo the " * 1500  # 16 of these (2048 tokens each) take seconds on the CPU encoder


def _tokenized(c) -> int:
    """Requests the tokenizer model has answered: those handed on to the encoder."""
    return model_stats(c, "embeddinggemma_tokenizer")[0]


def test_sigterm_drains_the_request_in_flight(checkpoints, start_server):
    """SIGTERM while a slow batch (16 x 2048 tokens, seconds on CPU) is inside the encoder: Triton waits for it
    (--exit-timeout-secs) and the client gets the full, correct answer; then the server exits cleanly."""
    want = reference(checkpoints["eos"], [LONG])
    srv = start_server(exit_timeout_secs=60)
    c = grpcclient.InferenceServerClient(srv.grpc_url)
    done = queue.Queue()
    c.async_infer("embeddinggemma", [text_input([LONG] * 16)], client_timeout=120,
                  callback=lambda result, error: done.put((result, error)))
    # In flight = tokenised and handed to the encoder: poll the tokenizer's statistics.
    wait_for(lambda: _tokenized(c) >= 16 or not done.empty(), 60, "the batch to reach the encoder")
    assert done.empty(), "the batch finished before SIGTERM: make it slower"
    srv.proc.send_signal(signal.SIGTERM)
    r, e = done.get(timeout=130)
    assert e is None, e
    assert_close(r.as_numpy("EMBEDDING"), np.repeat(want, 16, axis=0))
    assert srv.proc.wait(90) == 0


LOOPBACK = {"0100007F", "0000000000000000FFFF00000100007F"}  # 127.0.0.1 and ::ffff:127.0.0.1 as /proc/net shows


def _listening(port):
    """Local addresses (hex, as in /proc/net/tcp*) listening on port."""
    out = []
    for f in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(f).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A" and int(local.split(":")[1], 16) == port:
                out.append(local.split(":")[0])
    return out


@pytest.fixture
def launcher(tmp_path):
    """launcher(*args): a started Launcher, ended with its servers at the test's end."""
    started = []

    def start(*args):
        started.append(Launcher([sys.executable, "-m", "egemma.ops.launcher", *args],
                                tmp_path / f"launcher{len(started)}"))
        return started[-1]
    yield start
    for la in started:
        la.close()


def test_launcher_watchdog_restores_service_after_the_encoder_dies(checkpoints, launcher, tmp_path, good_ref):
    """`python -m egemma.ops.launcher` (watchdog on by default): loopback-only sockets, admin key required; SIGKILL
    the encoder's stub; requests in flight fail cleanly, the watchdog notices within 10 s, the service is back
    within 30 s with correct results, and SIGTERM ends launcher and server."""
    from egemma.ops.host import CPU_INSTANCES
    from egemma.ops.tritonserver import free_port, gpu_host
    ports = [free_port() for _ in range(4)]
    la = launcher("--model", checkpoints["eos"], "--run-dir", tmp_path / "run", "--http-port", ports[0],
                  "--grpc-port", ports[1], "--metrics-port", ports[2], "--admin-key", "let-me-in",
                  "--exit-timeout-secs", 20, "--openai-port", ports[3])
    la.wait_ready()
    assert "admin-key: let-me-in" in la.stdout.read_text()
    pid = la.server_pid()
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    assert "--exit-timeout-secs=20" in argv and "--model-control-mode=none" in argv
    for port in ports:  # nothing listens on an address other than 127.0.0.1
        assert _listening(port) and set(_listening(port)) <= LOOPBACK, (port, _listening(port))
    http = f"http://127.0.0.1:{ports[0]}/v2"
    assert requests.get(http + "/trace/setting", timeout=10).status_code == 403
    assert requests.get(http + "/trace/setting", headers={"admin-key": "let-me-in"}, timeout=10).status_code == 200
    r = requests.post(f"http://127.0.0.1:{ports[3]}/v1/embeddings", timeout=60,  # the gateway it started
                      json={"input": GOOD[1:3], "model": "google/embeddinggemma-300m"})  # GOOD[0]: ""
    assert r.status_code == 200, r.text
    assert_close(np.array([d["embedding"] for d in r.json()["data"]], dtype=np.float32), good_ref[1:3])

    c = grpcclient.InferenceServerClient(f"127.0.0.1:{ports[1]}")
    long = ["kalo the " * 1000] * 4  # ~1 s each on the encoder: some are in flight at the kill
    n0 = _tokenized(c)
    inflight = queue.Queue()
    for k in range(6):
        c.async_infer("embeddinggemma", [text_input(long)], client_timeout=60,
                      callback=lambda result, error, k=k: inflight.put((k, result, error)))
    wait_for(lambda: _tokenized(c) >= n0 + 8, 60, "requests to reach the encoder")
    encoders = [p for p, model in stub_pids(pid).items() if "embeddinggemma_encoder" in model]
    if not gpu_host():  # the launcher's CPU instance counts, not the repository's
        assert len(encoders) == CPU_INSTANCES["embeddinggemma_encoder"], encoders
    os.kill(min(encoders), signal.SIGKILL)
    killed = time.monotonic()

    wait_for(lambda: "restarting tritonserver" in la.stderr.read_text(), 10, "the watchdog to notice")
    noticed = time.monotonic() - killed

    want = reference(checkpoints["eos"], long[:1])
    errors = 0
    for _ in range(6):  # in flight: an exact answer (finished before the kill) or a clean error, no hang
        k, r, e = inflight.get(timeout=90)
        if e is None:
            assert_close(r.as_numpy("EMBEDDING"), np.repeat(want, 4, axis=0))
        else:
            errors += 1
            assert isinstance(e, InferenceServerException) and e.message(), e
    assert errors >= 1, "the kill hit no request in flight"

    def serving():
        try:
            got = grpcclient.InferenceServerClient(f"127.0.0.1:{ports[1]}").infer(
                "embeddinggemma", [text_input(GOOD)], client_timeout=5).as_numpy("EMBEDDING")
        except InferenceServerException:
            return False
        assert_close(got, good_ref)
        return True
    wait_for(serving, 30 - (time.monotonic() - killed), "service to be restored")
    recovered = time.monotonic() - killed
    assert noticed < 10 and recovered < 30, (noticed, recovered)
    new = la.server_pid()
    assert new != pid and gone(pid)
    # Every later request succeeds, concurrently too.
    res = fire_concurrently(grpcclient.InferenceServerClient(f"127.0.0.1:{ports[1]}"),
                            [("embeddinggemma", [text_input([t])]) for t in GOOD])
    for (r, e), w in zip(res, good_ref):
        assert e is None, e
        assert_close(r.as_numpy("EMBEDDING"), w[None])
    print(f"watchdog noticed after {noticed:.1f}s, service restored after {recovered:.1f}s")

    la.proc.send_signal(signal.SIGTERM)
    assert la.proc.wait(90) == 0
    assert gone(new)
