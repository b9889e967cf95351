"""Truthful health: every model instance stamps its executes (egemma.stub.instance), so the watchdog finds one
hung or spinning instance among several while the others keep answering its canary, and restarts the server;
its verdict file (egemma.gateway.common, what the liveness probe reads) says serving, restarting, or why not, and
ages when the watchdog stops checking. Real tritonservers on tests/spin_repository with 2 instances."""
import os
import queue
import signal
import time

import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from egemma.gateway import common
from egemma.stub.instance import Heartbeat, read_heartbeats
from helpers import ROOT, text_input, wait_for

SPIN = ROOT / "tests" / "spin_repository"  # "spin" loops forever, "hang" blocks forever, the rest is answered


def test_heartbeat_stamps_are_read_back(tmp_path):
    beat = Heartbeat("m_0_1", str(tmp_path))
    assert read_heartbeats(tmp_path) == {"m_0_1": (0.0, 0.0, os.getpid(), 0)}
    with pytest.raises(KeyError):
        with beat as b:  # how the adapters stamp an execute
            b.tokens(4096)
            begin, end, _, tokens = read_heartbeats(tmp_path)["m_0_1"]
            assert begin > end == 0.0 and begin <= time.monotonic() and tokens == 4096  # inside an execute
            raise KeyError("an execute that raises still ends its stamp, and its error propagates")
    begin2, end2, _, _ = read_heartbeats(tmp_path)["m_0_1"]
    assert begin2 == begin and end2 >= begin
    beat.begin()  # a new execute starts with its size unsaid, not the last one's
    assert read_heartbeats(tmp_path)["m_0_1"][3] == 0
    Heartbeat("unwatched", "").begin()  # no directory: stamps go to an anonymous map
    assert set(read_heartbeats(tmp_path)) == {"m_0_1"}


@pytest.fixture
def two_instances(start_server, tmp_path):
    """watchdog(**kw): a Watchdog over tests/spin_repository with 2 instances (restarts on the same ports), its
    verdict in tmp_path/health.json."""
    from egemma.ops.tritonserver import free_port
    from egemma.ops.watchdog import Watchdog
    ports = {"http_port": free_port(), "grpc_port": free_port(), "metrics_port": free_port()}

    def start():
        return start_server(**ports, ready_timeout=60, repository=SPIN, instances={"embeddinggemma": 2})

    def make(**kw):
        return Watchdog(start, health_file=tmp_path / "health.json", **kw)
    return make


def _stuck_one_of_two(wd, text):
    """Send `text` to one instance, check the other answers canaries meanwhile, wait for the restart; returns
    (seconds from sending to noticing, the reason)."""
    from egemma.ops.watchdog import canary
    assert canary(wd.server.http_url) is None
    assert common.read_verdict(wd.health_file, 10) == (True, "serving")
    done = queue.Queue()
    grpcclient.InferenceServerClient(wd.server.grpc_url).async_infer(
        "embeddinggemma", [text_input([text])], client_timeout=60, callback=lambda result, error: done.put(error))
    sent = time.monotonic()
    beats = wd.server.heartbeat_dir
    wait_for(lambda: any(b > e for b, e, *_ in read_heartbeats(beats).values()), 10, f"{text!r} inside an execute")
    assert len(read_heartbeats(beats)) == 2
    if not wd.events:
        assert canary(wd.server.http_url, timeout=5) is None, "the other instance must keep answering"
    wait_for(lambda: wd.events, 60, "the watchdog to restart the server")
    noticed, why, took = wd.events[0]
    assert wd.busy == 0, "no canary of the watchdog's timed out: the other instance answered them all"
    assert isinstance(done.get(timeout=30), InferenceServerException)  # the stuck request ends, with an error
    assert took is not None and canary(wd.server.http_url) is None
    wait_for(lambda: common.read_verdict(wd.health_file, 10) == (True, "serving"), 10, "a good verdict after the restart")
    print(f"{text!r} in one of two instances: noticed after {noticed - sent:.1f}s ({why}), serving again after "
          f"{took:.1f}s")
    return noticed - sent, why


def test_one_hung_instance_of_two_is_restarted_within_10s(two_instances):
    with two_instances() as wd:
        noticed, why = _stuck_one_of_two(wd, "hang")
    assert noticed < 10 and "model instance embeddinggemma_0_" in why and "hung" in why, (noticed, why)


def test_one_spinning_instance_of_two_is_restarted_after_max_busy_scaled_by_its_batch(two_instances):
    """Busy on the CPU (a long batch looks the same): excused until one execute outlasts max_busy, times its
    tokens over TOKENS_PER_MAX_BUSY where more: here an execute that said it embeds twice as many, so 2 x 3 s.
    (tests/test_watchdog.py spins without a size: max_busy itself.)"""
    from egemma.ops.watchdog import TOKENS_PER_MAX_BUSY
    with two_instances(interval=1, timeout=2, max_busy=3) as wd:
        noticed, why = _stuck_one_of_two(wd, f"spin:{2 * TOKENS_PER_MAX_BUSY}")
    assert "model instance embeddinggemma_0_" in why and "spinning" in why and "over 6s" in why, why
    assert 6 - 1 < noticed < 6 + 3 * 1 + 2, noticed  # not at 3 s: the batch's size bought it time


def test_the_verdict_reports_failing_restarts_and_ages_when_the_watchdog_stops(two_instances, start_server, tmp_path):
    """Liveness fails only when in-place restarts keep failing or the watchdog stops checking."""
    from egemma.ops.watchdog import Watchdog
    first = two_instances()._start
    calls = []

    def start():
        calls.append(time.monotonic())
        if len(calls) > 1:
            raise RuntimeError("no GPU left")  # as a restart that cannot come up
        return first()
    f = tmp_path / "verdict.json"
    wd = Watchdog(start, interval=0.5, health_file=f).start()
    try:
        wait_for(lambda: common.read_verdict(f, 2) == (True, "serving"), 10, "a fresh good verdict")
        os.killpg(wd.server.proc.pid, signal.SIGKILL)
        wait_for(lambda: len(calls) >= 3, 30, "restarts to be tried again")
        ok, why = common.read_verdict(f, 5)
        assert not ok and ("restart failed: RuntimeError: no GPU left" in why or "no server" in why), why
    finally:
        wd.stop()
    wait_for(lambda: "old" in common.read_verdict(f, 1.0)[1], 10, "the verdict to age")
    assert common.read_verdict(f, 1.0)[0] is False
