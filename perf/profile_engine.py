"""Where the engine's GPU time goes: torch.profiler over eager forwards of one workload, kernels grouped into
GEMM / attention / norm / activation / rope / pooling / other, plus graph-replay wall time vs GPU time.

  python perf/profile_engine.py CHECKPOINT [--batch 64x128]"""
import argparse
import collections
import time

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from egemma.engine import Engine, EngineConfig
from egemma.kernels.select import time_ms

GROUPS = [("gemm+gelu", ("gate_up_gelu",)), ("attention", ("flash", "fmha", "attn")),
          ("gemm", ("gemm", "sm90", "cutlass", "cublas", "nvjet")),
          ("norm", ("rmsnorm", "norm")), ("activation", ("gelu",)), ("rope", ("qk_norm_rope",)),
          ("copy/fill", ("copy", "fill", "memcpy", "memset"))]


def group(name: str) -> str:
    n = name.lower()
    return next((g for g, keys in GROUPS if any(k in n for k in keys)), "other")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("--batch", action="append", default=None, help="NxL, repeatable")
    ap.add_argument("--norm-backend", action="append", default=None, help="repeatable; default: all available")
    a = ap.parse_args()
    for backend in a.norm_backend or ["auto"]:
        profile_backend(a.checkpoint, backend, a.batch or ["8x2048", "64x128", "1x16"])


def profile_backend(checkpoint, backend, batches):
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
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                per[group(e.name)] += e.device_time / 5 / 1e3
                top[e.name[:90]] += e.device_time / 5 / 1e3
        replay = time_ms(eng.graphs.graphs[t][0].replay, reps=20, capture=False)
        t0 = time.perf_counter()
        for _ in range(20):
            eng.embed(seqs)
        embed_ms = (time.perf_counter() - t0) / 20 * 1e3
        print(f"\n== norms={backend} {spec} (graph {t}, attention {eng.graphs.attn[t]}): graph replay {replay:.3f} ms GPU, "
              f"embed() {embed_ms:.3f} ms wall, eager kernels {sum(per.values()):.3f} ms")
        print("   " + ", ".join(f"{k} {v:.3f}" for k, v in per.most_common()))
        for name, ms in top.most_common(8):
            print(f"   {ms:7.3f} ms  {name}")


if __name__ == "__main__":
    main()
