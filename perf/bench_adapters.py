"""What both models' Python costs per request through the real tritonserver, from their own counters: single-text
requests at a fixed concurrency, then per request the encoder's execute minus the engine's embed (its parsing and
responses) and the tokenizer's execute. Any host will do, a CPU one included: the GPU is not what it measures
(perf/RESULTS.md, the c=128 section of issue #14).

  python perf/bench_adapters.py CHECKPOINT [--rounds 4] [--requests 3000] [--concurrency 64]"""
import argparse
import queue
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from pa import counters  # perf/ is on sys.path when run as a script
from egemma.ops.tritonserver import TritonServer, free_port


def text(i: int):
    x = grpcclient.InferInput("TEXT", [1, 1], "BYTES")
    x.set_data_from_numpy(np.array([[f"query number {i} about the red planet".encode()]], dtype=object))
    return x


def one_round(c, n: int, conc: int) -> float:
    """n requests, conc in flight; returns the requests per second."""
    done, sent = queue.Queue(), 0
    t0 = time.perf_counter()
    for _ in range(min(conc, n)):
        c.async_infer("embeddinggemma", [text(sent)], lambda result, error: done.put(error))
        sent += 1
    for _ in range(n):
        if (e := done.get(timeout=120)) is not None:
            raise e
        if sent < n:
            c.async_infer("embeddinggemma", [text(sent)], lambda result, error: done.put(error))
            sent += 1
    return n / (time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--log", type=Path, default=Path("/tmp/bench_adapters_server.log"))
    a = ap.parse_args()
    ports = []
    for _ in range(3):
        ports.append(free_port(ports))
    with TritonServer(a.checkpoint, http_port=ports[0], grpc_port=ports[1], metrics_port=ports[2],
                      log_file=open(a.log, "w")) as s:
        c = grpcclient.InferenceServerClient(s.grpc_url)
        url = f"{s.host}:{s.metrics_port}"
        for _ in range(a.rounds):
            time.sleep(1.1)  # the counters flush once a second: both reads see every execute before them
            before = counters(url)
            rps = one_round(c, a.requests, a.concurrency)
            time.sleep(1.1)
            d = {k: v - before.get(k, 0.0) for k, v in counters(url).items()}
            seqs, executes = d["egemma_sequences_total"], d["egemma_executes_total"]
            python = d["egemma_encoder_seconds_total"] - d["egemma_embed_seconds_total"]
            print(f"{rps:.0f} req/s, encoder batches of {seqs / executes:.1f}: its execute minus embed "
                  f"{1e6 * python / seqs:.1f} us a request, embed {1e3 * d['egemma_embed_seconds_total'] / executes:.2f} "
                  f"ms an execute; tokenizer execute {1e6 * d['egemma_tokenizer_seconds_total'] / d['egemma_texts_total']:.1f}"
                  " us a text", flush=True)


if __name__ == "__main__":
    main()
