"""Stopping and leaving nothing behind, with the real launcher, gateway and tritonserver: SIGTERM on an idle server
and under HTTP (through the gateway) and gRPC load, a second signal, a signal during boot; and for every way a server
ends (SIGTERM, SIGKILL of tritonserver, a stub killed, the watchdog's restart, the launcher killed with SIGKILL and
cleaned up at the next start) no shared-memory region with the server's prefix and no stub process of it remains.
(long: every stop path with its load drivers, in one place.)"""
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from egemma.ops import shm
from egemma.ops.procfs import children, gone, stub_pids
from egemma.stub.instance import read_heartbeats
from helpers import GOOD, ROOT, Launcher, assert_close, reference, shm_prefix, text_input, wait_for

BAD_LINES = ("Exit timeout expired", "Non-graceful termination detected")


def snapshot(server_pid: int) -> tuple[str, list[int]]:
    """(its prefix, its stubs' pids), after checking that it has regions and stubs to leave behind."""
    prefix, stubs = shm_prefix(server_pid), sorted(stub_pids(server_pid))
    assert shm.regions(prefix) and stubs, (prefix, shm.regions(prefix), stubs)
    return prefix, stubs


def assert_nothing_left(prefix: str, pids: list[int]):
    assert shm.regions(prefix) == [], shm.regions(prefix)
    assert all(gone(p) for p in pids), [p for p in pids if not gone(p)]


@pytest.fixture
def launch(checkpoints, tmp_path):
    """launch(*args, run_dir=..., ports=...): a launcher on the generated checkpoint, its own cache directory and
    free ports, waited for until ready (or until it exits); every one started is ended at the test's end."""
    from egemma.ops.tritonserver import free_port
    started = []

    def start(*args, run_dir=None, ports=None, wait=True):
        ports = ports or [free_port() for _ in range(3)]
        la = Launcher([sys.executable, "-m", "egemma.ops.launcher", "--model", checkpoints["eos"],
                       "--run-dir", run_dir or tmp_path / f"run{len(started)}", "--cache-dir", tmp_path / "cache",
                       "--http-port", ports[0], "--grpc-port", ports[1], "--metrics-port", ports[2], *args],
                      tmp_path / f"launcher{len(started)}")
        la.ports, la.run_dir = ports, run_dir or tmp_path / f"run{len(started)}"
        started.append(la)
        if wait:
            la.wait_ready()
        return la
    yield start
    for la in started:
        la.close()


def output(la) -> str:
    return la.stdout.read_text() + la.stderr.read_text()


def http_infer(port: int, texts, timeout=120):
    return requests.post(f"http://127.0.0.1:{port}/v2/models/embeddinggemma/infer", timeout=timeout, json={
        "inputs": [{"name": "TEXT", "shape": [len(texts), 1], "datatype": "BYTES", "data": texts}]})


def health(port: int, path: str) -> int | None:
    try:
        return requests.get(f"http://127.0.0.1:{port}{path}", timeout=5).status_code
    except requests.ConnectionError:
        return None


def embedding(r) -> np.ndarray:
    out = next(o for o in r.json()["outputs"] if o["name"] == "EMBEDDING")
    return np.array(out["data"], np.float32).reshape(out["shape"])


