"""perf/serving/bench_serve.py's outputs beside results.json: the throughput / latency plot of w3 over concurrency
(serve_w3.png, where matplotlib is installed) and the summary table printed at the end, one column per server."""
from pathlib import Path

from perf.serving.floor import MODELS


def plot(results, out: Path):
    """serve_w3.png: req/s and p50 / p99 over w3's concurrency, one line per server."""
    try:
        import matplotlib
    except ImportError:
        print("no matplotlib: no plot")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name, r in results.items():
        pts = sorted((int(c), v) for c, v in r["w3"].items() if v)
        if not pts:
            continue
        cs = [c for c, _ in pts]
        a.plot(cs, [v["rps"] for _, v in pts], marker="o", label=name)
        b.plot(cs, [v["p50_ms"] for _, v in pts], marker="o", label=f"{name} p50")
        b.plot(cs, [v["p99_ms"] for _, v in pts], marker="x", linestyle="--", label=f"{name} p99")
    for ax, t in ((a, "throughput (req/s), ~20-token texts"), (b, "latency (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_title(t)
        ax.legend()
        ax.grid(alpha=0.3)
    b.set_yscale("log")
    fig.tight_layout()
    fig.savefig(out / "serve_w3.png", dpi=110)


def summary(results, concurrency):
    """The table of every workload (rows) per server (columns); concurrency: w3's levels."""
    def f(v, k):
        return f"{v[k]:.2f}" if v and v.get(k) is not None else "-"

    def split(r, w="w1"):
        m = (r.get(w) or {}).get("per_model_ms_per_execution", {})
        return " / ".join(f"{m[k]['compute_infer']:.1f}" if k in m else "-" for k in MODELS)

    def serial(r):
        """Per request, the time its model instance spent on it, us, and the mean batch b: what caps one instance's
        throughput. stats_delta's values are b x an execution's duration (see there), so this is value / b^2."""
        m = r.get("w3_c128_per_model", {})

        def one(k):
            b = m[k]["inferences"] / m[k]["executions"]  # single-text requests: rows = requests
            t = sum(m[k][x] for x in ("compute_input", "compute_infer", "compute_output"))
            return f"{t * 1e3 / b / b:.0f} (b{b:.0f})"
        return " / ".join(one(k) if k in m else "-" for k in MODELS)
    rows = [(f"{k} 8x2048 p50 / p99 ms", lambda r, k=k: f"{f(r.get(k), 'p50_ms')} / {f(r.get(k), 'p99_ms')}")
            for k in ("w1", "w1_code", "w1_cjk")]
    rows += [
            *((f"{k} tokenizer / encoder infer ms", lambda r, k=k: split(r, k))
              for k in ("w1", "w1_code", "w1_cjk", "w2")),
            ("w1 tokenizer execute ms", lambda r: f((r.get("w1") or {}), "tokenizer_execute_ms")),
            *((f"{w} encoder execute / embed ms", lambda r, k=k: " / ".join(
                f(r.get(k) or {}, m) for m in ("encoder_execute_ms", "encoder_embed_ms")))
              for w, k in (("w2", "w2"), ("w3 c=128", "w3_c128_encoder"))),
            *((f"{w} tokenizer execute ms a text", lambda r, k=k: f(r.get(k) or {}, "tokenizer_execute_ms_per_text"))
              for w, k in (("w2", "w2"), ("w3 c=128", "w3_c128_encoder"))),
            ("w2 1 query p50 / p99 ms", lambda r: f"{f(r['w2'], 'p50_ms')} / {f(r['w2'], 'p99_ms')}")]
    for c in concurrency:
        rows.append((f"w3 c={c} req/s (p50 ms)", lambda r, c=c: f"{f(r['w3'].get(c), 'rps')} "
                                                                 f"({f(r['w3'].get(c), 'p50_ms')})"))
    rows.append(("w3 c=128 us/req tok / enc (batch)", serial))
    rows.append(("w1 GPU SM MHz / W (mean)", lambda r: " / ".join(
        f"{v:.0f}" if (v := (r.get("w1") or {}).get("gpu", {}).get(k)) is not None else "-"
        for k in ("clocks.sm", "power.draw"))))
    rows.append(("GPU / CPU util at c=128 %", lambda r: f"{r.get('gpu_util_c128') or 0:.0f} / "
                                                        f"{r.get('cpu_util_c128') or 0:.0f}"))
    rows.append(("w4 @70% max: p50 / p99 ms", lambda r: f"{f(r.get('w4'), 'p50_ms')} / {f(r.get('w4'), 'p99_ms')}"))
    rows.append(("w4 max req/s, rate", lambda r: f"{f(r.get('w4'), 'max_rps')}, {(r.get('w4') or {}).get('rate', '-')}"))
    width = max(24, *(len(n) + 2 for n in results))
    print(f"\n{'workload':<34}" + "".join(f"{n:>{width}}" for n in results))
    for label, fn in rows:
        print(f"{label:<34}" + "".join(f"{fn(r):>{width}}" for r in results.values()))
