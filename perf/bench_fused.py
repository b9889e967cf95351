"""Fused-epilogue GEMMs (kernels/fused_gemm.py) against cuBLAS + the separate kernel on the GPU host, at
EmbeddingGemma's shapes: kernel times (triton.testing.do_bench: median, L2 flushed before every call, weights
rotated over 24 layers' copies), the same op as 24 layers captured in one CUDA graph (the model's regime), and the
max relative error of each against an fp32 reference and of fused against the bf16 composition.

  python3 perf/bench_fused.py [--tokens 16 128 1024 8192 16384] [--out bench_fused.json]"""
import argparse
import importlib.util
import itertools
import json
import time
import traceback

import torch
import triton

from egemma.kernels import fused_gemm, native, triton_ops

D, H, HKV, DH, I, EPS, LAYERS = 768, 3, 1, 256, 1152, 1e-6, 24
DEV, DTYPE = "cuda", torch.bfloat16
FLOPS = {"qkv_norm_rope": 2 * D * (H + 2 * HKV) * DH, "gate_up_gelu": 2 * D * 2 * I}  # per token


def layers(gen):
    def r(*shape, scale):
        return (torch.randn(*shape, generator=gen, device=DEV) * scale).to(DTYPE)
    Ls = [dict(qkv=r((H + 2 * HKV) * DH, D, scale=D ** -0.5), gate_up=r(2 * I, D, scale=D ** -0.5),
               q_norm=r(DH, scale=0.3), k_norm=r(DH, scale=0.3), pre_norm=r(D, scale=0.3)) for _ in range(LAYERS)]
    for L in Ls:  # the weights for prenorm=True: the pre-norm's (1 + w) folded in
        L.update(qkv_f=fused_gemm.fold_norm(L["qkv"], L["pre_norm"]),
                 gate_up_f=fused_gemm.fold_norm(L["gate_up"], L["pre_norm"]))
    return Ls


