"""The row-wise Triton-lang kernels (kernels/triton_ops.py: norm_add_norm, norm_add_rstd, qk_norm_rope) on Gemma's
shapes, against a plain copy of the same bytes (the bandwidth they could reach), sgl-kernel's norms, and
qk_norm_rope per warp count. 24 layers' worth of different buffers in one CUDA graph, median us per layer.

  python perf/bench_norms.py [--tokens 16,1024,16384]"""
import torch
from bench_fused import D, LAYERS, per_layer, setup

from egemma.kernels import native, triton_ops as t
from egemma.kernels.select import available_norm_backends

H, HKV, DH = 3, 1, 256
WARPS = (1, 2, 4, 8)


def show(name, T, row, traffic):
    best = min(row, key=row.get)
    print(f"{name} T={T}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()) +
          f" us; best {best} {traffic / row[best] / 1e6:.2f} TB/s", flush=True)


def kernels(T, dev, dt, cos, sin, sgl):
    xs = [torch.randn(T, D, device=dev, dtype=dt) for _ in range(LAYERS)]
    hs = [torch.randn(T, D, device=dev, dtype=dt) * 10 for _ in range(LAYERS)]
    w = torch.randn(D, device=dev, dtype=dt) * 0.1
    outs = [torch.empty_like(x) for x in xs]
    copy = per_layer(lambda i: outs[i].copy_(xs[i]))
    print(f"copy T={T}: {copy:.2f} us, {2 * T * D * 2 / copy / 1e6:.2f} TB/s", flush=True)
    row = {"triton": per_layer(lambda i: t.norm_add_norm(xs[i], hs[i], w, w, 1e-6))}
    if sgl:
        import sgl_kernel

        def sgl_nan(i):
            y = sgl_kernel.gemma_rmsnorm(xs[i], w, 1e-6)
            sgl_kernel.gemma_fused_add_rmsnorm(y, hs[i], w, 1e-6)
        row["sgl-kernel"] = per_layer(sgl_nan)
    show("norm_add_norm", T, row, 4 * T * D * 2)
    rstd = per_layer(lambda i: t.norm_add_rstd(xs[i], hs[i], w, 1e-6))
    print(f"norm_add_rstd T={T}: {rstd:.2f} us, {3 * T * D * 2 / rstd / 1e6:.2f} TB/s", flush=True)
    qkvs = [torch.randn(T, (H + 2 * HKV) * DH, device=dev, dtype=dt) for _ in range(LAYERS)]
    pos = torch.arange(T, device=dev) % 2048
    qw = torch.randn(DH, device=dev, dtype=dt) * 0.1
    row = {f"w{nw}": per_layer(lambda i: t.qk_norm_rope(qkvs[i], pos, qw, qw, cos, sin, H, HKV, 1e-6, warps=nw))
           for nw in WARPS}
    row["default"] = per_layer(lambda i: t.qk_norm_rope(qkvs[i], pos, qw, qw, cos, sin, H, HKV, 1e-6))
    show("qk_norm_rope", T, row, 2 * T * (H + HKV) * DH * 2)


def main():
    tokens, dev, dt = setup("16,1024,16384")
    sgl = "sgl-kernel" in available_norm_backends(dev)
    cos, sin = native.rope_table(10_000.0, DH, 2048, dev)
    for T in tokens:
        kernels(T, dev, dt, cos, sin, sgl)


if __name__ == "__main__":
    main()
