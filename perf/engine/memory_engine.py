"""GPU memory of one engine, stage by stage, against the <= 2 GiB budget per encoder instance: each variant in its
own process (the allocator reads PYTORCH_CUDA_ALLOC_CONF at CUDA init), reporting torch's allocated / reserved
memory and the process's own GPU memory (nvidia-smi, context and libraries included) after load + capture,
the 8 x 2048 and 1 x 16 graph-replay times, and how much of the allocation is cuBLAS workspaces.

  python -m perf.engine.memory_engine CHECKPOINT [--variant NAME:ENV=VAL,max_tokens=N ...] [--out results.json]

A variant is a name, then comma-separated settings: UPPERCASE=... goes to the environment, anything else to
EngineConfig. Default: the defaults, expandable_segments, max_tokens 8192."""
import argparse
import json
import logging
import os
import subprocess
import sys
import time

import torch

from egemma.engine import Engine, EngineConfig
from egemma.ops.repository import ROOT
from perf.engine.bench_engine import timed, workloads

DEFAULT = ["default:", "expandable:PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True", "max8192:max_tokens=8192"]


def process_mib() -> int:
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True).stdout
    return sum(int(m) for p, m in (line.split(",") for line in out.splitlines() if line.strip())
               if int(p) == os.getpid())


def child(checkpoint: str, settings: dict) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    gib = 2 ** -30
    t0 = time.perf_counter()
    eng = Engine(EngineConfig(checkpoint, **settings))
    torch.cuda.synchronize()
    r = {"load_s": time.perf_counter() - t0, "graphs": len(eng.graphs.graphs),
         "allocated_gib": torch.cuda.memory_allocated() * gib, "reserved_gib": torch.cuda.memory_reserved() * gib,
         "peak_gib": torch.cuda.max_memory_allocated() * gib, "process_mib": process_mib(),
         "weights_gib": eng.model.weight_bytes() * gib}
    batches = workloads(eng.cfg.vocab_size)
    for name in ("8x2048", "1x16"):
        r[f"{name}_ms"] = timed(lambda: eng.embed(batches[name]), 30)
    r["process_mib_after_runs"] = process_mib()
    before = torch.cuda.memory_allocated()
    torch._C._cuda_clearCublasWorkspaces()  # diagnosis only: the graphs point into them, so nothing runs after
    r["cublas_workspaces_gib"] = (before - torch.cuda.memory_allocated()) * gib
    return r


def parse(variant: str) -> tuple[str, dict, dict]:
    name, _, rest = variant.partition(":")
    env, cfg = {}, {}
    for item in filter(None, rest.split(",")):
        k, _, v = item.partition("=")
        (env if k.isupper() else cfg)[k] = v if k.isupper() else int(v) if v.isdigit() else v
    return name, env, cfg


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("--variant", action="append")
    ap.add_argument("--out")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print("RESULT " + json.dumps(child(a.checkpoint, json.loads(a.child))), flush=True)
        return
    rows = {}
    for v in a.variant or DEFAULT:
        name, env, cfg = parse(v)
        p = subprocess.run([sys.executable, "-m", "perf.engine.memory_engine", a.checkpoint, "--child",
                            json.dumps(cfg)], env={**os.environ, **env}, capture_output=True, text=True, cwd=ROOT)
        line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        if not line:
            print(f"{name}: failed\n{p.stderr[-3000:]}")
            continue
        rows[name] = json.loads(line[0][7:])
        print("\n".join(x for x in p.stderr.splitlines() if "egemma:" in x and "captured in" in x)[-400:])
    keys = ["process_mib", "process_mib_after_runs", "allocated_gib", "reserved_gib", "peak_gib", "weights_gib",
            "cublas_workspaces_gib", "graphs", "8x2048_ms", "1x16_ms", "load_s"]
    print(f"{'variant':<14}" + "".join(f"{k[:14]:>15}" for k in keys))
    for name, r in rows.items():
        print(f"{name:<14}" + "".join(f"{r[k]:>15.2f}" if isinstance(r[k], float) else f"{r[k]:>15}" for k in keys))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
