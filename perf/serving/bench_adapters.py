"""What both models' Python costs per request through the real tritonserver, from their own metrics: single-text
requests at a fixed concurrency, then per request the encoder's execute minus the engine's embed (its parsing and
responses) and the tokenizer's execute. Any host will do, a CPU one included: the GPU is not what it measures
(perf/RESULTS.md, the c=128 target).

  python -m perf.serving.bench_adapters CHECKPOINT [--rounds 4] [--requests 3000] [--concurrency 64]"""
import argparse
from pathlib import Path

from perf.lib.loadgen import Target, all_of
from perf.lib.pa import counters, model_times
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
        for _ in range(a.rounds):
            before = counters(s)
            rps = one_round(s.grpc_url, a.requests, a.concurrency)
            after = counters(s)
            t = model_times(before, after)
            batch = ((after["egemma_batch_size_sum"] - before["egemma_batch_size_sum"])
                     / (after["egemma_batch_size_count"] - before["egemma_batch_size_count"]))
            print(f"{rps:.0f} req/s, encoder batches of {batch:.1f}: its execute minus embed "
                  f"{1e3 * (t['encoder_execute_ms'] - t['encoder_embed_ms']) / batch:.1f} us a request, embed "
                  f"{t['encoder_embed_ms']:.2f} ms an execute; tokenizer execute "
                  f"{1e3 * t['tokenizer_execute_ms_per_text']:.1f} us a text", flush=True)


if __name__ == "__main__":
    main()
