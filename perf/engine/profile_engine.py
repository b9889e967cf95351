"""Where the engine's GPU time goes: torch.profiler over eager forwards of one workload, kernels grouped into
GEMM / attention / norm (q/k-norm + RoPE among them) / copy / other, plus graph-replay wall time vs GPU time, and the
graph's own kernels as they ran in replays: their sum, the idle time between them and where it falls. "ten queued":
the replay time with ten launched back to back, which hides what a single replay waits for its launch. "rested": one
replay 20 ms after the last, at the clock the GPU holds when it is not at its power limit; the plain replay time runs
replays one after another, and at 8 x 2048 that holds the H200 at its 700 W cap, ~1.7 against 1.98 GHz. Both are GPU times between CUDA events.

  python -m perf.engine.profile_engine CHECKPOINT [--batch 64x128]"""
import argparse
import collections
import contextlib
import time

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from egemma.engine import Engine, EngineConfig
from egemma.engine.select import time_ms

GROUPS = [("gemm+gelu", ("gate_up_gelu",)), ("attention", ("flash", "fmha", "attn")),
          ("gemm", ("gemm", "sm90", "cutlass", "cublas", "nvjet")),
          ("norm", ("rmsnorm", "norm")), ("activation", ("gelu",)), ("rope", ("qk_norm_rope",)),
          ("copy/fill", ("copy", "fill", "memcpy", "memset"))]


def group(name: str) -> str:
    n = name.lower()
    return next((g for g, keys in GROUPS if any(k in n for k in keys)), "other")


def cuda_events(prof):
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def in_graph(replay, eager: collections.Counter, log=None, reps: int = 5) -> str:
    """Lines on the kernels of `reps` graph replays: the span of a replay, the GPU idle in it (the span less the
    union of its kernels' intervals: kernels of one graph may overlap) and the kernel groups it follows, and the
    kernels that took longer than in the eager forwards (eager: ms a forward by name). log: a file for the first
    replay's kernels, one a line: start and duration (us) and name."""
    replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            replay()
            torch.cuda.synchronize()
    ks = sorted((e.time_range.start, e.time_range.end, e.name) for e in cuda_events(prof))
    n = len(ks) // reps  # the replays ran one after another: each its own n kernels
    if n * reps != len(ks):
        raise RuntimeError(f"{len(ks)} kernels in {reps} replays of one graph")
    span = idle = 0.0
    after, per = collections.Counter(), collections.Counter()
    for r in range(reps):
        one = ks[r * n:(r + 1) * n]
        reach, last = one[0][1], one[0][2]  # the latest end so far, and whose
        for a, b, name in one:
            per[name[:90]] += (b - a) / reps / 1e3
            if a > reach:
                idle += a - reach
                after[group(last)] += (a - reach) / reps / 1e3
            if b > reach:
                reach, last = b, name
        span += reach - one[0][0]
    if log:
        log.write("".join(f"{a - ks[0][0]:9.1f} {b - a:7.1f} {name[:100]}\n" for a, b, name in ks[:n]))
    slower = sorted(((per[k] - eager.get(k, 0.0), k) for k in per if per[k] > eager.get(k, 0.0)), reverse=True)[:4]
    return (f"   in graph: span {span / reps / 1e3:.3f} ms, idle {idle / reps / 1e3:.3f} ms, after: "
            + ", ".join(f"{k} {v:.3f}" for k, v in after.most_common(4))
            + "\n   in graph slower than eager (ms): " + ", ".join(f"{k[:40]} +{d:.3f}" for d, k in slower))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("--batch", action="append", default=None, help="NxL, repeatable")
    ap.add_argument("--norm-backend", action="append", default=None, help="repeatable; default: the engine's")
    ap.add_argument("--trace-dir", help="where to write each graph's kernels, one replay (graph_NxL.txt)")
    a = ap.parse_args()
    for backend in a.norm_backend or [EngineConfig.norm_backend]:
        profile_backend(a.checkpoint, backend, a.batch or ["8x2048", "64x128", "1x16"], a.trace_dir)


def profile_backend(checkpoint, backend, batches, trace_dir=None):
    eng = Engine(EngineConfig(checkpoint, norm_backend=backend))
    rng = np.random.default_rng(0)
    for spec in batches:
        n, L = map(int, spec.split("x"))
        seqs = [rng.integers(4, eng.cfg.vocab_size, L).astype(np.int32) for _ in range(n)]
        ids = np.concatenate(seqs)
        lengths = [L] * n
        t = eng.graphs.key(ids.size, L)
        for _ in range(3):
            eng.graphs.run(ids, lengths, use_graph=False)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                eng.graphs.run(ids, lengths, use_graph=False)
            torch.cuda.synchronize()
        per = collections.Counter()
        top = collections.Counter()
        for e in cuda_events(prof):
            per[group(e.name)] += e.device_time / 5 / 1e3
            top[e.name[:90]] += e.device_time / 5 / 1e3
        g = eng.graphs.graphs[t][0]
        replay = time_ms(g.replay, reps=20, capture=False)
        queued = time_ms(lambda: [g.replay() for _ in range(10)], reps=7, capture=False) / 10
        rested = time_ms(g.replay, reps=20, capture=False, idle_s=0.02)
        with open(f"{trace_dir}/graph_{spec}.txt", "w") if trace_dir else contextlib.nullcontext() as log:
            graph = in_graph(g.replay, top, log)
        t0 = time.perf_counter()
        for _ in range(20):
            eng.embed(seqs)
        embed_ms = (time.perf_counter() - t0) / 20 * 1e3
        print(f"\n== norms={backend} {spec} (graph {t}, attention {eng.graphs.attn[t]}): graph replay {replay:.3f} "
              f"ms GPU ({queued:.3f} ten queued, {rested:.3f} rested), embed() {embed_ms:.3f} ms wall, eager kernels "
              f"{sum(per.values()):.3f} ms")
        print("   " + ", ".join(f"{k} {v:.3f}" for k, v in per.most_common()))
        print(graph)
        for name, ms in top.most_common(8):
            print(f"   {ms:7.3f} ms  {name}")


if __name__ == "__main__":
    main()