def test_idle_sigterm_exits_at_once_and_leaves_nothing(launch, good_ref):
    """After one request over each protocol (the gateway then pools a keep-alive connection to Triton's HTTP,
    which Triton 2.51 waited for until its 30 s exit timeout): SIGTERM ends it all in about a second (the target
    is 2 s; the bound here is loose for a busy CI machine), exit code 0, neither of Triton's two complaints about an
    ungraceful stop, no region, no stub."""
    la = launch("--exit-timeout-secs", 30)
    pid = la.server_pid()
    prefix, stubs = snapshot(pid)
    r = http_infer(la.ports[0], GOOD[:2])
    assert r.status_code == 200, r.text
    assert_close(embedding(r), good_ref[:2])
    c = grpcclient.InferenceServerClient(f"127.0.0.1:{la.ports[1]}")
    assert_close(c.infer("embeddinggemma", [text_input(GOOD[:1])]).as_numpy("EMBEDDING"), good_ref[:1])
    assert requests.get(f"http://127.0.0.1:{la.ports[0]}/v2/health/ready", timeout=10).status_code == 200
    t0 = time.monotonic()
    la.proc.send_signal(signal.SIGTERM)
    rc = la.proc.wait(60)
    took = time.monotonic() - t0
    print(f"idle SIGTERM: exit {rc} after {took:.2f}s")
    assert rc == 0 and took < 5, (rc, took)
    assert not [b for b in BAD_LINES if b in output(la)], output(la)[-3000:]
    assert_nothing_left(prefix, stubs + [pid])


LOAD_TEXT = "kalo the mine " * 60  # ~200 tokens: tenths of a second on the CPU encoder, seconds when queued


def _driver(kind: str, port: int, want, log: list, stop: threading.Event):
    """Requests one after the other until one is refused (a client goes elsewhere then) or stop; log gets
    (kind, sent, ended, outcome): "ok" (the right answer), "refused" (503 / UNAVAILABLE / connection refused:
    before any work), or what went wrong."""
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}") if kind == "grpc" else None
    while not stop.is_set():
        sent = time.monotonic()
        try:
            if kind == "grpc":
                got = client.infer("embeddinggemma", [text_input([LOAD_TEXT])], client_timeout=120).as_numpy(
                    "EMBEDDING")
            else:
                r = http_infer(port, [LOAD_TEXT])
                if r.status_code == 503:
                    raise ConnectionRefusedError(r.text)
                assert r.status_code == 200, (r.status_code, r.text)
                got = embedding(r)
            assert_close(got, want)
            outcome = "ok"
        except InferenceServerException as e:
            outcome = "refused" if e.status() == "StatusCode.UNAVAILABLE" else f"grpc error {e.status()}: {e}"
        except (ConnectionRefusedError, requests.ConnectionError) as e:
            refused = isinstance(e, ConnectionRefusedError) or "Connection refused" in str(e)
            outcome = "refused" if refused else f"http connection error: {e}"
        except AssertionError as e:
            outcome = f"wrong answer: {e}"
        log.append((kind, sent, time.monotonic(), outcome))
        if outcome != "ok":
            return


def test_sigterm_under_load_answers_or_refuses_every_request(launch, checkpoints):
    """Three HTTP clients (through the gateway) and three gRPC clients keep requests going across SIGTERM; readiness
    (/v2/health/ready and /health) answers 503 while the requests in flight drain. Every
    request ends with the right embedding or is refused before any work (503, UNAVAILABLE, a refused connection);
    none is cut off, none hangs; requests in flight at the signal complete; the launcher exits 0 within 2 s of
    the last answer (+ slack for a busy machine), leaving nothing."""
    want = reference(checkpoints["eos"], [LOAD_TEXT])
    la = launch("--exit-timeout-secs", 60)
    pid = la.server_pid()
    prefix, stubs = snapshot(pid)
    log, stop = [], threading.Event()
    threads = [threading.Thread(target=_driver, args=(kind, la.ports[0 if kind == "http" else 1], want, log, stop))
               for kind in ("http", "grpc") for _ in range(3)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: sum(o == "ok" for *_, o in log) >= 6, 120, "requests to complete before the signal")
        signalled = time.monotonic()
        la.proc.send_signal(signal.SIGTERM)
        # at once, while the requests in flight drain: not ready, on both health routes
        wait_for(lambda: {health(la.ports[0], p) for p in ("/v2/health/ready", "/health")} == {503}, 5,
                 "readiness to answer 503")
        rc = la.proc.wait(120)
        exited = time.monotonic()
    finally:
        stop.set()
        for t in threads:
            t.join(180)
    assert not any(t.is_alive() for t in threads), "a request hung"
    wrong = [entry for entry in log if entry[3] not in ("ok", "refused")]
    assert not wrong, wrong
    across = [entry for entry in log if entry[1] < signalled < entry[2] and entry[3] == "ok"]
    longest = max(e - s for _, s, e, _ in log)
    last = max(e for *_, e, o in log if o == "ok")
    refused = {kind for kind, *_, o in log if o == "refused"}
    print(f"{len(log)} requests: {sum(o == 'ok' for *_, o in log)} answered ({len(across)} across the signal), "
          f"{sum(o == 'refused' for *_, o in log)} refused; exit {rc} after {exited - signalled:.2f}s, "
          f"{exited - last:.2f}s after the last answer; longest request {longest:.2f}s")
    assert across, "no request was in flight at the signal"
    assert refused == {"http", "grpc"}, refused  # every client was turned away in the end
    assert rc == 0 and exited - last < 2 + 3, (rc, exited - last)
    assert not [b for b in BAD_LINES if b in output(la)], output(la)[-3000:]
    assert_nothing_left(prefix, stubs + [pid])


