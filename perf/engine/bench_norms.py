"""The row-wise Triton-lang kernels (egemma/kernels/triton_ops.py: norm_add_norm, norm_add_rstd, qk_norm_rope, embed,
mean_pool) on Gemma's shapes, against a plain copy of the same bytes (the bandwidth they could reach), sgl-kernel's
norms, qk_norm_rope per warp count and mean_pool per tile. 24 layers' worth of different buffers in one CUDA graph,
median us per layer (embed and mean_pool run once a forward: the same).

  python -m perf.engine.bench_norms [--tokens 16,1024,16384]"""
import torch
from perf.engine.bench_fused import D, LAYERS, per_layer, setup

from egemma.kernels import native, triton_ops as t
from egemma.engine.select import available_norm_backends

H, HKV, DH = 3, 1, 256
WARPS = (1, 2, 4, 8)
POOL = ((64, 64, 4), (128, 32, 4), (256, 32, 4), (64, 32, 4), (128, 16, 4))  # rows a step, columns, warps


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
    r = torch.rand(T, device=dev) + 0.5
    row = {f"w{nw}": per_layer(lambda i: t.qk_norm_rope(qkvs[i], pos, qw, qw, cos, sin, H, HKV, 1e-6, r, warps=nw))
           for nw in WARPS}
    row["default"] = per_layer(lambda i: t.qk_norm_rope(qkvs[i], pos, qw, qw, cos, sin, H, HKV, 1e-6, r))
    show("qk_norm_rope", T, row, 2 * T * (H + 2 * HKV) * DH * 2)
    table = torch.randn(262144, D, device=dev, dtype=dt) * 0.03
    ids = [torch.randint(0, table.shape[0], (T,), device=dev) for _ in range(LAYERS)]
    scale = torch.tensor(D ** 0.5, dtype=dt)
    row = {"triton": per_layer(lambda i: t.embed(ids[i], table, scale, 1e-6)),
           "native": per_layer(lambda i: native.embed(ids[i], table, scale, 1e-6))}
    show("embed", T, row, 2 * T * D * 2)
    seqs = min(8, T)  # as the graphs lay a batch out: 8 sequences of T / 8 in min(256, T) slots, the rest empty
    slots = min(256, T)
    cu = torch.tensor([T * min(j, seqs) // seqs for j in range(slots + 1)], dtype=torch.int32, device=dev)
    row = {"x".join(map(str, tile)): per_layer(lambda i: t.mean_pool(xs[i], cu, slots, tile=tile)) for tile in POOL}
    show("mean_pool", T, row, T * D * 2)


def main():
    tokens, dev, dt = setup("16,1024,16384")
    sgl = "sgl-kernel" in available_norm_backends(dev)
    cos, sin = native.rope_table(10_000.0, DH, 2048, dev)
    for T in tokens:
        kernels(T, dev, dt, cos, sin, sgl)


if __name__ == "__main__":
    main()
