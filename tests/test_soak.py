"""Bounded soak through the real tritonserver: concurrent gRPC clients send mixed single-text and batched
requests for EGEMMA_SOAK_SECONDS (default 120) on loopback. Every answer is checked against the
sentence-transformers reference: zero errors, zero mismatches; and the Python backend stubs' resident memory is
flat (within 10%) between the end of the warm-up and the end of the run, so nothing leaks per request."""
import os
import random
import threading
import time

import numpy as np
import tritonclient.grpc as grpcclient

from helpers import assert_close, make_texts, reference
from egemma.ops.procfs import rss_kb, stub_pids

SECONDS = float(os.environ.get("EGEMMA_SOAK_SECONDS", "120"))
WARMUP = min(max(10.0, 0.2 * SECONDS), SECONDS / 2)
WORKERS = 6  # a few more clients than cores, so dynamic batching always has company
MAX_REQUESTS = 200_000  # per worker: the loop is bounded in count as well as time
BATCHES = (1, 1, 1, 2, 4, 8, 16)


def stubs(server) -> dict[int, int]:
    """{stub pid: RSS kB} for the server's Python backend stubs."""
    return {p: rss_kb(p) for p in stub_pids(server.proc.pid)}


def test_soak(server, checkpoints):
    pool = make_texts(96, 300, seed=21)
    ref = reference(checkpoints["eos"], pool)
    stop = threading.Event()
    deadline = time.monotonic() + SECONDS
    counts, failures = [0] * WORKERS, []

    def worker(w):
        rng = random.Random(w)
        c = grpcclient.InferenceServerClient(server.grpc_url)
        for _ in range(MAX_REQUESTS):
            if stop.is_set() or time.monotonic() > deadline:
                return
            idx = [rng.randrange(len(pool)) for _ in range(rng.choice(BATCHES))]
            i = grpcclient.InferInput("TEXT", [len(idx), 1], "BYTES")
            i.set_data_from_numpy(np.array([[pool[k].encode()] for k in idx], dtype=object))
            try:
                got = c.infer("embeddinggemma", [i], client_timeout=60).as_numpy("EMBEDDING")
            except Exception as e:  # any error fails the soak; keep going to see how many
                failures.append(f"error: {e}")
                continue
            counts[w] += 1
            try:
                assert_close(got, ref[idx])
            except AssertionError:
                failures.append(f"mismatch for texts {idx}")

    threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(WORKERS)]
    for t in threads:
        t.start()
    try:
        # Memory is sampled while the load runs: after the warm-up, and just before the end.
        stop.wait(WARMUP)
        warm, warm_server = stubs(server), rss_kb(server.proc.pid)
        stop.wait(max(0.0, deadline - time.monotonic() - 1))
        end, end_server = stubs(server), rss_kb(server.proc.pid)
    finally:
        stop.set()
        for t in threads:
            t.join(90)
    assert not any(t.is_alive() for t in threads), "a client hung"
    total = sum(counts)
    print(f"soak: {total} requests in {SECONDS:.0f}s ({total / SECONDS:.1f}/s), {len(failures)} failures; "
          f"stub RSS MB after warm-up {[v >> 10 for v in warm.values()]}, at the end "
          f"{[v >> 10 for v in end.values()]}; tritonserver {warm_server >> 10} -> {end_server >> 10} MB")
    assert not failures, failures[:10]
    assert total >= SECONDS and min(counts) > 0  # the load was real
    assert warm and end.keys() == warm.keys(), "a stub process died or was replaced"
    for p in warm:
        assert abs(end[p] - warm[p]) <= 0.10 * warm[p], (p, warm[p], end[p])