def sgl_gelu():
    if importlib.util.find_spec("sgl_kernel") is None:
        return None
    import sgl_kernel

    def gelu(gu):
        out = torch.empty((gu.shape[0], gu.shape[1] // 2), dtype=gu.dtype, device=gu.device)
        sgl_kernel.gelu_tanh_and_mul(gu, out)
        return out
    return gelu


def variants(pos, cos, sin):
    """op -> name -> f(x, layer). 'gemm' is cuBLAS alone (no epilogue): the floor the fused kernel competes with;
    'fused+prenorm' also normalises x (the RMSNorm before the GEMM, whose output write it saves in the model)."""
    def qk(f):
        return lambda qkv, L: f(qkv, pos, L["q_norm"], L["k_norm"], cos, sin, H, HKV, EPS)
    qkv = {"gemm": lambda x, L: x @ L["qkv"].T,
           "cublas+triton": lambda x, L: qk(triton_ops.qk_norm_rope)(x @ L["qkv"].T, L),
           "fused": lambda x, L: fused_gemm.qkv_norm_rope(x, L["qkv"], pos, L["q_norm"], L["k_norm"], cos, sin,
                                                          H, HKV, EPS),
           "fused+prenorm": lambda x, L: fused_gemm.qkv_norm_rope(x, L["qkv_f"], pos, L["q_norm"], L["k_norm"], cos,
                                                                  sin, H, HKV, EPS, prenorm=True)}
    gu = {"gemm": lambda x, L: x @ L["gate_up"].T,
          "cublas+triton": lambda x, L: triton_ops.gelu_tanh_and_mul(x @ L["gate_up"].T)}
    sgl = sgl_gelu()
    if sgl is not None:
        gu["cublas+sgl"] = lambda x, L: sgl(x @ L["gate_up"].T)
    gu["fused"] = lambda x, L: fused_gemm.gate_up_gelu(x, L["gate_up"])
    gu["fused+prenorm"] = lambda x, L: fused_gemm.gate_up_gelu(x, L["gate_up_f"], EPS, prenorm=True)
    return {"qkv_norm_rope": qkv, "gate_up_gelu": gu}


def flat(out):
    return torch.cat([t.reshape(t.shape[0], -1) for t in out], 1) if isinstance(out, tuple) else out


def rel(a, b):
    a, b = flat(a).float(), flat(b).float()
    return ((a - b).abs().max() / b.abs().max()).item()


def errors(op, x, L, pos, cos, sin):
    """Against the fp32 reference (fp32 GEMM, fp32 op; with prenorm, fp32 rmsnorm first) and, for fused, the bf16
    composition (bf16 GEMM output, then the native op)."""
    xf, xn = x.float(), native.rmsnorm(x.float(), L["pre_norm"].float(), EPS)
    if op == "qkv_norm_rope":
        def ref(inp, w, dt):
            return native.qk_norm_rope(inp @ w.T, pos, L["q_norm"].to(dt), L["k_norm"].to(dt), cos, sin, H, HKV, EPS)
        f32, f32n = ref(xf, L["qkv"].float(), torch.float32), ref(xn, L["qkv"].float(), torch.float32)
        comp = ref(x, L["qkv"], x.dtype)
        fused = fused_gemm.qkv_norm_rope(x, L["qkv"], pos, L["q_norm"], L["k_norm"], cos, sin, H, HKV, EPS)
        pre = fused_gemm.qkv_norm_rope(x, L["qkv_f"], pos, L["q_norm"], L["k_norm"], cos, sin, H, HKV, EPS,
                                       prenorm=True)
    else:
        f32, f32n = (native.gelu_tanh_and_mul(v @ L["gate_up"].float().T) for v in (xf, xn))
        comp = native.gelu_tanh_and_mul(x @ L["gate_up"].T)
        fused = fused_gemm.gate_up_gelu(x, L["gate_up"])
        pre = fused_gemm.gate_up_gelu(x, L["gate_up_f"], EPS, prenorm=True)
    return {"fused_vs_fp32": rel(fused, f32), "composition_vs_fp32": rel(comp, f32), "fused_vs_composition":
            rel(fused, comp), "prenorm_vs_fp32": rel(pre, f32n)}


def kernel_ms(f, x, Ls):
    it = itertools.count()
    return triton.testing.do_bench(lambda: f(x, Ls[next(it) % len(Ls)]), warmup=25, rep=100, return_mode="median")


def graph_ms(f, x, Ls, reps=20):
    """ms per layer: LAYERS calls, one per layer's weights, captured in one CUDA graph and replayed."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for L in Ls:
            f(x, L)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for L in Ls:
            f(x, L)
    for _ in range(3):
        g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    end.synchronize()
    del g
    return start.elapsed_time(end) / reps / len(Ls)


def short(c):
    if c is None:
        return "-"
    k = c.kwargs
    n = f"N{k['BLOCK_N']}" if "BLOCK_N" in k else ""
    return f"M{k['BLOCK_M']}{n}K{k['BLOCK_K']}w{c.num_warps}s{c.num_stages}"


def attempt(fn, what):
    try:
        return fn()
    except Exception as e:  # one failing variant must not cost the lead the rest of the device call
        print(f"  !! {what}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
        traceback.print_exc(limit=2)
        return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 128, 1024, 8192, 16384])
    ap.add_argument("--graph-tokens", type=int, nargs="+", default=[16, 128, 1024, 16384])
    ap.add_argument("--out")
    args = ap.parse_args()
    gen = torch.Generator(device=DEV).manual_seed(0)
    Ls = layers(gen)
    cos, sin = native.rope_table(10_000.0, DH, 2048, DEV)
    results, start = [], time.perf_counter()
    for T in args.tokens:
        x = torch.randn(T, D, generator=gen, device=DEV).to(DTYPE)
        pos = torch.arange(T, device=DEV) % 2048  # 8 x 2048 packs 8 sequences of positions 0..2047
        for op, vs in variants(pos, cos, sin).items():
            row = {"op": op, "T": T, "kernel_ms": {}, "graph_ms": {}}
            tuned = fused_gemm.TUNED[op]
            for name, f in vs.items():  # a fused variant's first call autotunes this T bucket
                t0 = time.perf_counter()
                row["kernel_ms"][name] = attempt(lambda: kernel_ms(f, x, Ls), f"{op} T={T} {name}")
                if fused_gemm.best_config(op, T, prenorm=name == "fused+prenorm") and name.startswith("fused"):
                    row[f"{name} tuning s"] = round(time.perf_counter() - t0, 1)
                    row[f"{name} configs"] = sorted(((short(c), t[0]) for c, t in
                                                     getattr(tuned, "configs_timings", {}).items()),
                                                    key=lambda ct: ct[1])[:6]
            row["errors"] = attempt(lambda: errors(op, x, Ls[0], pos, cos, sin), f"{op} T={T} errors")
            if T in args.graph_tokens:
                for name, f in vs.items():
                    row["graph_ms"][name] = attempt(lambda: graph_ms(f, x, Ls), f"{op} T={T} graph {name}")
            results.append(row)
            report(row)
        print(f"  (T={T} done at {time.perf_counter() - start:.0f} s)")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=1)


def report(row):
    k, g = row["kernel_ms"], row["graph_ms"]
    seps = {n: v for n, v in k.items() if n.startswith("cublas+") and v is not None}
    sep = min(seps, key=seps.get) if seps else None
    fused = k.get("fused")

    def fmt(v):
        return f"{v * 1e3:8.1f}" if v is not None else "    fail"
    line = (f"{row['op']:14s} T={row['T']:6d}  us: " + " ".join(f"{n}={fmt(v)}" for n, v in k.items()))
    if sep and fused:
        tf = FLOPS[row["op"]] * row["T"] / (fused * 1e-3) / 1e12
        tg = FLOPS[row["op"]] * row["T"] / (k["gemm"] * 1e-3) / 1e12 if k.get("gemm") else float("nan")
        line += f"  fused/{sep}={fused / seps[sep]:.3f}  TFLOP/s fused {tf:.0f} gemm {tg:.0f}"
    print(line)
    if g:
        gs = {n: v for n, v in g.items() if n.startswith("cublas+") and v is not None}
        gsep = min(gs, key=gs.get) if gs else None
        ratio = f"  fused/{gsep}={g['fused'] / gs[gsep]:.3f}" if gsep and g.get("fused") else ""
        print(f"{'':14s} graph us/layer: " + " ".join(f"{n}={fmt(v)}" for n, v in g.items()) + ratio)
    e = row["errors"]
    if e:
        print(f"{'':14s} max rel err: " + " ".join(f"{n}={v:.2e}" for n, v in e.items()))
    for name in ("fused", "fused+prenorm"):
        if row.get(f"{name} configs"):
            print(f"{'':14s} {name} (first call incl. tuning {row[f'{name} tuning s']} s) top configs: "
                  + "; ".join(f"{c} {t * 1e3:.1f}us" for c, t in row[f"{name} configs"][:3]))


if __name__ == "__main__":
    main()