def test_second_signal_stops_at_once_and_cleans_up(launch):
    """A second SIGTERM while a long batch drains (exit timeout 60 s): the launcher ends everything at once
    (exit code 1: requests may have been cut), still leaving nothing."""
    la = launch("--exit-timeout-secs", 60)
    pid = la.server_pid()
    prefix, stubs = snapshot(pid)
    c = grpcclient.InferenceServerClient(f"127.0.0.1:{la.ports[1]}")
    c.async_infer("embeddinggemma", [text_input(["kalo the " * 1500] * 16)], client_timeout=120,
                  callback=lambda result, error: None)
    wait_for(lambda: any(b > e for b, e, *_ in read_heartbeats(la.run_dir / "heartbeat").values()), 60,
             "the batch inside an execute")
    la.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: "stopping:" in la.stdout.read_text(), 10, "the drain to start")
    t0 = time.monotonic()
    la.proc.send_signal(signal.SIGTERM)
    rc = la.proc.wait(30)
    print(f"second SIGTERM: exit {rc} after {time.monotonic() - t0:.2f}s")
    assert rc == 1 and time.monotonic() - t0 < 10, rc
    assert_nothing_left(prefix, stubs + [pid])


def test_sigterm_during_boot_stops_cleanly(launch):
    """SIGTERM while the models load: the start is given up, exit code 0, nothing left."""
    la = launch(wait=False)
    pid = la.server_pid(timeout=120)
    wait_for(lambda: len(stub_pids(pid)) >= 2, 120, "the stubs to start")
    prefix, stubs = shm_prefix(pid), sorted(stub_pids(pid))
    assert "ready:" not in la.stdout.read_text(), "booted before the signal: nothing to test"
    la.proc.send_signal(signal.SIGTERM)
    assert la.proc.wait(60) == 0
    assert "stopped during boot" in la.stdout.read_text()
    assert_nothing_left(prefix, stubs + [pid])


