"""The fused gate_up + gelu_and_mul GEMM (egemma/kernels/fused_gemm.py) in each tile against cuBLAS + a separate
gelu_and_mul, on Gemma's shapes, at each token count: 24 layers' worth of different weights in one CUDA graph (as
in the forward), median us per layer. cublas+sgl-kernel is the layout before the interleaved gate_up (sgl-kernel's
op reads [gate | up] halves), for comparison; "row-scaled": with the folded pre-MLP norm's row scale in the epilogue.

  python -m perf.engine.bench_fused [--tokens 16,64,...]"""
import argparse

import torch

from egemma.kernels import fused_gemm as fg, native, triton_ops
from egemma.engine.select import available_norm_backends, time_layers

D, I, LAYERS = 768, 1152, 24


def per_layer(fn) -> float:
    """Median us of one fn(i), 24 layers' different buffers in one graph (perf/engine/bench_norms.py uses it too)."""
    return time_layers(fn, LAYERS, reps=7) * 1e3


def setup(tokens: str) -> tuple[list[int], torch.device, torch.dtype]:
    """(token counts of --tokens, device, dtype), the generator seeded: how these benchmarks start."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default=tokens)
    torch.manual_seed(0)
    return [int(t) for t in ap.parse_args().tokens.split(",")], torch.device("cuda"), torch.bfloat16


def main():
    tokens, dev, dt = setup("16,64,256,1024,4096,8192,16384")
    w = [torch.randn(2 * I, D, device=dev, dtype=dt) / D ** .5 for _ in range(LAYERS)]
    gelus = {"triton": triton_ops.gelu_tanh_and_mul}
    if "sgl-kernel" in available_norm_backends(dev):
        import sgl_kernel

        def sgl(gu):
            out = torch.empty((gu.shape[0], gu.shape[1] // 2), dtype=gu.dtype, device=gu.device)
            sgl_kernel.gelu_tanh_and_mul(gu, out)
            return out
        gelus["sgl-kernel"] = sgl
    for T in tokens:
        x = torch.randn(T, D, device=dev, dtype=dt) * 3
        row = {f"cublas+{name}": per_layer(lambda i: g(x @ w[i].T)) for name, g in gelus.items()}
        ref = native.gate_up_gelu(x, w[0]).float()
        rstd = torch.rand(T, device=dev) + 0.5
        ref_scaled = native.gate_up_gelu(x, w[0], rstd).float()
        for t in fg.TILES:
            err = (fg.gate_up_gelu(x, w[0], t).float() - ref).abs().max().item() / ref.abs().max().item()
            row[f"fused {t} (err {err:.0e})"] = per_layer(lambda i: fg.gate_up_gelu(x, w[i], t))
            err = (fg.gate_up_gelu(x, w[0], t, rstd).float() - ref_scaled).abs().max().item() / \
                ref_scaled.abs().max().item()
            row[f"fused {t} row-scaled (err {err:.0e})"] = per_layer(lambda i: fg.gate_up_gelu(x, w[i], t, rstd))
        best = min(v for k, v in row.items() if k.startswith("fused"))
        print(f"gate_up T={T}: " + ", ".join(f"{k} {v:.1f} us" for k, v in row.items()) +
              f"; best fused {2 * T * D * 2 * I / best / 1e6:.0f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
