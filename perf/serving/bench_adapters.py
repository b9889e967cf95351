"""What both models' Python costs per request through the real tritonserver, from their own counters: single-text
requests at a fixed concurrency, then per request the encoder's execute minus the engine's embed (its parsing and
responses) and the tokenizer's execute. Any host will do, a CPU one included: the GPU is not what it measures
(perf/RESULTS.md, the c=128 target).

  python -m perf.serving.bench_adapters CHECKPOINT [--rounds 4] [--requests 3000] [--concurrency 64]"""
import argparse
import time
from pathlib import Path

from perf.lib.loadgen import Target, all_of
from perf.lib.pa import counters
from perf.lib.servers import triton


def one_round(url: str, n: int, conc: int) -> float:
    """n single-text requests, conc in flight (perf/lib/loadgen.py's all_of); returns the requests per second."""
    seconds, errors = all_of(Target("grpc", url, "embeddinggemma"),
                             [[f"query number {i} about the red planet"] for i in range(n)], conc)
    if errors:
        raise RuntimeError(f"{errors} of {n} requests failed")
    return n / seconds


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--log", type=Path, default=Path("/tmp/bench_adapters_server.log"))
    a = ap.parse_args()
    with triton(a.checkpoint, a.log) as s:
        url = f"{s.host}:{s.metrics_port}"
        for _ in range(a.rounds):
            time.sleep(1.1)  # the counters flush once a second: both reads see every execute before them
            before = counters(url)
            rps = one_round(s.grpc_url, a.requests, a.concurrency)
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
