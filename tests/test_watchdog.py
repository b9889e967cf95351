"""The watchdog (egemma.ops.watchdog) around a real tritonserver started by the test: it leaves a busy server
alone, and restores service after an encoder stub is stopped or a model hangs or spins (tests/spin_repository)."""
import os
import queue
import signal
import time

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from egemma.ops.procfs import gone, stub_pids
from helpers import GOOD, ROOT, assert_close, model_stats, reference, text_input, wait_for

LONG = "kalo the " * 1500  # 16 of these (2048 tokens each) take seconds on the CPU encoder


def _ports():
    """Fixed ports for every start of a watched server: a restart serves where the last one did, as the
    launcher's."""
    from egemma.ops.tritonserver import free_port
    return {"http_port": free_port(), "grpc_port": free_port(), "metrics_port": free_port()}


def test_watchdog_leaves_a_busy_server_alone(checkpoints, start_server):
    """A canary stuck behind a long batch is not a crash: with a 0.5 s canary timeout and a restart on the first
    failure, a 16 x 2048-token batch (seconds on CPU) on the only encoder instance still completes, and nothing
    is restarted."""
    from egemma.ops.watchdog import Watchdog

    def start():  # one encoder instance: else a free one answers the canary
        return start_server(instances={"embeddinggemma_encoder": 1})
    with Watchdog(start, interval=0.5, timeout=0.5, failures=1) as wd:
        c = grpcclient.InferenceServerClient(wd.server.grpc_url)
        r = c.infer("embeddinggemma", [text_input([LONG] * 16)], client_timeout=120).as_numpy("EMBEDDING")
        assert_close(r, np.repeat(reference(checkpoints["eos"], [LONG]), 16, axis=0))
        assert wd.busy >= 1 and wd.events == [], (wd.busy, wd.events)


def test_watchdog_restarts_the_server_when_an_encoder_stub_is_stopped(start_server, good_ref):
    """SIGSTOP one of two encoder stubs under load (the other would answer the canary, and the requests given to
    the stopped one wait): the watchdog notices within 10 s, the requests in flight end (an answer or a clean
    error, no hang), and the service is back within 30 s."""
    from egemma.ops.watchdog import Watchdog
    ports = _ports()

    def start():
        return start_server(**ports, instances={"embeddinggemma_encoder": 2})
    enc = None
    with Watchdog(start) as wd:
        try:
            c = grpcclient.InferenceServerClient(wd.server.grpc_url)
            n0 = model_stats(c, "embeddinggemma_tokenizer")[0]
            inflight = queue.Queue()
            for _ in range(6):
                c.async_infer("embeddinggemma", [text_input(["kalo the " * 1000] * 4)], client_timeout=60,
                              callback=lambda result, error: inflight.put(error))
            wait_for(lambda: model_stats(c, "embeddinggemma_tokenizer")[0] >= n0 + 8, 60,
                     "requests to reach the encoder")
            enc = min(p for p, model in stub_pids(wd.server.proc.pid).items() if "embeddinggemma_encoder" in model)
            os.kill(enc, signal.SIGSTOP)
            stopped = time.monotonic()
            wait_for(lambda: wd.events, 120, "the watchdog to restart the server")
            noticed, why, took = wd.events[0]
            assert noticed - stopped < 10 and "stopped" in why, (noticed - stopped, why)
            for _ in range(6):
                e = inflight.get(timeout=60)
                assert e is None or isinstance(e, InferenceServerException) and e.message(), e
            got = grpcclient.InferenceServerClient(wd.server.grpc_url).infer(  # a new channel: the old one backs off
                "embeddinggemma", [text_input(GOOD)], client_timeout=30).as_numpy("EMBEDDING")
            assert_close(got, good_ref)
            recovered = time.monotonic() - stopped
            assert recovered < 30, recovered
            print(f"noticed after {noticed - stopped:.1f}s ({why}), serving again after {recovered:.1f}s")
        finally:
            if enc is not None and not gone(enc):
                os.kill(enc, signal.SIGCONT)


def _stuck_model(start_server, text, **watchdog_args):
    """Serve tests/spin_repository (one instance; "spin" loops forever, "hang" blocks forever) under a Watchdog,
    send `text`, wait for the restart; the stuck request must end with a clean error and the canary succeed
    within 30 s. Returns (seconds from sending to the watchdog noticing, its reason, its excused timeouts)."""
    from egemma.ops.watchdog import Watchdog, canary
    ports = _ports()

    def start():
        return start_server(**ports, ready_timeout=60, repository=ROOT / "tests" / "spin_repository")
    with Watchdog(start, **watchdog_args) as wd:
        assert canary(wd.server.http_url) is None
        done = queue.Queue()
        grpcclient.InferenceServerClient(wd.server.grpc_url).async_infer(
            "embeddinggemma", [text_input([text])], client_timeout=120, callback=lambda result, error: done.put(error))
        sent = time.monotonic()
        wait_for(lambda: wd.events, 60, "the watchdog to restart the server")
        noticed, why, took = wd.events[0]
        e = done.get(timeout=30)
        assert isinstance(e, InferenceServerException), e
        assert took is not None and canary(wd.server.http_url) is None
        assert time.monotonic() - noticed < 30, "service not restored within 30 s of noticing"
        print(f"{text!r}: noticed after {noticed - sent:.1f}s ({why}), serving again after {took:.1f}s")
        return noticed - sent, why, wd.busy


def test_watchdog_restarts_a_model_hung_without_cpu(start_server):
    """A model blocked forever without using CPU: the first canary that times out is enough (default interval
    2 s, timeout 5 s: noticed within ~7 s; asserted within the 10 s the issue allows)."""
    noticed, why, _ = _stuck_model(start_server, "hang")
    assert noticed < 10 and "hung" in why, (noticed, why)


def test_watchdog_restarts_a_spinning_model(start_server):
    """A model looping forever on the CPU looks busy: its timed-out canaries are excused until no request has
    completed for max_busy seconds, then the server is restarted."""
    noticed, why, busy = _stuck_model(start_server, "spin", interval=1, timeout=2, max_busy=8)
    assert busy >= 1 and "spinning" in why, (busy, why)
    assert 8 - 1 - 2 < noticed < 8 + 2 * (1 + 2), noticed