def test_kills_and_restarts_leave_nothing_and_a_dead_launcher_is_cleaned_up_at_the_next_start(launch, tmp_path,
                                                                                            good_ref):
    """SIGKILL of tritonserver, then of one stub: each time the watchdog restarts the server and nothing of the old
    one stays. Then the launcher itself is killed with SIGKILL together with the server's guard (egemma.ops.shm;
    as a kill of the whole process group would): its tritonserver dies with it (its parent-death signal), its
    stubs and regions stay; the next start in the same run directory removes them, and serves on the same ports."""
    run = tmp_path / "shared-run"
    la = launch(run_dir=run)
    for what in ("tritonserver", "stub"):
        pid = la.server_pid()
        prefix, stubs = snapshot(pid)
        os.kill(pid if what == "tritonserver" else stubs[0], signal.SIGKILL)
        wait_for(lambda: la.server_pid() != pid and la.stderr.read_text().count("serving again") >= 1
                 + (what == "stub"), 120, f"the watchdog to restart after the {what} was killed")
        assert_nothing_left(prefix, stubs + [pid])
    pid = la.server_pid()
    prefix, stubs = snapshot(pid)
    guard = next(p for p, a in children(la.proc.pid).items() if "egemma.ops.shm" in a)
    os.kill(guard, signal.SIGKILL)
    la.proc.kill()  # its gateway follows it, and its tritonserver (PDEATHSIG)
    la.proc.wait()
    wait_for(lambda: gone(pid), 10, "tritonserver to die with its launcher")
    assert shm.regions(prefix), "the orphan's regions are what the next start cleans"
    again = launch(run_dir=run, ports=la.ports)
    assert_nothing_left(prefix, stubs + [pid])
    assert "owner gone" in output(again), output(again)[-2000:]
    got = grpcclient.InferenceServerClient(f"127.0.0.1:{la.ports[1]}").infer(
        "embeddinggemma", [text_input(GOOD)]).as_numpy("EMBEDDING")
    assert_close(got, good_ref)
    new = again.server_pid()
    prefix, stubs = snapshot(new)
    again.proc.send_signal(signal.SIGTERM)
    assert again.proc.wait(60) == 0
    assert_nothing_left(prefix, stubs + [new])


def test_a_killed_stub_leaves_nothing_after_a_stop_without_watchdog(start_server):
    """A server started without the launcher (egemma.ops.tritonserver.TritonServer), one stub killed: stop()
    leaves no region (the dead stub's included) and no stub."""
    s = start_server()
    prefix, stubs = snapshot(s.proc.pid)
    os.kill(stubs[0], signal.SIGKILL)
    wait_for(lambda: gone(stubs[0]), 10, "the stub to die")
    assert shm.regions(prefix)
    s.stop()
    assert_nothing_left(prefix, stubs + [s.proc.pid])


@pytest.mark.parametrize("owner", ["a script", "the launcher"])
def test_a_server_dies_with_its_owner_and_leaves_nothing(checkpoints, tmp_path, launch, owner):
    """The process that started a server (a test session, a perf script under `timeout`, the launcher) is killed
    with SIGKILL: the server, its stubs and its shared-memory regions are gone within seconds (the server's
    parent-death signal, then its guard: egemma.ops.shm)."""
    if owner == "the launcher":
        la = launch()
        parent, pid = la.proc, la.server_pid()
    else:
        code = ("import sys, threading; from pathlib import Path; from egemma.ops.tritonserver import TritonServer, "
                "ServerConfig, free_port\ns = TritonServer(ServerConfig(Path(sys.argv[1]), http_port=free_port(), "
                "grpc_port=free_port(), metrics_port=free_port(), run_dir=Path(sys.argv[2])), "
                "log_file=open(Path(sys.argv[2]) / 'log', 'w'))"
                "\nprint(s.proc.pid, flush=True)\nthreading.Event().wait()")
        (tmp_path / "run").mkdir()
        parent = subprocess.Popen([sys.executable, "-c", code, str(checkpoints["eos"]), str(tmp_path / "run")],
                                  stdout=subprocess.PIPE, text=True, cwd=ROOT)
        line = parent.stdout.readline()
        if not line.strip().isdigit():
            parent.kill()
            raise AssertionError((tmp_path / "run" / "log").read_text()[-3000:])
        pid = int(line)
    try:
        prefix, stubs = snapshot(pid)
    finally:
        parent.kill()
        parent.wait()
    wait_for(lambda: gone(pid) and all(gone(p) for p in stubs) and not shm.regions(prefix), 10,
             "the server, its stubs and its regions to be gone")
