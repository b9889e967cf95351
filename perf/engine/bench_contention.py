"""Several engines in several processes on one GPU, as Triton's encoder instances are: what each batch's embed()
costs when the others run too, and what serialising them or CUDA MPS changes (perf/RESULTS.md, the c=128 target).
Each process loops: `--other-ms` away from the GPU (what Triton's response path and the model's parsing take on
the instance between two executes), then embed() of a batch of short texts, timed.

  python -m perf.engine.bench_contention CHECKPOINT [--procs 3] [--texts 29] [--other-ms 4] [--seconds 6]
      [--pool NAME ...] [--modes MODE ...]
  pools (each a fresh set of processes): default | blocking (the CUDA context syncs by blocking, not spinning) | mps;
  modes: alone (one process) | free | lock (a file lock around each embed: one process on the GPU at a time), each
  optionally :K[:NICE], with K processes spinning on the host's CPUs beside it (at that niceness) as Triton's other
  threads and processes do under load"""
import argparse
import contextlib
import ctypes
import fcntl
import json
import multiprocessing as mp
import os
import subprocess
import time

import numpy as np

POOLS = ("default", "blocking", "mps")
LOCK = "/tmp/egemma-contention.lock"


def _blocking_sync():
    """The primary context's flags before torch creates it: a host wait blocks on an interrupt instead of spinning."""
    cuda = ctypes.CDLL("libcuda.so.1")
    assert cuda.cuInit(0) == 0
    assert cuda.cuDevicePrimaryCtxSetFlags(0, 4) == 0  # CU_CTX_SCHED_BLOCKING_SYNC


def _burn(nice):
    os.nice(nice)
    while True:
        pass


def worker(rank, ckpt, pool, texts, other_ms, cmds, results, ready):
    if pool == "blocking":
        _blocking_sync()
    from egemma.engine.engine import Engine, EngineConfig
    engine = Engine(EngineConfig(ckpt))
    rng = np.random.default_rng(rank)
    vocab = engine.cfg.vocab_size
    batch = [rng.integers(4, vocab, int(n)).astype(np.int32) for n in rng.integers(12, 29, texts)]
    for _ in range(20):
        engine.embed(batch)
    ready.release()
    lockf = open(LOCK, "w")
    while True:
        cmd = cmds.get()
        if cmd is None:
            return
        mode, start, seconds = cmd
        mode = mode.split(":")[0]
        if mode == "alone" and rank > 0:
            results.put((rank, []))
            continue
        while time.time() < start:
            time.sleep(0.0005)
        lat, end = [], start + seconds
        while time.time() < end:
            time.sleep(other_ms / 1e3)
            t0 = time.perf_counter()
            with (_flock(lockf) if mode == "lock" else contextlib.nullcontext()):
                engine.embed(batch)
            lat.append((time.perf_counter() - t0) * 1e3)
        results.put((rank, lat))


@contextlib.contextmanager
def _flock(f):
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(f, fcntl.LOCK_UN)


def run_pool(pool, args):
    ctx = mp.get_context("spawn")
    if pool == "mps" and subprocess.run(["nvidia-cuda-mps-control", "-d"]).returncode != 0:
        print("mps: the daemon did not start; skipped")
        return {}
    cmds = [ctx.Queue() for _ in range(args.procs)]
    results, ready = ctx.Queue(), ctx.Semaphore(0)
    procs = []
    for r in range(args.procs):  # one at a time: each times its kernels at load, alone on the GPU
        p = ctx.Process(target=worker, args=(r, args.checkpoint, pool, args.texts, args.other_ms, cmds[r], results,
                                             ready))
        p.start()
        procs.append(p)
        ready.acquire()
    out = {}
    try:
        for mode in args.modes:
            k, nice = (list(map(int, mode.split(":")[1:])) + [0, 0])[:2]
            burners = [mp.get_context("fork").Process(target=_burn, args=(nice,), daemon=True) for _ in range(k)]
            for b in burners:
                b.start()
            start = time.time() + 0.5
            for q in cmds:
                q.put((mode, start, args.seconds))
            lat = [x for _ in procs for x in results.get()[1]]
            for b in burners:
                b.kill()
                b.join()
            a = np.array(lat)
            out[mode] = {"batches_per_s": len(a) / args.seconds, "p50": float(np.median(a)),
                         "mean": float(a.mean()), "p99": float(np.percentile(a, 99))}
            print(f"{pool:9s} {mode:6s} {args.procs if not mode.startswith('alone') else 1} procs: embed() p50 "
                  f"{out[mode]['p50']:.3f} mean {out[mode]['mean']:.3f} p99 {out[mode]['p99']:.3f} ms, "
                  f"{out[mode]['batches_per_s']:.0f} batches/s ({out[mode]['batches_per_s'] * args.texts:.0f} texts/s)",
                  flush=True)
    finally:
        for q in cmds:
            q.put(None)
        for p in procs:
            p.join()
        if pool == "mps":
            subprocess.run(["nvidia-cuda-mps-control"], input=b"quit\n", check=False)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("--procs", type=int, default=3)
    ap.add_argument("--texts", type=int, default=29)
    ap.add_argument("--other-ms", type=float, default=4.0)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--pool", nargs="+", default=list(POOLS), choices=POOLS)
    ap.add_argument("--modes", nargs="+", default=["alone", "free", "lock"])
    ap.add_argument("--out")
    args = ap.parse_args()
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    res = {p: run_pool(p, args) for p in args.pool}
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": res}, f, indent=1)


if __name__ == "__main__":
    main()
