"""Where each Python-backend model's time goes while serving: py-spy samples the tokenizer's and the encoder's stub
processes during w1 (8 x ~2048 tokens) and w2 (one ~16-token query), each sent back to back over gRPC, and prints
each one's heaviest lines (self time, and time inside each of our functions).

  python -m perf.serving.spy_serve CHECKPOINT --out DIR [--py-spy PATH] [--seconds 8]"""
import argparse
import collections
import random
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from egemma.engine.config import ModelConfig
from egemma.engine.tokenizer import TextTokenizer
from egemma.ops.procfs import stub_pids
from perf.lib.corpora import make_text, prose
from perf.lib.loadgen import Target, one_at_a_time
from perf.lib.servers import triton


def load(url: str, texts: list[str], seconds: float) -> dict:
    """16 requests of the texts in turn, back to back (perf/lib/loadgen.py's one_at_a_time), for `seconds`."""
    n = len(texts) // 16 or 1
    return one_at_a_time(Target("grpc", url, "embeddinggemma"), [texts[i:i + n] for i in range(0, len(texts), n)],
                         warmup=3, max_n=10 ** 9, seconds=seconds)


def top(raws: list[Path], n: int = 14) -> str:
    """The heaviest frames of py-spy's raw (collapsed) output: self time per line, and inclusive time per function
    of the egemma / model code."""
    self_t, incl, total = collections.Counter(), collections.Counter(), 0
    for line in (ln for raw in raws if raw.exists() for ln in raw.read_text().splitlines()):
        stack, _, count = line.rpartition(" ")
        frames, c = stack.split(";"), int(count)
        total += c
        self_t[frames[-1]] += c
        for f in {f for f in frames if "egemma" in f or "model.py" in f}:
            incl[f] += c
    out = [f"  {total} samples; self:"] + [f"    {c / total:6.1%}  {f[:150]}" for f, c in self_t.most_common(n)]
    out += ["  inclusive (our code):"] + [f"    {c / total:6.1%}  {f[:150]}" for f, c in incl.most_common(n)]
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--py-spy", default=shutil.which("py-spy") or "py-spy")
    ap.add_argument("--seconds", type=int, default=8)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    tok = TextTokenizer(ModelConfig.load(a.checkpoint))
    words, rng = prose(), random.Random(0)
    work = {"w1": [make_text(tok, words, 2047, rng) for _ in range(128)],
            "w2": [make_text(tok, words, 16, rng) for _ in range(16)]}
    with triton(a.checkpoint, a.out / "server.log") as s:
        stubs = stub_pids(s.proc.pid)  # {pid: its model.py}
        pids = {m: [p for p, path in stubs.items() if f"/{m}/" in path]
                for m in ("embeddinggemma_tokenizer", "embeddinggemma_encoder")}
        if not all(pids.values()):
            raise SystemExit(f"no stub process for some model: {pids}")
        for w, texts in work.items():
            with ThreadPoolExecutor(1) as ex:
                # the load outlasts the sampling: py-spy's start and its --seconds, after a warm-up
                running = ex.submit(load, s.grpc_url, texts, a.seconds + 12)
                time.sleep(2)  # warm-up (not a sync: only how long before sampling starts)
                raws = {m: [a.out / f"{w}_{m}_{pid}.txt" for pid in ps] for m, ps in pids.items()}
                spies = [subprocess.Popen([a.py_spy, "record", "-p", str(pid), "-r", "997", "-d", str(a.seconds),
                                           "--format", "raw", "-o", str(raw), "--nonblocking"],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
                         for m, ps in pids.items() for pid, raw in zip(ps, raws[m])]
                for p in spies:
                    p.wait()
                r = running.result()
            if r["errors"]:
                raise SystemExit(f"{w}: {r['errors']} requests failed")
            print(f"== {w}: {r['n']} requests, p50 {r['p50_ms']:.2f} ms", flush=True)
            for m in pids:
                print(f"-- {m} ({len(pids[m])} instances)\n{top(raws[m])}", flush=True)


if __name__ == "__main__":
    main()
