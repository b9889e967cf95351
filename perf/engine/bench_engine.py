"""Engine benchmark on the GPU host, side by side: sentence-transformers bf16 (the baseline users have) vs this
engine eager vs CUDA-graph replay, forward incl. pooling and the Dense projector.

  python -m perf.engine.bench_engine CHECKPOINT [--out results.json]"""
import argparse
import json
import statistics
import time

import numpy as np
import torch

from egemma.engine import Engine, EngineConfig


def workloads(vocab, seed=0):
    rng = np.random.default_rng(seed)

    def seqs(lengths):
        return [np.concatenate([[2], rng.integers(4, vocab, n - 2), [1]]).astype(np.int32) for n in lengths]
    return {"8x2048": seqs([2048] * 8), "32x128-512": seqs(rng.integers(128, 513, 32).tolist()),
            "64x128": seqs([128] * 64), "1x16": seqs([16])}


def timed(fn, reps):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def baseline(path, batches, reps):
    from sentence_transformers import SentenceTransformer
    st = SentenceTransformer(path, device="cuda").to(torch.bfloat16)
    out = {}
    for name, seqs in batches.items():
        L = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), L, dtype=torch.long)
        mask = torch.zeros(len(seqs), L, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, :len(s)] = torch.from_numpy(s)
            mask[i, :len(s)] = 1
        f = {"input_ids": ids.cuda(), "attention_mask": mask.cuda(), "modality": "text"}

        def run():
            with torch.inference_mode():
                return st(dict(f))["sentence_embedding"].float().cpu()
        out[name] = timed(run, reps)
    del st
    torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("--out")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--no-baseline", action="store_true")
    a = ap.parse_args()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    eng = Engine(EngineConfig(a.checkpoint))
    load_s = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() / 2 ** 30
    batches = workloads(eng.cfg.vocab_size)
    rows = {}
    for name, seqs in batches.items():
        ids = np.concatenate(seqs)
        lengths = [len(s) for s in seqs]
        rows[name] = {"tokens": sum(lengths),
                      "eager_ms": timed(lambda: eng.graphs.run(ids, lengths, use_graph=False), a.reps),
                      "graph_ms": timed(lambda: eng.embed(seqs), a.reps)}
    base = {} if a.no_baseline else baseline(a.checkpoint, batches, max(5, a.reps // 3))
    print(f"\nengine: load+capture {load_s:.1f}s (capture {getattr(eng.graphs, 'capture_s', 0):.1f}s), "
          f"peak GPU memory {peak:.2f} GiB, norms={eng.ops.name}")
    print(f"{'batch':<12}{'tokens':>8}{'ST bf16 ms':>12}{'eager ms':>10}{'graph ms':>10}{'Mtok/s':>9}{'x ST':>8}")
    for name, r in rows.items():
        b = r["baseline_ms"] = base.get(name)
        base_ms, ratio = (f"{b:.2f}", f"{b / r['graph_ms']:.1f}") if b else ("-", "-")
        print(f"{name:<12}{r['tokens']:>8}{base_ms:>12}{r['eager_ms']:>10.2f}"
              f"{r['graph_ms']:>10.2f}{r['tokens'] / r['graph_ms'] / 1e3:>9.2f}{ratio:>8}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"rows": rows, "load_s": load_s, "peak_gib": peak, "norms": eng.ops.name,
                       "attention": {str(k): v for k, v in eng.graphs.attn.items()}}, f, indent=2)


if __name__ == "__main__":
    main()
